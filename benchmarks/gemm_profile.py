"""One call each of mx.addmm (cuBLASLt) and two custom GEMM configurations at attn.qkv_proj, for
Nsight Compute on the GPU machine:

    ncu -k regex:'gemm|qsa' -c 3 --section SpeedOfLight ... python3 benchmarks/gemm_profile.py
"""

from __future__ import annotations

import mlx.core as mx

from mlx_qsa.kernels.gemm import gemm_bias, gemm_bias_reference
from mlx_qsa.sweep import OPERATORS, make_inputs

n, k = OPERATORS["attn.qkv_proj"]
x, w, b = make_inputs(4181, n, k, seed=0)
for name, fn in (
    ("addmm", lambda: gemm_bias_reference(x, w, b)),
    ("tma 128x256x64/8/8", lambda: gemm_bias(x, w, b, tile=(128, 256, 64), warps=8, family="tma")),
    ("wgmma 128x256x64/8/8", lambda: gemm_bias(x, w, b, tile=(128, 256, 64), warps=8)),
):
    mx.eval(fn())
    mx.synchronize()
    print("ran", name, flush=True)
