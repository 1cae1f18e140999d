"""How far apart a row's 512th and 513th float64 scores lie, in float32 ulps, at the real
geometry after a 16K prefix (the bench's set 0; every 16th row of the 2048-row chunk; CPU):

    python3 benchmarks/results/large_lane_2026-12-07/cpu/gaps.py   (from the repository root)
"""

import sys

import numpy as np

sys.path.insert(0, "benchmarks")
from selection_diff import float64_scores  # noqa: E402

from mlx_qsa.bench import DecodeSet  # noqa: E402
from mlx_qsa.config import QSAConfig  # noqa: E402

cfg = QSAConfig()
S = 2048
T = 16384 + S
s = DecodeSet(cfg, T, S, seed=7 * T)
gaps = []
for row in range(0, S, 16):
    nb = (T - S + row + 1) // 4
    a = np.sort(float64_scores(s, row, nb))[::-1]
    gaps.append((a[511] - a[512]) / float(np.spacing(np.float32(a[511]))))
g = np.array(gaps)
print(
    f"rows {len(g)}: median {np.median(g):.0f} ulps; percentiles 1/5/25: "
    f"{np.percentile(g, [1, 5, 25]).round(1).tolist()}; under 2 ulps: {(g < 2).sum()}"
)
