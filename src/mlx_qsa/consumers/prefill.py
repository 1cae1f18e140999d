"""Large-prefill consumers over prefill blocks `[S, K]` (RUNTIME.md §8).

- `prefill_gather`: for each 64-row tile build the row-token slots and run `rows_gather`.
- `prefill_flash`: block-sparse attention over each row's blocks plus its 0–3-token tail.
  Portably it is the same tiled gather (bounded memory: one tile of gathered K/V at a time);
  on CUDA it is one tensor-core kernel (kernels/prefill_flash.cu) and `prefill_gather` runs the
  rows-gather kernel per tile.
- `dense_mask`: rebuild the exact dense mask from the blocks, then `sdpa` with it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..indexer import dense_keep_mask, row_token_slots
from .rows_gather import rows_gather
from .sdpa import sdpa

GATHER_TILE_ROWS = 64


def prefill_gather(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    ids: mx.array,
    valid: mx.array,
    positions: mx.array,
    ratio: int,
    scale: float,
    tile_rows: int = GATHER_TILE_ROWS,
    gather: Callable[..., mx.array] = rows_gather,
) -> mx.array:
    """q `[1, H, S, d]`, ids/valid `[S, K]`, positions int32 `[S]` → `[1, H, S, d]`.

    `gather(q_tile, keys, values, slots, slot_valid, scale)` attends one tile of rows: the
    portable `rows_gather`, or on CUDA the rows-gather kernel."""
    S = q.shape[2]
    outs = []
    for r0 in range(0, S, tile_rows):
        r1 = min(S, r0 + tile_rows)
        slots, slot_valid = row_token_slots(ids[r0:r1], valid[r0:r1], positions[r0:r1], ratio)
        outs.append(gather(q[:, :, r0:r1, :], keys, values, slots, slot_valid, scale))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def prefill_flash(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    ids: mx.array,
    valid: mx.array,
    positions: mx.array,
    ratio: int,
    scale: float,
    gather: Callable[..., mx.array] = rows_gather,
) -> mx.array:
    return prefill_gather(
        q, keys, values, ids, valid, positions, ratio, scale, tile_rows=128, gather=gather
    )


def dense_mask_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    ids: mx.array,
    valid: mx.array,
    positions: mx.array,
    T: int,
    ratio: int,
    scale: float,
) -> mx.array:
    mask = dense_keep_mask(ids, valid, positions, T, ratio)
    return sdpa(q, keys, values, T, scale, mask=mask[None, None])
