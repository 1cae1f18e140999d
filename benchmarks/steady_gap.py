"""Where a steady GEMM call's time goes beyond its kernel's, on the GPU machine (MLX with CUDA).

The sweep's steady figure evaluates `per_round` calls together and divides the wall time; MLX's
`mx.addmm` and the custom kernel both come out ~45 µs a call above their kernels' time (H100,
2026-12-06d), while torch's event-timed loop matches its kernel. For each configuration and
`per_round`, this prints
- submit: µs per call to build the calls and return from `mx.async_eval` (the host's part);
- wall: µs per call until `mx.synchronize()` returns (what the sweep's steady figure measures).
If submit is close to wall, the loop is bound by the host, not by the GPU. torch's `F.linear`
is timed the same two ways (wall with a synchronize; CUDA events), keeping every output alive
as MLX's list does, and reusing one.

    python3 benchmarks/steady_gap.py addmm tma_st:192x192x64/8/8 [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from gemm_profile import call

from mlx_qsa.sweep import OPERATORS, make_inputs


def mlx_round(fn, per_round: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    outs = [fn() for _ in range(per_round)]
    mx.async_eval(outs)
    t1 = time.perf_counter()
    mx.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / per_round, (t2 - t0) * 1e6 / per_round


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
    args = ap.parse_args()
    per_rounds = [int(v) for v in args.per_round.split(",")]
    n, k = OPERATORS[args.op]
    x, w, b = make_inputs(args.tokens, n, k, seed=0)
    fns = {c: call(c, x, w, b) for c in args.configs}
    for fn in fns.values():
        mlx_round(fn, max(per_rounds))  # compile, plan, fill the buffer cache
    for per_round in per_rounds:
        res: dict[str, list[tuple[float, float]]] = {c: [] for c in fns}
        for _ in range(args.rounds):  # configurations interleaved, round by round
            for c, fn in fns.items():
                res[c].append(mlx_round(fn, per_round))
        for c, r in res.items():
            sub = statistics.median(s for s, _ in r)
            wall = statistics.median(w for _, w in r)
            print(f"{c:28s} per_round {per_round:3d}  submit {sub:7.1f} us  wall {wall:7.1f} us")
    torch_rounds(x, w, b, per_rounds, args.rounds)


if __name__ == "__main__":
    main()
