"""MLX primitives of the CUDA layer's decode step, counted on any machine (no GPU): every
`mx.fast.cuda_kernel` is replaced by a stand-in whose outputs are host-made zeros (graph leaves)
tied to all its inputs by one `mx.depends`, so the graph keeps what feeds the kernels and each
kernel counts as one primitive (`Depends` in place of `CustomKernel`). Each primitive costs
host time on every step (BENCHMARKS.md); this counts them where that work can be tested: on a
CPU.

    python3 benchmarks/cuda_layer_counts.py [--contexts 8192,131072] [--rows 1,4] [--dot OUT.dot]
"""

from __future__ import annotations

import argparse

import mlx.core as mx

_outputs: dict = {}  # evaluated zeros by (shape, dtype), made once: graph leaves


class _StandInKernel:
    def __init__(self, **_: object) -> None:
        pass

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_: object) -> list[mx.array]:
        outs = []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            key = (tuple(shape), dtype)
            if key not in _outputs:
                _outputs[key] = mx.zeros(shape, dtype=dtype)
                mx.eval(_outputs[key])
            outs.append(_outputs[key])
        return mx.depends(outs, list(inputs))


def _install_stand_ins() -> None:
    """CUDA routing on a CPU: kernels, device limits and the implementation choice."""
    mx.fast.cuda_kernel = lambda **kw: _StandInKernel(**kw)
    mx.cuda.is_available = lambda: True
    from mlx_qsa import kernels, layer
    from mlx_qsa.kernels import device

    device.current = lambda: device.HOPPER
    kernels.current = device.current

    def resolve(k: str = "auto") -> str:
        return "portable" if k == "portable" else "cuda"

    kernels.resolve_impl = resolve
    layer.resolve_impl = resolve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,131072")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--dot", default="")
    args = ap.parse_args()
    _install_stand_ins()
    from mlx_qsa import bench
    from mlx_qsa.config import QSAConfig
    from mlx_qsa.layer import QSAAttention
    from mlx_qsa.rope import text_rope

    cfg = QSAConfig()
    mx.random.seed(0)
    layer = QSAAttention(cfg, fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    for T in (int(c) for c in args.contexts.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            cache = bench.random_cache(layer, T, rows, 0)
            x = bench.layer_rows(cfg, rows, 1)
            mx.eval(x)
            for _ in range(2):  # the second call is counted, as the bench does
                text_rope.cache_clear()
                y = layer(x, cache=cache)
                counts = bench.primitive_counts(y, *cache.state)
                if args.dot:
                    with open(args.dot, "w") as f:
                        mx.export_to_dot(f, y, *cache.state)
                mx.eval(y, *cache.state)
                cache.trim(rows)
            kinds = counts["by_kind"]
            print(f"T={T} rows={rows} {layer.last_call.consumers}: {counts['total']} primitives, "
                  f"{kinds.get('Depends', 0)} of them stand-in kernels")  # fmt: skip
            print("  ", dict(sorted(kinds.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
