"""Where a steady GEMM call's time goes beyond its kernel's, on the GPU machine (MLX with CUDA).

The sweep's steady figure for MLX is wall time over `per_round` calls; torch's is CUDA events
around its calls, which count GPU time only. Every configuration and torch's `F.linear` take
turns round by round, after `--settle` seconds of untimed rounds (under this load the GPU sits
at its power cap, and a short burst after lighter load runs at higher clocks). For each
`per_round`, µs per call, medians:
- submit: building the calls and returning from the last `mx.async_eval` (the host's part);
- wall: until `mx.synchronize()` returns (what the sweep's steady figure measures);
- gpu: the GPU's own time per call, from a one-thread kernel reading the global timer after
  every call (`mlx_qsa.kernels.stamp`): (last stamp − first stamp) / (calls − 1), the counterpart of
  torch's events; and the median and largest call-to-call span.
Each call is submitted with `mx.async_eval` as it is built (the sweep's steady loop);
`--together` builds a round's calls first and submits them at once. torch is timed by wall
clock and by CUDA events, keeping every output alive as MLX's list does.

    python3 benchmarks/steady_gap.py addmm tma_st:192x192x64/8/8 [--rounds 7] [--settle 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import mlx.core as mx
from gemm_profile import call

from mlx_qsa.kernels.stamp import gpu_stamp as stamp
from mlx_qsa.sweep import OPERATORS, make_inputs, time_steady


def mlx_round(fn, per_round: int, together: bool) -> dict[str, float]:
    """One round of ``per_round`` calls, each followed by a stamp that depends on its output."""
    t0 = time.perf_counter()
    outs, stamps = [], []
    for _ in range(per_round):
        y = fn()
        outs.append(y)
        stamps.append(stamp(y))
        if not together:
            mx.async_eval(y, stamps[-1])
    if together:
        mx.async_eval(outs, stamps)
    t1 = time.perf_counter()
    mx.synchronize()
    t2 = time.perf_counter()
    ns = [int(v.item()) for v in stamps]
    spans = [(hi - lo) / 1e3 for lo, hi in zip(ns, ns[1:], strict=False)]
    res = {"submit": (t1 - t0) * 1e6 / per_round, "wall": (t2 - t0) * 1e6 / per_round}
    if spans:
        res |= {"gpu": sum(spans) / len(spans), "span_max": max(spans)}
    return res


def torch_round_fn(x, w, b):
    """One round of torch ``F.linear`` calls: wall and CUDA-event µs per call; None without
    torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    import numpy as np

    def to_torch(a):
        return torch.from_numpy(np.array(a.astype(mx.float32))).cuda().to(torch.bfloat16)

    tx, tw, tb = to_torch(x), to_torch(w), to_torch(b)

    def one(per_round: int) -> dict[str, float]:
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        outs = []
        t0 = time.perf_counter()
        start.record()
        for _ in range(per_round):
            outs.append(F.linear(tx, tw, tb))
        stop.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6 / per_round
        return {"wall": wall, "gpu": start.elapsed_time(stop) * 1e3 / per_round}

    return one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--op", default="attn.qkv_proj", choices=sorted(OPERATORS))
    ap.add_argument("--tokens", type=int, default=4181)
    ap.add_argument("--per-round", default="1,20,60")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of untimed rounds")
    ap.add_argument("--together", action="store_true", help="one mx.async_eval per round")
    args = ap.parse_args()
    n, k = OPERATORS[args.op]
    x, w, b = make_inputs(args.tokens, n, k, seed=0)
    entries = {
        c: functools.partial(mlx_round, call(c, x, w, b), together=args.together)
        for c in args.configs
    }
    peer = torch_round_fn(x, w, b)
    if peer is not None:
        entries["torch F.linear"] = peer
    mode = "one async_eval per round" if args.together else "each call async_eval'd"
    print(f"MLX: {mode}; µs per call, medians of {args.rounds} rounds; gpu = stamps / events")
    for per_round in (int(v) for v in args.per_round.split(",")):
        # the sweep's rotation: untimed rounds for --settle seconds, then entries take turns;
        # every entry times itself (stamps, events), so all go in as time_steady's peers
        res = time_steady({}, per_round, args.rounds, entries, args.settle)
        for c, r in res.items():
            line = f"{c:28s} per_round {per_round:3d}"
            for field in ("submit", "wall", "gpu", "span_max"):
                if field in r[0]:
                    line += f"  {field} {statistics.median(v[field] for v in r):7.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
