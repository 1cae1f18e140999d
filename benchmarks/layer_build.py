"""Host time of building one QSA layer decode step's graph (no evaluation), on any machine:
the same step re-built N times (RoPE tables shared, as for a model's later layers), then the
Python functions of the call by self time (cProfile).

    python3 benchmarks/layer_build.py [--context 8192] [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import mlx.core as mx

from mlx_qsa.bench import layer_rows, random_cache
from mlx_qsa.config import QSAConfig
from mlx_qsa.layer import QSAAttention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    mx.random.seed(0)
    layer = QSAAttention(QSAConfig(), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    cache = random_cache(layer, args.context, 1, seed=1)
    x = layer_rows(layer.config, 1, seed=2)
    for _ in range(3):
        mx.eval(layer(x, cache=cache))
        cache.trim(1)
    n, ys = args.calls, []
    t0 = time.perf_counter()
    for _ in range(n):
        ys.append(layer(x, cache=cache))
        cache.trim(1)  # the same step again: its graph is built anew, its tables shared
    per_call = (time.perf_counter() - t0) / n * 1e6
    print(f"build per call (shared tables): {per_call:.1f} us ({layer.impl})")
    mx.eval(ys)
    ys = []
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        ys.append(layer(x, cache=cache))
        cache.trim(1)
    prof.disable()
    mx.eval(ys)
    rows = [
        (tt / n * 1e6, ct / n * 1e6, nc / n, f"{f.split('/')[-1]}:{line}({name})")
        for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()
    ]
    for self_us, cum_us, calls, where in sorted(rows, reverse=True)[:30]:
        print(f"{self_us:8.1f} us self {cum_us:8.1f} us cum {calls:5.1f} calls  {where}")


if __name__ == "__main__":
    main()
