"""Python host time of the CUDA selection + attention step (`bench.qsa_step`, impl "cuda"), on
any machine: MLX's CUDA availability, the device limits and `mx.fast.cuda_kernel` are replaced
by stand-ins (a stand-in kernel returns lazy zeros of its output shapes), so what is timed is
our own launch code and the graph it builds, not MLX's kernel call or evaluation.

    python3 benchmarks/host_build.py [--context 8192] [--steps 2000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx


def stand_in_cuda() -> None:
    from mlx_qsa.kernels import _launch, device

    class Kernel:
        def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, **kw):
            # **kw: `template=` (launchers no longer pass it: their kernels declare the values)
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    mx.cuda.is_available = lambda: True
    device.current = lambda: device.HOPPER
    mx.fast.cuda_kernel = lambda **kw: Kernel()
    _launch.build.cache_clear()


def stand_in_cuda_layer(context: int, rows: int):
    """On the stand-in device (`stand_in_cuda`), a QSAAttention of the real geometry (fused=4,
    bf16, seed 0) that routes to the CUDA implementations, a random cache at `context` and
    `rows` input rows: (layer, cache, x)."""
    stand_in_cuda()
    import mlx_qsa.layer as layer_mod
    from mlx_qsa.bench import layer_rows, random_cache
    from mlx_qsa.config import QSAConfig, QSAOptions

    # the stand-in device is a CUDA GPU the kernels run on
    layer_mod.resolve_impl = lambda kernels="auto": "portable" if kernels == "portable" else "cuda"
    cfg = QSAConfig()
    mx.random.seed(0)
    layer = layer_mod.QSAAttention(cfg, options=QSAOptions(kernels="auto"), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer, random_cache(layer, context, rows, seed=1), layer_rows(cfg, rows, seed=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    stand_in_cuda()
    from mlx_qsa.bench import DecodeSet, qsa_step
    from mlx_qsa.config import QSAConfig

    cfg = QSAConfig()
    s = DecodeSet(cfg, args.context, 1, seed=1)
    for _ in range(50):
        qsa_step(cfg, s, "cuda")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        qsa_step(cfg, s, "cuda")
        times.append(time.perf_counter() - t0)
    print(f"context {args.context}: {statistics.median(times) * 1e6:.1f} us per step (median)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            qsa_step(cfg, s, "cuda")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
