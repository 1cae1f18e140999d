"""Where the decode selection + attention step (`bench.qsa_step`, issue 5's measured unit) spends
its time: Python graph building against evaluation, queued throughput, the MLX primitives in
the graph, the Python functions of the call (cProfile), and with `--ncu-steps N` the kernels of
N steps under Nsight Compute (the profiler is opened only around them).

    python3 benchmarks/step_profile.py OUT.json [--contexts 131072] [--rows 1] [--impl cuda]
        [--pos-pad]
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/step_profile.py OUT.json --ncu-steps 3 > ncu.csv
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import mlx.core as mx
from layer_profile import _profiler  # this folder (the script's own) is on sys.path

from mlx_qsa.bench import DecodeSet, primitive_counts, qsa_step
from mlx_qsa.config import QSAConfig


def pad_positions(s: DecodeSet) -> None:
    """The set's row positions as a view of a 16-byte array: MLX places arrays of at most 8
    bytes (one or two int32 positions) in a small pool of managed memory (mlx/backend/cuda/
    allocator.cpp, 0.32), which the kernels then read; this tells whether that read costs."""
    n = s.positions.shape[0]
    s.positions = mx.arange(s.T - n, s.T - n + max(n, 4), dtype=mx.int32)[:n]
    mx.eval(s.positions)


def point(
    cfg: QSAConfig, T: int, rows: int, impl: str, n_sets: int, ncu_steps: int, pos_pad: bool
) -> dict:
    sets = [DecodeSet(cfg, T, rows, seed=7 * T + i) for i in range(n_sets)]
    if pos_pad:
        for s in sets:
            pad_positions(s)
    prims = primitive_counts(qsa_step(cfg, sets[0], impl)[0])
    for i in range(3 * n_sets):
        mx.eval(qsa_step(cfg, sets[i % n_sets], impl)[0])
    build, evals, total = [], [], []
    for k in range(8 * n_sets):
        t0 = time.perf_counter()
        o = qsa_step(cfg, sets[k % n_sets], impl)[0]
        t1 = time.perf_counter()
        mx.eval(o)
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e6)
        evals.append((t2 - t1) * 1e6)
        total.append((t2 - t0) * 1e6)
    queued = []
    for _ in range(7):
        mx.synchronize()
        t0 = time.perf_counter()
        for k in range(4 * n_sets):
            mx.async_eval(qsa_step(cfg, sets[k % n_sets], impl)[0])
        mx.synchronize()
        queued.append((time.perf_counter() - t0) / (4 * n_sets) * 1e6)
    prof = cProfile.Profile()
    for k in range(20):
        prof.enable()
        o = qsa_step(cfg, sets[k % n_sets], impl)[0]
        prof.disable()
        mx.eval(o)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    if ncu_steps:
        mx.synchronize()
        _profiler(True)
        for k in range(ncu_steps):
            mx.eval(qsa_step(cfg, sets[k % n_sets], impl)[0])
        mx.synchronize()
        _profiler(False)
    return {
        "context": T,
        "rows": rows,
        "impl": impl,
        "pos_pad": pos_pad,
        "primitives": prims,
        "build_us_median": statistics.median(build),
        "eval_us_median": statistics.median(evals),
        "step_us_median": statistics.median(total),
        "queued_us_median": statistics.median(queued),
        "queued_us_min": min(queued),
        "cprofile_top_tottime_20_calls": text.getvalue(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--impl", default="cuda")
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--ncu-steps", type=int, default=0)
    ap.add_argument("--pos-pad", action="store_true", help="positions in a 16-byte array")
    args = ap.parse_args()
    cfg = QSAConfig()
    recs = []
    for T in [int(c) for c in args.contexts.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            for impl in args.impl.split(","):
                rec = point(cfg, T, rows, impl, args.sets, args.ncu_steps, args.pos_pad)
                recs.append(rec)
                print(
                    f"T={T} rows={rows} {impl}: build {rec['build_us_median']:.1f} us, eval "
                    f"{rec['eval_us_median']:.1f} us, step {rec['step_us_median']:.1f} us, queued "
                    f"{rec['queued_us_median']:.1f} us (min {rec['queued_us_min']:.1f}), "
                    f"{rec['primitives']}",
                    flush=True,
                )
                print(rec["cprofile_top_tottime_20_calls"][:2500], flush=True)
                with open(args.out, "w") as f:
                    json.dump({"mlx": mx.__version__, "points": recs}, f, indent=1)


if __name__ == "__main__":
    main()
