"""`flash`: S = 1 block-sparse decode over the selected blocks plus the tail (RUNTIME.md §8).

The portable implementation gathers the selected rows (row-tokens slots of the single row)
and runs the rows-gather routine; the CUDA kernel reads the backing in place instead.
"""

from __future__ import annotations

import mlx.core as mx

from .rows_gather import rows_gather


def flash(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    slot_valid: mx.array,
    scale: float,
) -> mx.array:
    """q `[1, H, 1, d]`; slots/slot_valid `[1, K·r + r]` of the query's selection."""
    return rows_gather(q, keys, values, slots, slot_valid, scale)
