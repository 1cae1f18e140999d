"""One prefill selection and one `prefill_flash` call at a prefix, for Nsight Compute (issue 6).

ncu --clock-control none -k regex:qsa_ ... python3 benchmarks/ncu_prefill.py 32768
"""

from __future__ import annotations

import sys

import mlx.core as mx

from mlx_qsa import bench, plan
from mlx_qsa.config import QSAConfig
from mlx_qsa.kernels.prefill_flash import prefill_flash_cuda
from mlx_qsa.kernels.prefill_score import select_prefill_cuda

cfg = QSAConfig()
S = 2048
T = int(sys.argv[1]) + S
s = bench.DecodeSet(cfg, T, S, seed=0)
chunk = plan.selector_chunk_rows("prefill_blocks", S, s.pooled.shape[1], producer="mpp")
for _ in range(2):
    ids, valid, _ = select_prefill_cuda(s.index_q, s.pooled, s.positions, chunk=chunk)
    out = prefill_flash_cuda(s.q, s.keys, s.values, ids, valid, s.positions, scale=cfg.scale)
    mx.eval(out)
