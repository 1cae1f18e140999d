"""Order dependence found 2026-12-06 (H100): after one call of a cluster GEMM (tma_mc,
tma_mc_st), every later one-block tma_st call left y unwritten. Runs pairs (first, then tma_st)
on fresh inputs and says whether y was written and equals mx.addmm.

gemm_bias now refuses the cluster families while MLX's CUDA graphs are on
(`cluster_launch_unsupported`: MLX updates graph nodes in place without seeing compile-time
cluster dimensions). `--unguarded` lifts that refusal, to test the explanation:

    python3 benchmarks/gemm_st_order.py --unguarded                          # expect DIFFERS
    MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/gemm_st_order.py --unguarded    # expect all equal
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx

from mlx_qsa.kernels import gemm
from mlx_qsa.kernels.gemm import gemm_bias, gemm_bias_reference

if "--unguarded" in sys.argv:
    gemm.cluster_launch_unsupported = lambda _value: None


def run(family: str, shape, tile=(128, 256, 64), warps=8, seed=0) -> str:
    m, n, k = shape
    kx, kw, kb = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((m, k), key=kx).astype(mx.bfloat16)
    w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(mx.bfloat16)
    b = (mx.random.normal((n,), key=kb) * 0.1).astype(mx.bfloat16)
    y = gemm_bias(x, w, b, tile=tile, warps=warps, walk_m=8, family=family, init_value=math.nan)
    ok = mx.array_equal(y, gemm_bias_reference(x, w, b)).item()
    nan = mx.isnan(y.astype(mx.float32)).sum().item()
    return f"{family}{list(shape)}: {'equal' if ok else 'DIFFERS'} ({nan} NaN)"


for first in ("tma_st", "tma", "tma_mc", "tma_mc_st", "wgmma"):
    for shape in ((1, 64, 64), (37, 136, 200)):
        print(f"{run(first, shape, seed=1)}  then  {run('tma_st', shape, seed=2)}", flush=True)
    mx.synchronize()
