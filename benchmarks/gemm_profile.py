"""Calls of mx.addmm (cuBLASLt) and custom GEMM configurations at attn.qkv_proj, for Nsight
Compute on the GPU machine. Each configuration runs one warm-up call, then `--calls` calls, each
evaluated on its own; with one kernel per call, `benchmarks/ncu_summary.py CSV PARTS` (PARTS =
the number of configurations) gives each configuration's kernel time.

    ncu --csv --metrics gpu__time_duration.sum -k regex:'gemm|qsa|nvjet' \\
        python3 benchmarks/gemm_profile.py addmm tma:192x192x64/8/16 tma_st:192x192x64/8/16
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from mlx_qsa.kernels.gemm import gemm_bias, gemm_bias_reference
from mlx_qsa.sweep import OPERATORS, make_inputs

DEFAULT = ["addmm", "tma:128x256x64/8/8", "wgmma:128x256x64/8/8"]


def call(config: str, x: mx.array, w: mx.array, b: mx.array):
    """`addmm` or `FAMILY:TMxTNxTK/WARPS/WALK_M`."""
    if config == "addmm":
        return lambda: gemm_bias_reference(x, w, b)
    family, spec = config.split(":")
    tile, warps, walk = spec.split("/")
    tm, tn, tk = (int(v) for v in tile.split("x"))
    return lambda: gemm_bias(
        x, w, b, tile=(tm, tn, tk), warps=int(warps), walk_m=int(walk), family=family
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=DEFAULT)
    ap.add_argument("--op", default="attn.qkv_proj", choices=sorted(OPERATORS))
    ap.add_argument("--tokens", type=int, default=4181)
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_args()
    n, k = OPERATORS[args.op]
    x, w, b = make_inputs(args.tokens, n, k, seed=0)
    for config in args.configs:
        fn = call(config, x, w, b)
        for _ in range(1 + args.calls):
            mx.eval(fn())
        mx.synchronize()
        print("ran", config, flush=True)


if __name__ == "__main__":
    main()
