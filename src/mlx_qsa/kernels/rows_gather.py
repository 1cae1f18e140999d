"""Rows-gather attention (RUNTIME.md §8 ``rows_gather``): CUDA launcher and portable twin.

Each of S query rows attends its own valid row-token slots (RUNTIME.md §7 row tokens), reading
K/V in place from the cache backings; invalid slots contribute nothing.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import _launch


def _check(fn: str, q, keys, values, slots, slot_valid):
    n_heads, rows, n_kv, d = _launch.check_attention(fn, q, keys, values)
    _launch.check_row_lists(fn, rows, ("slots", "slot_valid"), slots, slot_valid, "[S, W]")
    return n_heads, rows, n_kv, d


def rows_gather_portable(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    slot_valid: mx.array,
    *,
    scale: float,
) -> mx.array:
    """Portable MLX twin of :func:`rows_gather_cuda` with RUNTIME.md §8's portable numerics.

    Scores = matmul in q's dtype (rounded) -> float32 x scale -> mask -> float32 softmax ->
    q's dtype -> matmul with the gathered V. q [1, H, S, d], slots int32 [S, W],
    slot_valid bool [S, W] -> [1, H, S, d]. A row without valid slots gives 0.
    """
    n_heads, rows, n_kv, d = _check("rows_gather_portable", q, keys, values, slots, slot_valid)
    g = n_heads // n_kv
    width = slots.shape[1]
    tok = mx.where(slot_valid, slots, 0).reshape(-1)
    kk = mx.take(keys, tok, axis=2).reshape(1, n_kv, rows, width, d)
    vv = mx.take(values, tok, axis=2).reshape(1, n_kv, rows, width, d)
    qg = q.reshape(1, n_kv, g, rows, d).transpose(0, 1, 3, 2, 4)  # [1, Hkv, S, G, d]
    s = mx.matmul(qg, kk.swapaxes(-1, -2)).astype(mx.float32) * scale  # [1, Hkv, S, G, W]
    ok = slot_valid[None, None, :, None, :]
    s = mx.where(ok, s, -math.inf)
    m = mx.max(s, axis=-1, keepdims=True)
    m = mx.where(m == -math.inf, 0.0, m)
    e = mx.where(ok, mx.exp(s - m), 0.0)
    denom = mx.sum(e, axis=-1, keepdims=True)
    p = (e / mx.where(denom > 0, denom, 1.0)).astype(q.dtype)
    o = mx.matmul(p, vv)  # [1, Hkv, S, G, d]
    return o.transpose(0, 1, 3, 2, 4).reshape(1, n_heads, rows, d)


def rows_gather_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    slot_valid: mx.array,
    *,
    scale: float,
) -> mx.array:
    """Split-K rows-gather attention on CUDA (two kernels); see :func:`rows_gather_portable`.

    One CTA per (row, KV head, 32 or 64 slots) for all query heads of the KV head, float32
    online softmax, then a fixed-order log-sum-exp merge of the splits.
    """
    fn = "rows_gather_cuda"
    n_heads, rows, n_kv, d = _check(fn, q, keys, values, slots, slot_valid)
    _launch.require_cuda(fn)
    _launch.check_cuda_attention(fn, q, n_heads, n_kv, d, scale)
    g = n_heads // n_kv
    width = slots.shape[1]
    tok = 32 if rows <= 4 else 64
    nsplit = -(-width // tok)
    nt = _launch.ATTN_THREADS
    partial = _launch.build(
        "rows_gather.cu",
        "partial",
        ("q", "keys", "values", "slots", "slot_valid"),
        ("part_o", "part_ml"),
        (),
        shared_memory=_launch.attn_smem_bytes(d, g, tok, nt),
    )
    part_o, part_ml = partial(
        inputs=[q, keys, values, slots, slot_valid],
        template=[
            ("D", d),
            ("G", g),
            ("TOK", tok),
            ("HKV", n_kv),
            ("W", width),
            ("NSPLIT", nsplit),
            ("SCALE_BITS", _launch.float_bits(scale)),
            ("NT", nt),
        ],
        grid=(rows * n_kv * nsplit * nt, 1, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(n_heads * rows, nsplit, d), (n_heads * rows, nsplit, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    merge = _launch.build("rows_gather.cu", "merge", ("part_o", "part_ml"), ("out",), ())
    return merge(
        inputs=[part_o, part_ml],
        template=[("D", d), ("NSPLIT", nsplit)],
        grid=(n_heads * rows * d, 1, 1),
        threadgroup=(64, 1, 1),
        output_shapes=[(1, n_heads, rows, d)],
        output_dtypes=[q.dtype],
    )[0]
