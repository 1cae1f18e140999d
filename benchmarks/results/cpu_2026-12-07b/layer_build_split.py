"""Where the CUDA layer decode step's graph build goes (stand-in kernels, 128K, 1 row): a
timer around each part of `QSAAttention._forward`, summed over 2000 builds (an eval every 50).

    python3 benchmarks/results/cpu_2026-12-07b/layer_build_split.py
"""

import sys
import time
from pathlib import Path

import mlx.core as mx


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: host_build
    from host_build import stand_in_cuda_layer

    layer, cache, x = stand_in_cuda_layer(131072, 1)
    import mlx_qsa.layer as layer_mod
    from mlx_qsa.bench import decode_layer_step

    step = decode_layer_step(layer, [x], [cache], 1)
    for _ in range(20):
        mx.eval(step(0))
    acc: dict[str, float] = {}

    def timed(f, label):
        def g(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0
            return r

        return g

    core = layer._core
    for key, fn in list(core._graphs.items()):  # MLX's call of the compiled core itself
        core._graphs[key] = timed(fn, "core_fn")
    cls = layer_mod.QSAAttention
    for obj, name, label in (
        (cls, "_compiled_indexer", "compiled_indexer"),
        (layer_mod, "dispatch", "consumers_dispatch"),
        (layer_mod, "kv_append", "kv_append"),
        (cls, "_project", "project"),
        (cls, "_plan_indexer", "plan_indexer"),
        (layer_mod.plan, "plan_consumers", "plan_consumers"),
    ):
        setattr(obj, name, timed(getattr(obj, name), label))
    n, total = 2000, 0.0
    for i in range(n):
        t0 = time.perf_counter()
        y = step(0)
        total += time.perf_counter() - t0
        if i % 50 == 0:
            mx.eval(y)
    print(f"total {total / n * 1e6:.1f} us/step")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k}: {v / n * 1e6:.1f}")


if __name__ == "__main__":
    main()
