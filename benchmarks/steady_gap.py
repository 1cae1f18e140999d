"""Where a steady GEMM call's time goes beyond its kernel's, on the GPU machine (MLX with CUDA).

The sweep's steady figure is wall time over `per_round` calls; torch's is CUDA events around
its calls, which count GPU time only. For each configuration and `per_round`, this prints µs
per call:
- submit: building the calls and returning from `mx.async_eval` (the host's part);
- wall: until `mx.synchronize()` returns (what the sweep's steady figure measures);
- gpu: the GPU's own span of the round, from a one-thread kernel reading the global timer
  before the first call and after the last (`gpu_stamp.cu`), the counterpart of torch's events;
- with `--spans`, a stamp after every call as well: the median and largest call-to-call span.
`--per-call` submits each call with `mx.async_eval` as it is built (the sweep's steady loop);
by default the round's calls are built first and submitted together. torch's `F.linear` is
timed by wall clock and by CUDA events, keeping every output alive as MLX's list does, and
reusing one.

    python3 benchmarks/steady_gap.py addmm tma_st:192x192x64/8/8 [--rounds 5] [--per-call]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from pathlib import Path

import mlx.core as mx
from gemm_profile import call

from mlx_qsa.sweep import OPERATORS, make_inputs


@functools.cache
def _stamp_kernel():
    return mx.fast.cuda_kernel(
        name="qsa_gpu_stamp",
        input_names=["after"],
        output_names=["stamp"],
        source=Path(__file__).with_name("gpu_stamp.cu").read_text().split("\n", 1)[1],
    )


def stamp(after: mx.array) -> mx.array:
    """The GPU's global timer (ns) when the stream reaches this point, after ``after``."""
    return _stamp_kernel()(
        inputs=[after],
        grid=(1, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
    )[0]


def mlx_round(
    fn, first: mx.array, per_round: int, per_call: bool, spans: bool
) -> tuple[float, float, float, list[float]]:
    """One round: (submit, wall, gpu) µs per call and, with ``spans``, each call's GPU span."""
    t0 = time.perf_counter()
    pending = [stamp(first)]  # submitted with the first call: no host gap inside the span
    stamps = list(pending)
    outs = []
    for _ in range(per_round):
        y = fn()
        outs.append(y)
        pending.append(y)
        if spans:
            stamps.append(stamp(y))
            pending.append(stamps[-1])
        if per_call:
            mx.async_eval(pending)
            pending = []
    if not spans:
        stamps.append(stamp(outs[-1]))
        pending.append(stamps[-1])
    mx.async_eval(pending)
    t1 = time.perf_counter()
    mx.synchronize()
    t2 = time.perf_counter()
    ns = [int(v.item()) for v in stamps]
    calls = [(hi - lo) / 1e3 for lo, hi in itertools.pairwise(ns)] if spans else []
    gpu = (ns[-1] - ns[0]) / 1e3 / per_round
    return (t1 - t0) * 1e6 / per_round, (t2 - t0) * 1e6 / per_round, gpu, calls


def torch_rounds(x, w, b, per_rounds: list[int], rounds: int) -> None:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch: not importable")
        return
    import numpy as np

    def to_torch(a):
        return torch.from_numpy(np.array(a.astype(mx.float32))).cuda().to(torch.bfloat16)

    tx, tw, tb = to_torch(x), to_torch(w), to_torch(b)
    for _ in range(5):
        F.linear(tx, tw, tb)
    torch.cuda.synchronize()
    for per_round in per_rounds:
        for keep in (True, False):
            walls, events = [], []
            for _ in range(rounds):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                outs = []
                t0 = time.perf_counter()
                start.record()
                for _ in range(per_round):
                    y = F.linear(tx, tw, tb)
                    if keep:
                        outs.append(y)
                stop.record()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e6 / per_round)
                events.append(start.elapsed_time(stop) * 1e3 / per_round)
                del outs
            wall, event = statistics.median(walls), statistics.median(events)
            print(
                f"torch      per_round {per_round:3d} keep={int(keep)}  "
                f"wall {wall:7.1f} us  events {event:7.1f} us"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--op", default="attn.qkv_proj", choices=sorted(OPERATORS))
    ap.add_argument("--tokens", type=int, default=4181)
    ap.add_argument("--per-round", default="1,5,20,60")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-call", action="store_true", help="mx.async_eval each call as built")
    ap.add_argument("--spans", action="store_true", help="a GPU stamp after every call too")
    args = ap.parse_args()
    per_rounds = [int(v) for v in args.per_round.split(",")]
    n, k = OPERATORS[args.op]
    x, w, b = make_inputs(args.tokens, n, k, seed=0)
    fns = {c: call(c, x, w, b) for c in args.configs}

    def one(fn, per_round):
        return mlx_round(fn, x, per_round, args.per_call, args.spans)

    for fn in fns.values():
        one(fn, max(per_rounds))  # compile, plan, fill the buffer cache
    mode = "per-call async_eval" if args.per_call else "one async_eval per round"
    print(f"MLX: {mode}; µs per call, medians of {args.rounds} rounds")
    for per_round in per_rounds:
        res: dict[str, list[tuple[float, float, float, list[float]]]] = {c: [] for c in fns}
        for _ in range(args.rounds):  # configurations interleaved, round by round
            for c, fn in fns.items():
                res[c].append(one(fn, per_round))
        for c, r in res.items():
            sub, wall, gpu = (statistics.median(v[i] for v in r) for i in range(3))
            line = (
                f"{c:28s} per_round {per_round:3d}  submit {sub:7.1f}  wall {wall:7.1f}"
                f"  gpu {gpu:7.1f}"
            )
            if args.spans:
                calls = [t for v in r for t in v[3]]
                line += f"  call span median {statistics.median(calls):7.1f} max {max(calls):7.1f}"
            print(line)
    torch_rounds(x, w, b, per_rounds, args.rounds)


if __name__ == "__main__":
    main()
