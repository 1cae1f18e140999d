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
    one_launch: bool | None = None,
    gate: mx.array | None = None,
    ctr: mx.array | None = None,
) -> mx.array:
    """Split-K rows-gather attention on CUDA; see :func:`rows_gather_portable`.

    One CTA per (row, KV head, 32 or 64 slots) for all query heads of the KV head, float32
    online softmax, then a fixed-order log-sum-exp merge of the splits (in the same launch
    with ``one_launch``, else by a second kernel; the same bits). With ``gate`` (the rows'
    output-gate logits ``[1, S, H, d]``, any strides) the merge applies the output gate
    (QSA.md §9) and returns ``o * sigmoid(gate)`` as ``[1, S, H, d]``, bit for bit MLX's own
    ``sigmoid`` and ``multiply`` of the ungated output. ``ctr``: the one-launch merge's counter
    slot (`_launch.counter_slot`; default a fresh one).
    """
    fn = "rows_gather_cuda"
    arrays = [q, keys, values, slots, slot_valid]
    if gate is not None:
        arrays.append(gate)
    launch = _launch.one_launch_env() if one_launch is None else one_launch
    sig = _launch.signature(tuple(arrays), scale, launch, gate is not None)
    run = _PLANS.get(
        sig, lambda: _plan(fn, q, keys, values, slots, slot_valid, scale, one_launch, gate)
    )
    return run(arrays, ctr)


_PLANS = _launch.Plans()


def _plan(
    fn: str, q, keys, values, slots, slot_valid, scale: float, one_launch: bool | None,
    gate: mx.array | None,
) -> _launch.Run:  # fmt: skip
    """Checks a call's arguments and plans its launch (once per signature)."""
    n_heads, rows, n_kv, d = _check(fn, q, keys, values, slots, slot_valid)
    _launch.check_gate(fn, gate, q)
    _launch.require_cuda(fn)
    _launch.check_cuda_attention(fn, q, n_heads, n_kv, d, scale)
    g = n_heads // n_kv
    width = slots.shape[1]
    tok = 32 if rows <= 4 else 64
    nsplit = -(-width // tok)
    nt = _launch.ATTN_THREADS
    if one_launch is None:
        one_launch = _launch.one_launch_default(n_heads * rows, d)
    template = (
        ("D", d),
        ("G", g),
        ("TOK", tok),
        ("HKV", n_kv),
        ("W", width),
        ("NSPLIT", nsplit),
        ("SCALE_BITS", _launch.float_bits(scale)),
        ("NT", nt),
    )
    return _launch.plan_split_k(
        "rows_gather.cu",
        ("q", "keys", "values", "slots", "slot_valid"),
        template,
        n_cta=rows * n_kv * nsplit,
        rows=n_heads * rows,
        out_shape=(1, rows, n_heads, d) if gate is not None else (1, n_heads, rows, d),
        nsplit=nsplit,
        shared_memory=_launch.attn_smem_bytes(d, g, tok, nt),
        out_dtype=q.dtype,
        one_launch=one_launch,
        gate=gate is not None,
    )
