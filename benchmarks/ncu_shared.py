"""One `prefill_flash` call over shared tiles (every tile in the list form, the limit lifted),
the union of each form alone (`tile_union_cuda`: table, then sort), and one call per row, at a
2048-row chunk after a prefix with drifting selections, for Nsight Compute (issue 6).

    ncu -k regex:qsa_ ... python3 benchmarks/ncu_shared.py 32768 0.97
"""

from __future__ import annotations

import sys
from unittest import mock

import mlx.core as mx
import numpy as np
from prefill_shared_ab import SCALE, K, R, S, drifting_selection
from sdpa_ab import random_chunk

from mlx_qsa.kernels import prefill_flash as pf


def main() -> None:
    P, overlap = int(sys.argv[1]), float(sys.argv[2])
    T = P + S
    q, keys, values = random_chunk(mx.random.key(P), S, T)
    ids, valid = (mx.array(a) for a in drifting_selection(np.random.default_rng(P), P, overlap))
    pos = mx.array(np.arange(P, T, dtype=np.int32))
    mx.eval(q, keys, values, ids, valid, pos)
    with mock.patch.object(pf, "tile_limit", lambda k: pf.RT * K + pf.RT):
        mx.eval(pf.prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=SCALE, shared=True))
    for form in ("table", "sort"):
        mx.eval(pf.tile_union_cuda(ids, valid, pos, keys, ratio=R, form=form))
    mx.eval(pf.prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=SCALE, shared=False))


if __name__ == "__main__":
    main()
