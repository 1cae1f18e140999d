"""The `sdpa` kernel's calls at a 2048-row chunk after a prefix, for Nsight Compute (issue 6):
with the indexer's keep-mask (bounded by the causal limit, as the layer calls it) and causal,
in the default tiling and in `--tiling STEPxNSTAGE[_kv]` forms.

    ncu -k regex:qsa_attend ... python3 benchmarks/ncu_sdpa.py 8192 [64x2 32x3 ...]
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from sdpa_ab import SCALE, keep_mask, random_chunk

from mlx_qsa.kernels.sdpa import TILING, Tiling, sdpa_cuda


def main() -> None:
    P, S = int(sys.argv[1]), 2048
    forms = [Tiling.from_label(n) for n in sys.argv[2:]] or [TILING]
    T = P + S
    q, keys, values = random_chunk(mx.random.key(P), S, T)
    mask = keep_mask(np.random.default_rng(P), S, P)
    pos = mx.array(np.arange(P, T, dtype=np.int32))
    mx.eval(q, keys, values, mask, pos)
    for t in forms:
        for m in (mask, None):
            out = sdpa_cuda(
                q, keys, values, pos, scale=SCALE, mask=m, context=T, within_causal=True, tiling=t
            )
            mx.eval(out)
            print(t, "mask" if m is not None else "causal", flush=True)


if __name__ == "__main__":
    main()
