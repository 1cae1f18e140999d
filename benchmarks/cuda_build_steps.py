"""Host work of building N CUDA-path decode steps, for instruction counts on a CPU.

The graph build of a decode step (our Python, MLX's op construction) is host time on every
layer and step. Wall-clock timings of it on a shared 2-core VM move by ±30 % between runs;
instruction counts under callgrind do not (±0.3 %), so trees are compared by those:

    for n in 0 200; do PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python3 benchmarks/cuda_build_steps.py layer $n 2>&1 | grep Collected; done

(per step = (count at N - count at 0) / N; `step` times `bench.qsa_step`, selection +
attention only, with N = 2000). Kernels are `cuda_layer_counts.py`'s stand-ins (outputs made
once per shape; it also routes the layer to its CUDA path on a CPU); the graphs are built, not
evaluated, at context 8K, one row.
"""

from __future__ import annotations

import sys

import cuda_layer_counts
import mlx.core as mx


def main() -> None:
    what, n = sys.argv[1], int(sys.argv[2])
    cuda_layer_counts._install_stand_ins()
    from mlx_qsa import bench
    from mlx_qsa.config import QSAConfig
    from mlx_qsa.layer import QSAAttention
    from mlx_qsa.rope import text_rope

    cfg = QSAConfig()
    mx.random.seed(0)
    if what == "layer":
        layer = QSAAttention(cfg, fused=4)
        layer.set_dtype(mx.bfloat16)
        mx.eval(layer.parameters())
        cache = bench.random_cache(layer, 8192, 1, 0)
        x = bench.layer_rows(cfg, 1, 1)
        mx.eval(x)

        def step() -> mx.array:
            text_rope.cache_clear()  # as the bench: a model's first QSA layer at this step
            y = layer(x, cache=cache)
            cache.trim(1)
            return y

        for _ in range(3):
            mx.eval(step(), *cache.state)
    elif what == "step":
        s = bench.DecodeSet(cfg, 8192, 1, 0)

        def step() -> mx.array:
            return bench.qsa_step(cfg, s, "cuda")[0]

        for _ in range(3):
            step()
    else:
        raise SystemExit(f"usage: {sys.argv[0]} layer|step N")
    built = [step() for _ in range(n)]
    print(f"built {len(built)} {what} steps")


if __name__ == "__main__":
    main()
