"""Side by side on one GPU: split-K attention with the in-launch merge against the separate merge
kernel (same inputs, same bits), interleaved so drift hits both alike.

    python3 benchmarks/split_k_ab.py OUT.json [--contexts 32768,131072] [--iters 200]

Per context: flash decode (1 row) and rows-gather (8 rows) at the real geometry, µs per call with
one `mx.eval` each (host + device) and per call queued (`mx.async_eval`, one sync per 50 calls).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_qsa.kernels.flash_decode import flash_decode_cuda
from mlx_qsa.kernels.rows_gather import rows_gather_cuda


def timed(fn, iters: int, sync_each: bool) -> float:
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = None
        for i in range(iters // 5):
            out = fn(i)
            if sync_each:
                mx.eval(out)
            else:
                mx.async_eval(out)
        mx.eval(out)
        samples.append((time.perf_counter() - t0) / (iters // 5) * 1e6)
    return statistics.median(samples)


def point(T: int, rng, iters: int) -> list[dict]:
    cap = -(-T // 256) * 256
    sets = []
    for _ in range(4):  # rotated caches: 4 x 2 x cap x 256 x 2 bytes x 2
        k = mx.random.normal((1, 2, cap, 256)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, cap, 256)).astype(mx.bfloat16)
        sets.append((k, v))
    ids = mx.array(np.sort(rng.choice(T // 4, 512, replace=False)).astype(np.int32))
    ok = mx.ones((512,), dtype=mx.bool_)
    Tm = mx.array([T], dtype=mx.int32)
    q1 = mx.random.normal((1, 24, 1, 256)).astype(mx.bfloat16)
    q8 = mx.random.normal((1, 24, 8, 256)).astype(mx.bfloat16)
    slots = mx.array(rng.integers(0, T, (8, 2052)).astype(np.int32))
    sv = mx.ones((8, 2052), dtype=mx.bool_)
    mx.eval(sets, ids, q1, q8, slots)

    def flash(one):
        return lambda i: flash_decode_cuda(
            q1, *sets[i % 4], ids, ok, Tm, scale=1 / 16, one_launch=one
        )

    def rows(one):
        return lambda i: rows_gather_cuda(q8, *sets[i % 4], slots, sv, scale=1 / 16, one_launch=one)

    recs = []
    for name, make in (("flash_1row", flash), ("rows_gather_8rows", rows)):
        assert mx.array_equal(make(True)(0), make(False)(0)).item()
        rec = {"context": T, "kernel": name}
        for _ in range(2):  # A B A B
            for one in (True, False):
                for sync in (True, False):
                    key = f"{'one' if one else 'two'}_launch_{'eval' if sync else 'queued'}"
                    rec.setdefault(key, []).append(timed(make(one), iters, sync))
        print(json.dumps(rec))
        recs.append(rec)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    res = {"device": mx.device_info() if hasattr(mx, "device_info") else {}, "points": []}
    res["host"] = platform.node()
    for T in [int(c) for c in args.contexts.split(",")]:
        res["points"] += point(T, rng, args.iters)
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
