"""Flash sparse decode attention (RUNTIME.md §8 ``flash``): CUDA launcher and portable twin.

One query row (S = 1) attends the tokens of its valid selected blocks (``ratio * b ..
ratio * b + ratio - 1``) plus the tail ``[ratio * (T // ratio), T)``, reading K/V in place from
the cache backings; query head h reads KV head ``h // (H / Hkv)``.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import _launch

_TOK = 32  # tokens per split-K CTA


def ratio_supported(ratio: int) -> bool:
    """A CTA's token tile holds whole blocks: the ratio must divide it."""
    return ratio >= 1 and _TOK % ratio == 0


def _check(fn: str, q, keys, values, block_ids, block_valid, T, ratio: int):
    n_heads, rows, n_kv, d = _launch.check_attention(fn, q, keys, values)
    if rows != 1:
        raise ValueError(f"{fn}: q must be [1, H, 1, d] (one decode row), got {list(q.shape)}")
    _launch.check_ndim(fn, "block_ids", block_ids, 1, "[K]")
    _launch.check_dtype(fn, "block_ids", block_ids, (mx.int32,))
    if block_valid.shape != block_ids.shape:
        raise ValueError(
            f"{fn}: block_valid must have shape {list(block_ids.shape)}, "
            f"got {list(block_valid.shape)}"
        )
    _launch.check_dtype(fn, "block_valid", block_valid, (mx.bool_,))
    if T.shape != (1,):
        raise ValueError(f"{fn}: T must be an int32 array of shape [1], got {list(T.shape)}")
    _launch.check_dtype(fn, "T", T, (mx.int32,))
    if ratio < 1:
        raise ValueError(f"{fn}: ratio must be >= 1, got {ratio}")
    return n_heads, n_kv, d


