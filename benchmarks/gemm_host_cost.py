"""Host cost of one GEMM call against `mx.addmm`, on the GPU machine (MLX with CUDA).

For each configuration (`addmm` or `FAMILY:TMxTNxTK/WARPS/WALK_M`, as benchmarks/gemm_profile.py):
- build: µs to make the call's lazy output (Python + MLX's primitive, nothing evaluated);
- submit: µs from the call to `mx.async_eval` returning (build + MLX encoding and launch);
- one call: median ms of call + eval + synchronize (the sweep schema's sample), at `--tokens`
  and at 16 tokens, where the kernel is short and the host's part shows;
- with `--one-calls N`: N one-call samples of each configuration, interleaved, and each
  median's ratio to the first configuration's.

    python3 benchmarks/gemm_host_cost.py addmm tma_st:192x192x64/8/8
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from gemm_profile import call

from mlx_qsa.sweep import OPERATORS, make_inputs, time_steady


def median_us(fn, n: int) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--op", default="attn.qkv_proj", choices=sorted(OPERATORS))
    ap.add_argument("--tokens", type=int, default=4181)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--one-calls",
        type=int,
        default=0,
        help="one-call samples per configuration, interleaved (configuration by configuration, "
        "round by round) instead of --repeats in a row; ratios to the first configuration",
    )
    args = ap.parse_args()
    for tokens in (args.tokens, 16):
        n, k = OPERATORS[args.op]
        x, w, b = make_inputs(tokens, n, k, seed=0)
        mx.eval(x, w, b)
        fns = {config: call(config, x, w, b) for config in args.configs}
        for config, fn in fns.items():
            for _ in range(3):
                mx.eval(fn())
            mx.synchronize()

            def build(fn=fn) -> None:
                fn()

            def submit(fn=fn) -> None:
                mx.async_eval(fn())

            def one(fn=fn) -> None:
                mx.eval(fn())
                mx.synchronize()

            b_us = median_us(build, 200)
            s_us = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                submit()
                s_us.append((time.perf_counter() - t0) * 1e6)
                mx.synchronize()
            one_ms = median_us(one, args.repeats) / 1e3
            print(
                f"{tokens:5d} tokens  {config:28s} build {b_us:6.1f} us  "
                f"submit {statistics.median(s_us):6.1f} us  one call {one_ms:.4f} ms"
            )
        if args.one_calls:
            samples = time_steady(fns, 1, args.one_calls)  # one call a round: sweep --paired
            first = statistics.median(samples[args.configs[0]])
            for config, s in samples.items():
                med = statistics.median(s)
                q1, _, q3 = statistics.quantiles(s, n=4)
                print(
                    f"{tokens:5d} tokens  {config:28s} interleaved one call: median {med:.4f} ms "
                    f"(quartiles {q1:.4f}-{q3:.4f}, {len(s)} samples), {med / first:.4f}x "
                    f"{args.configs[0]}"
                )


if __name__ == "__main__":
    main()
