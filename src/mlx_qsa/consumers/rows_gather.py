"""`rows_gather`: per-row attention over each row's own token slots (RUNTIME.md §8).

Portable numerics: bf16 score matmul (rounded to bf16) → float32 × scale → mask → float32
softmax → bf16 → bf16 matmul with the gathered V. Deterministic; the compiled and eager
paths call this same routine with the same slot order, so their outputs agree bit for bit.
"""

from __future__ import annotations

import mlx.core as mx


def rows_gather(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    slot_valid: mx.array,
    scale: float,
) -> mx.array:
    """q `[1, H, S, d]`, backings `[1, H_kv, cap, d]`, slots/valid `[S, W]` → `[1, H, S, d]`."""
    _, H, S, d = q.shape
    h_kv = keys.shape[1]
    G = H // h_kv
    W = slots.shape[1]
    flat = slots.reshape(-1)
    # Gather from the 4-D backing itself: a gather from the view `keys[0]` copies the whole
    # backing first (MLX 0.32), which made every decode step linear in the context.
    k = mx.take(keys, flat, axis=2).reshape(h_kv, S, W, d)
    v = mx.take(values, flat, axis=2).reshape(h_kv, S, W, d)
    qg = q[0].reshape(h_kv, G, S, d).transpose(0, 2, 1, 3)  # [H_kv, S, G, d]
    s = mx.matmul(qg, k.swapaxes(-1, -2)).astype(mx.float32) * scale  # [H_kv, S, G, W]
    s = mx.where(slot_valid[None, :, None, :], s, -mx.inf)
    p = mx.softmax(s, axis=-1).astype(q.dtype)
    o = mx.matmul(p, v)  # [H_kv, S, G, d]
    return o.transpose(0, 2, 1, 3).reshape(1, H, S, d)
