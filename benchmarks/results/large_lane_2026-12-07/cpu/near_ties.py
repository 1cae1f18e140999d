"""Near-ties in test_cuda_layer.py::test_masked_chunks_run_the_sdpa_kernel's schedule, on the CPU
(portable path): per call, the rows whose K-th and (K+1)-th float64 scores (from the layer's own
bf16 index queries and block keys) lie under 2 float32 ulps apart. Run from tests/:

    cd tests && PYTHONPATH=. python3 ../benchmarks/results/large_lane_2026-12-07/cpu/near_ties.py
"""

import numpy as np
from conftest import hidden_rows
from test_cuda_layer import CFG
from test_layer import Run, build

from mlx_qsa import oracle
from mlx_qsa.config import QSAOptions

widths = (40, 33, 20, 5, 1900, 100)
opts = QSAOptions.trace(
    flash_min=1 << 30, prefill_gather=False, kernels="portable", gather_min_context=0
)
layer, _ = build(CFG, options=opts)
run = Run(layer, [])
import mlx_qsa.layer as layer_mod  # noqa: E402

real = layer_mod.dispatch
layer_mod.dispatch = lambda *a, **k: (run.spy.append(None), real(*a, **k))[1]
run.feed_widths(hidden_rows(sum(widths), CFG.hidden_size), widths)
K = CFG.block_topk
for c in run.calls:
    if c.index_q is None or c.mode in (None, "update_only"):
        print(f"S{c.S}@{c.P} {c.mode}: no selection")
        continue
    adj = oracle.adjusted(oracle.block_scores(c.index_q, c.pooled, CFG))
    near = []
    for i in range(c.S):
        nb = (c.P + i + 1) // 4
        if nb <= K:
            continue
        a = np.sort(adj[i, :nb])[::-1]
        ulps = (a[K - 1] - a[K]) / float(np.spacing(np.float32(abs(a[K - 1]))))
        if ulps < 2:
            near.append((i, round(float(ulps), 3)))
    print(f"S{c.S}@{c.P} {c.mode}: rows under 2 ulps {near}")