def flash_decode_portable(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    block_ids: mx.array,
    block_valid: mx.array,
    T: mx.array,
    *,
    scale: float,
    ratio: int = 4,
) -> mx.array:
    """Portable MLX twin of :func:`flash_decode_cuda`: gathered K/V, float32 softmax.

    q [1, H, 1, d], keys/values [1, Hkv, cap, d], block_ids int32 [K], block_valid bool [K],
    T int32 [1] -> [1, H, 1, d] in q's dtype. No valid token -> 0.
    """
    n_heads, n_kv, d = _check(
        "flash_decode_portable", q, keys, values, block_ids, block_valid, T, ratio
    )
    K = block_ids.shape[-1]
    r = mx.arange(ratio, dtype=mx.int32)
    tok_blk = (block_ids[:, None] * ratio + r).reshape(-1)
    ok_blk = mx.broadcast_to(block_valid[:, None], (K, ratio)).reshape(-1)
    tail = (T // ratio) * ratio + r
    tok = mx.concatenate([tok_blk, tail])
    ok = mx.concatenate([ok_blk, tail < T])
    tok = mx.where(ok, tok, 0)
    kk = mx.take(keys, tok, axis=2).astype(mx.float32)  # [1, Hkv, N, d]
    vv = mx.take(values, tok, axis=2).astype(mx.float32)
    qg = q.reshape(1, n_kv, n_heads // n_kv, d).astype(mx.float32)
    s = mx.matmul(qg, kk.transpose(0, 1, 3, 2)) * scale  # [1, Hkv, G, N]
    s = mx.where(ok, s, -math.inf)
    m = mx.max(s, axis=-1, keepdims=True)
    m = mx.where(m == -math.inf, 0.0, m)
    e = mx.where(ok, mx.exp(s - m), 0.0)
    denom = mx.sum(e, axis=-1, keepdims=True)
    o = mx.matmul(e, vv) / mx.where(denom > 0, denom, 1.0)
    return o.reshape(1, n_heads, 1, d).astype(q.dtype)


def flash_decode_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    block_ids: mx.array,
    block_valid: mx.array,
    T: mx.array | None = None,
    *,
    scale: float,
    ratio: int = 4,
    pos: mx.array | None = None,
    one_launch: bool | None = None,
    gate: mx.array | None = None,
    ctr: mx.array | None = None,
) -> mx.array:
    """Split-K flash decode on CUDA; see :func:`flash_decode_portable`.

    With ``gate`` (the row's output-gate logits ``[1, 1, H, d]``, any strides) the merge also
    applies the output gate (QSA.md §9) and returns ``o * sigmoid(gate)`` as ``[1, 1, H, d]``,
    bit for bit MLX's own ``sigmoid`` and ``multiply`` of the ungated output.

    The list [selected blocks..., tail] is cut into ``32 / ratio`` entries per CTA, one CTA per
    (KV head, split) for all its query heads, float32 online softmax; the splits are merged by
    log-sum-exp in a fixed order (deterministic): by the last CTAs of the same launch
    (``one_launch``, one MLX primitive fewer) or by a second kernel, with the same bits. The
    context is ``T`` (int32 [1]) or, with no array made for it, ``pos`` (int32 [1], the row's
    position, T - 1).
    ``block_ids`` / ``block_valid`` may be ``[K]`` or a selection's ``[1, K]`` (read in place).
    ``ctr``: the one-launch merge's counter slot (`_launch.counter_slot`; default a fresh one).
    """
    fn = "flash_decode_cuda"
    if (T is None) == (pos is None):
        raise ValueError(f"{fn}: pass exactly one of T and pos")
    tlen = T if T is not None else pos
    arrays = [q, keys, values, block_ids, block_valid, tlen]
    if gate is not None:
        arrays.append(gate)
    launch = _launch.one_launch_env() if one_launch is None else one_launch
    sig = _launch.signature(tuple(arrays), scale, ratio, T is None, launch, gate is not None)
    run = _PLANS.get(
        sig, lambda: _plan(fn, q, keys, values, block_ids, block_valid, tlen, T is None, scale,
                           ratio, one_launch, gate)
    )  # fmt: skip
    return run(arrays, ctr)


_PLANS = _launch.Plans()


def _plan(
    fn: str, q, keys, values, block_ids, block_valid, tlen, toff: bool, scale: float, ratio: int,
    one_launch: bool | None, gate: mx.array | None,
) -> _launch.Run:  # fmt: skip
    """Checks a call's arguments and plans its launch (once per signature)."""
    if block_ids.ndim == 2 and block_ids.shape[0] == 1 and block_valid.shape == block_ids.shape:
        ids1, ok1 = block_ids[0], block_valid[0]  # views, for the checks only
    else:
        ids1, ok1 = block_ids, block_valid
    n_heads, n_kv, d = _check(fn, q, keys, values, ids1, ok1, tlen, ratio)
    _launch.check_gate(fn, gate, q)
    _launch.require_cuda(fn)
    _launch.check_cuda_attention(fn, q, n_heads, n_kv, d, scale)
    if not ratio_supported(ratio):
        raise NotImplementedError(f"{fn}: ratio must divide {_TOK}, got {ratio}")
    K = block_ids.shape[-1]
    g = n_heads // n_kv
    nsplit = -(-(K + 1) // (_TOK // ratio))
    nt = _launch.ATTN_THREADS
    template = (
        ("D", d),
        ("G", g),
        ("TOK", _TOK),
        ("RATIO", ratio),
        ("K", K),
        ("NSPLIT", nsplit),
        ("SCALE_BITS", _launch.float_bits(scale)),
        ("NT", nt),
        ("TOFF", 1 if toff else 0),
    )
    return _launch.plan_split_k(
        "flash_decode.cu",
        ("q", "keys", "values", "block_ids", "block_valid", "tlen"),
        template,
        n_cta=n_kv * nsplit,
        rows=n_heads,
        out_shape=(1, 1, n_heads, d) if gate is not None else (1, n_heads, 1, d),
        nsplit=nsplit,
        shared_memory=_launch.attn_smem_bytes(d, g, _TOK, nt),
        out_dtype=q.dtype,
        one_launch=_launch.one_launch_default(n_heads, d) if one_launch is None else one_launch,
        gate=gate is not None,
    )
