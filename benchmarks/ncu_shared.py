"""One `prefill_flash` call over shared tiles (every tile in the list form, the limit lifted)
and one per row, at a 2048-row chunk after a prefix with drifting selections, for Nsight
Compute (issue 6).

    ncu -k regex:qsa_ ... python3 benchmarks/ncu_shared.py 32768 0.97
"""

from __future__ import annotations

import sys
from unittest import mock

import mlx.core as mx
import numpy as np
from prefill_shared_ab import HKV, SCALE, D, H, K, S, drifting_selection

from mlx_qsa.kernels import prefill_flash as pf


def main() -> None:
    P, overlap = int(sys.argv[1]), float(sys.argv[2])
    T = P + S
    cap = -(-T // 256) * 256
    k1, k2, k3 = mx.random.split(mx.random.key(P), 3)
    q = mx.random.normal((1, H, S, D), key=k1).astype(mx.bfloat16)
    keys = mx.random.normal((1, HKV, cap, D), key=k2).astype(mx.bfloat16)
    values = mx.random.normal((1, HKV, cap, D), key=k3).astype(mx.bfloat16)
    ids, valid = (mx.array(a) for a in drifting_selection(np.random.default_rng(P), P, overlap))
    pos = mx.array(np.arange(P, T, dtype=np.int32))
    mx.eval(q, keys, values, ids, valid, pos)
    with mock.patch.object(pf, "tile_limit", lambda k: pf.RT * K + pf.RT):
        mx.eval(pf.prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=SCALE, shared=True))
    mx.eval(pf.prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=SCALE, shared=False))


if __name__ == "__main__":
    main()
