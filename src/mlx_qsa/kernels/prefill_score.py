"""Prefill selection on CUDA (issue 6): the tensor-core score producer `mpp` (prefill_score.cu)
emits the reduced float32 plane `[C, N]` of a chunk of rows, never the per-head planes, and the
decode selector's top-k kernel (selector.cu) selects each row's blocks from it.

Chunks follow RUNTIME.md §6.3 (`plan.selector_chunk_rows` with producer `mpp`): one plane of
`chunk x cap` float32 at a time within the prefill workspace.
"""

from __future__ import annotations

import mlx.core as mx

from . import _launch, device
from .device import DeviceLimits
from .selector import _L, top_k_from_plane

_TR, _TB, _GB = 64, 64, 4  # rows per CTA, blocks per tile, tiles per CTA
# Warps per CTA (prefill_score.cu): 8 run one tile half each, 4 both halves; the same bits.
# H100, benchmarks/select_sweep.py: 2048 rows after 32K 137.7 µs at 8 against 184.4 at 4;
# after 128K (3 x 992 rows) 485.9 against 652.1. GB 2 / 8 / 16 were no faster than 4 (again
# with div_sqrt128: within 5 % of it, 2 % faster at 128K, slower at 32K).
_NW = 8
# The score's division as `__fdiv_rn` itself instead of common.cuh's `div_sqrt128` (the same
# bits): for A/B timing in benchmarks/select_sweep.py only.
_IEEE_DIV = False


SMEM_BYTES = _TR * (4 * 128 + 8) * 2 + 2 * _TB * (128 + 8) * 2  # query rows + two key tiles


def prefill_score_supports(
    index_q: mx.array, pooled: mx.array, limits: DeviceLimits | None = None
) -> bool:
    """The shapes the kernel covers: bf16, 4 index heads of 128 (the `mpp` contract), on a GPU
    (`limits`, by default MLX's; unchecked without one) with room for its shared memory."""
    limits = device.resolve(limits)
    if limits is not None and limits.max_shared_memory < SMEM_BYTES:
        return False
    return (
        index_q.ndim == 4
        and index_q.shape[0] == 1
        and index_q.shape[1] == 4
        and index_q.shape[3] == 128
        and index_q.dtype == mx.bfloat16
        and pooled.dtype == mx.bfloat16
        and pooled.ndim == 3
        and pooled.shape[2] == 128
    )


def prefill_scores_cuda(index_q: mx.array, pooled: mx.array, pos: mx.array, *, ratio: int = 4):
    """(adj [C, npad] float32, summ [C, npad / 32, L] uint32, nbs [C] int32) of one chunk.

    index_q `[1, 4, C, 128]` bf16, pooled `[1, cap, 128]` bf16, pos int32 `[C]`.
    """
    fn = "prefill_scores_cuda"
    _launch.require_cuda(fn)
    if not prefill_score_supports(index_q, pooled):
        raise NotImplementedError(
            f"{fn}: needs bf16 index_q [1, 4, C, 128] and pooled [1, cap, 128], got "
            f"{list(index_q.shape)} {index_q.dtype} and {list(pooled.shape)} {pooled.dtype}"
        )
    C, cap = index_q.shape[2], pooled.shape[1]
    if pos.shape != (C,) or pos.dtype != mx.int32:
        raise ValueError(f"{fn}: pos must be int32 [{C}], got {list(pos.shape)} {pos.dtype}")
    if cap < 1:
        raise ValueError(f"{fn}: pooled must hold at least one block row")
    npad = -(-cap // _TB) * _TB
    n_cta = -(-C // _TR) * -(-(npad // _TB) // _GB)
    smem = SMEM_BYTES
    kernel = _launch.build(
        "prefill_score.cu",
        "score",
        ("index_q", "pooled", "pos"),
        ("adj", "summ", "nbs"),
        (),
        shared_memory=smem,
        ensure_row_contiguous=True,
        prefix="#define QSA_IEEE_DIV\n" if _IEEE_DIV else "",
        template=(("RATIO", ratio), ("L", _L), ("GB", _GB), ("NW", _NW)),
    )
    return tuple(
        kernel(
            inputs=[index_q, pooled, pos],
            grid=(n_cta * 32 * _NW, 1, 1),
            threadgroup=(32 * _NW, 1, 1),
            output_shapes=[(C, npad), (C, npad // 32 * _L), (C,)],
            output_dtypes=[mx.float32, mx.uint32, mx.int32],
        )
    )


def select_prefill_cuda(
    index_q: mx.array,
    pooled: mx.array,
    pos: mx.array,
    *,
    block_topk: int = 512,
    ratio: int = 4,
    chunk: int | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Exact top-`block_topk` blocks per row for many rows: (ids, valid, scores), as
    `indexer.top_blocks` lays them out; `chunk` rows per score plane (default: all)."""
    S = index_q.shape[2]
    chunk = S if chunk is None else chunk
    npad = -(-pooled.shape[1] // _TB) * _TB
    parts = []
    for r0 in range(0, S, chunk):
        r1 = min(S, r0 + chunk)
        p = pos[r0:r1]
        adj, summ, nbs = prefill_scores_cuda(index_q[:, :, r0:r1], pooled, p, ratio=ratio)
        parts.append(
            top_k_from_plane(adj, summ, nbs, p, block_topk=block_topk, ratio=ratio, npad=npad)
        )
    if len(parts) == 1:
        return tuple(parts[0])
    return tuple(mx.concatenate([q[i] for q in parts]) for i in range(3))
