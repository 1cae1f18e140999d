"""`sdpa`: dense attention over K/V rows [0, T) (RUNTIME.md §8)."""

from __future__ import annotations

import mlx.core as mx


def sdpa(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    T: int,
    scale: float,
    mask: str | mx.array | None = None,
    tokens: mx.array | None = None,
) -> mx.array:
    """q `[1, H, S, d]`; keys/values: cache backings `[1, H_kv, cap, d]`.

    mask: None (no mask, S == 1), "causal" (row i sees tokens <= T - S + i) or a bool
    keep-mask `[1, 1, S, T]`. tokens: a 1-D token list; attention over the gathered rows.
    """
    if tokens is not None:
        k = mx.take(keys, tokens, axis=2)
        v = mx.take(values, tokens, axis=2)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    k, v = keys[:, :, :T, :], values[:, :, :T, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
