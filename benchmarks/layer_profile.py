"""Where a QSA layer decode step spends its time, per context: host graph building (the
Python call, no evaluation) against evaluation, the Python functions of the call (cProfile),
and, under Nsight Compute, each kernel of a few steps.

    python3 benchmarks/layer_profile.py OUT.json [--contexts 8192,131072] [--rows 1]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        python3 benchmarks/layer_profile.py OUT.json --ncu-steps 2

With `--ncu-steps N` the script opens the profiler (cuProfilerStart) around N steps of each
context, after the warm-up, so the report holds only those kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import pstats
import statistics
import time

import mlx.core as mx

from mlx_qsa.bench import layer_rows, random_cache
from mlx_qsa.config import QSAConfig
from mlx_qsa.layer import QSAAttention
from mlx_qsa.rope import text_rope


def fresh_step(layer: QSAAttention, x: mx.array, cache) -> mx.array:
    """One layer call that makes its own RoPE tables (a model's first QSA layer at a new
    position; steps here repeat one position, which the shared tables would otherwise hit)."""
    text_rope.cache_clear()
    return layer(x, cache=cache)


def _profiler(on: bool) -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    (lib.cuProfilerStart if on else lib.cuProfilerStop)()


def point(layer: QSAAttention, T: int, rows: int, ncu_steps: int) -> dict:
    cache = random_cache(layer, T, rows, seed=1)
    x = layer_rows(layer.config, rows, seed=2)
    for _ in range(5):
        mx.eval(fresh_step(layer, x, cache))
        cache.trim(rows)
    build, evals, total = [], [], []
    for _ in range(21):
        t0 = time.perf_counter()
        y = fresh_step(layer, x, cache)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        cache.trim(rows)
        build.append((t1 - t0) * 1e6)
        evals.append((t2 - t1) * 1e6)
        total.append((t2 - t0) * 1e6)
    prof = cProfile.Profile()
    for _ in range(10):
        prof.enable()
        y = fresh_step(layer, x, cache)
        prof.disable()
        mx.eval(y)
        cache.trim(rows)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    if ncu_steps:
        mx.synchronize()
        _profiler(True)
        for _ in range(ncu_steps):
            mx.eval(fresh_step(layer, x, cache))
            cache.trim(rows)
        mx.synchronize()
        _profiler(False)
    return {
        "context": T,
        "rows": rows,
        "impl": layer.impl,
        "consumers": list(layer.last_call.consumers),
        "caps": repr(cache),
        "build_us_median": statistics.median(build),
        "eval_us_median": statistics.median(evals),
        "step_us_median": statistics.median(total),
        "cprofile_top_tottime_10_calls": text.getvalue(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", default="8192,131072")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--ncu-steps", type=int, default=0)
    args = ap.parse_args()
    mx.random.seed(0)
    layer = QSAAttention(QSAConfig(), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    recs = []
    for T in [int(c) for c in args.contexts.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            rec = point(layer, T, rows, args.ncu_steps)
            recs.append(rec)
            print(
                f"T={T} rows={rows} {rec['impl']} build {rec['build_us_median']:.0f} us, "
                f"eval {rec['eval_us_median']:.0f} us, step {rec['step_us_median']:.0f} us, "
                f"{rec['caps']}",
                flush=True,
            )
            print(rec["cprofile_top_tottime_10_calls"][:3000], flush=True)
            with open(args.out, "w") as f:
                json.dump({"mlx": mx.__version__, "points": recs}, f, indent=1)


if __name__ == "__main__":
    main()
