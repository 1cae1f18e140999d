"""The QSA indexer in portable MLX: query prep, block pooling, scoring, exact top-k, formats.

Every routine here is shared by the eager path, the legacy selector, the oracle scorer and
the compiled core (RUNTIME.md §10.5: one score routine, one accumulation order), so their
selections and states agree bit for bit. None of them reads a value back to the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .config import QSAConfig
from .device_arrays import int_arange
from .rope import norm, norm_rope, rope

SQRT_128_F32 = 11.313708305358887  # float32(sqrt(128)), bits 0x413504f3


class QSAIndexer(nn.Module):
    """Indexer parameters (HF names): `index_qk_proj`, `q_layernorm`, `k_layernorm`.

    At fusion level 4 the projection lives in the layer's fused matrix and `index_qk_proj`
    is absent; the layer passes the 640 fused columns (`qk_rows`) instead.
    """

    def __init__(self, cfg: QSAConfig, with_projection: bool = True) -> None:
        super().__init__()
        if with_projection:
            self.index_qk_proj = nn.Linear(cfg.hidden_size, cfg.index_proj_width, bias=False)
        self.q_layernorm = nn.RMSNorm(cfg.indexer_head_dim, eps=cfg.rms_norm_eps)
        self.k_layernorm = nn.RMSNorm(cfg.indexer_head_dim, eps=cfg.rms_norm_eps)


@dataclass(frozen=True)
class IndexerGeometry:
    n_heads: int
    head_dim: int
    ratio: int
    block_topk: int
    rotary_dim: int
    eps: float

    @classmethod
    def of(cls, cfg: QSAConfig) -> IndexerGeometry:
        return cls(
            cfg.indexer_n_heads,
            cfg.indexer_head_dim,
            cfg.indexer_compress_ratio,
            cfg.block_topk,
            cfg.rotary_dim,
            cfg.rms_norm_eps,
        )


def split_qk_rows(z: mx.array, g: IndexerGeometry) -> tuple[mx.array, mx.array]:
    """`z [1, S, (H_I+1)·d_I]` → raw index queries `[1, H_I, S, d_I]`, raw keys `[1, S, d_I]`."""
    S = z.shape[1]
    w = g.n_heads * g.head_dim
    q = z[..., :w].reshape(1, S, g.n_heads, g.head_dim).transpose(0, 2, 1, 3)
    return q, z[..., w : w + g.head_dim]


def prepare_queries(
    q_raw: mx.array,
    norm_w: mx.array,
    cos: mx.array,
    sin: mx.array,
    g: IndexerGeometry,
    impl: str = "portable",
) -> mx.array:
    """Index queries: RMSNorm (q_layernorm) then RoPE at the rows' positions (`impl`: the
    implementation of both, `rope.norm` and `rope.rope`)."""
    return norm_rope(q_raw, norm_w, g.eps, cos, sin, g.rotary_dim, impl)


def pool_blocks(
    raw: mx.array,
    first_block: int | mx.array,
    n_blocks: int,
    norm_w: mx.array,
    cos: mx.array,
    sin: mx.array,
    g: IndexerGeometry,
    impl: str = "portable",
) -> mx.array:
    """Block keys `[1, n_blocks, d_I]` for blocks first_block .. first_block+n_blocks-1.

    raw: the raw-key backing `[1, cap_raw, d_I]`; cos/sin: tables at the blocks' first
    tokens. float32 `((r0 + r1) + r2) + r3`, / 4, bf16, k_layernorm, RoPE (QSA.md §7).
    `first_block` may be an int32 array (compiled core: a moving scalar).
    """
    r = g.ratio
    if impl == "cuda" and n_blocks > 0:
        from .kernels.rms_norm import norm_rope_cuda_supports, pool_norm_rope_cuda

        if norm_rope_cuda_supports(raw, norm_w, g.rotary_dim) and cos.shape[0] == n_blocks:
            start = _block_start(first_block) if isinstance(first_block, int) else first_block
            return pool_norm_rope_cuda(
                raw, start.reshape(1), r, norm_w, g.eps, cos, sin, g.rotary_dim
            )
    if isinstance(first_block, int):
        rows = raw[:, first_block * r : (first_block + n_blocks) * r, :]
    else:
        # A start for the row axis only: no concatenation of zeros around it (three more
        # primitives and kernels per step).
        start = (first_block * r).reshape(1)
        rows = mx.slice(raw, start, (1,), (1, n_blocks * r, g.head_dim))
    # Each block's r token rows side by side, one split (views) into r [1, n, d_I] parts,
    # summed in order 0..r-1 (no reshape after it: the cast, sum, mean and the norm's cast fuse).
    flat = rows.astype(mx.float32).reshape(1, n_blocks, r * g.head_dim)
    parts = mx.split(flat, r, axis=2)
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    mean = (acc / r).astype(raw.dtype)
    return rope(norm(mean, norm_w, g.eps, impl), cos, sin, g.rotary_dim, impl)


@lru_cache(maxsize=64)
def _block_start(first_block: int) -> mx.array:
    """The first block as the pooling kernel's int32 `[1]` input, made once per value (on the
    device, past MLX's 8-byte pool: `device_arrays`)."""
    return int_arange(first_block, first_block + 1)


@lru_cache(maxsize=64)
def block_penalty(n: int) -> mx.array:
    """`float32(b) * float32(1e-12)` for b < n, computed once outside any compiled graph
    (inside one, the multiply could contract with the subtraction into an FMA)."""
    p = mx.arange(n, dtype=mx.float32) * mx.array(1e-12, dtype=mx.float32)
    mx.eval(p)
    return p


def score_blocks(q: mx.array, keys_t: mx.array, penalty: mx.array) -> mx.array:
    """Adjusted scores `[S, N]` float32 of index queries against block keys (QSA.md §8.2).

    q: `[1, H_I, S, d_I]` (bf16 or f32); keys_t: `[d_I, N]` float32 (the mirror layout).
    ReLU per head, head sum in order 0..H_I-1, float32 division by float32(sqrt(128)),
    minus the per-block penalty. Rows' visibility is applied by the selector.
    """
    # One head at a time: head h's [S, N] logits are folded into the accumulator before
    # head h+1's, so the graph never needs the [H_I, S, N] block that a batched matmul
    # materialises (RUNTIME §6.3 budgets chunks by one float32 [C, N] plane). Each head's
    # matmul is the same float32 GEMM as one batch entry of the batched form and the head
    # sum keeps the order 0..H_I-1, so the bits are unchanged. No mx.eval (this also runs
    # inside mx.compile): measured at S=2048, N=8704, H_I=4 on CPU the peak falls from ~8
    # planes to ~4; the rest is MLX allocating ahead of the running kernels (an eval per
    # head would reach ~2).
    qf = q[0].astype(mx.float32)
    acc = mx.maximum(mx.matmul(qf[0], keys_t), 0.0)
    for h in range(1, qf.shape[0]):
        acc = acc + mx.maximum(mx.matmul(qf[h], keys_t), 0.0)
    return acc / mx.array(SQRT_128_F32, dtype=mx.float32) - penalty


def visible_blocks(positions: mx.array, ratio: int) -> mx.array:
    """nb(p) = (p + 1) // r per row, int32 `[S]`."""
    return (positions + 1) // ratio


def top_blocks(adj: mx.array, nb_rows: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """Exact top-k per row in the order (adj desc, id asc) over blocks b < nb_rows.

    adj: `[S, N]` float32. Returns ids int32 `[S, k]` (valid first, ascending), valid bool
    `[S, k]`, scores float32 `[S, k]` (invalid: id 0, False, -inf). Independent of sort
    stability: the k-th largest value is a threshold, exact ties at it go to the lowest ids.
    """
    S, N = adj.shape
    ids_n = mx.arange(N, dtype=mx.int32)
    eligible = ids_n[None, :] < nb_rows[:, None]
    adj = mx.where(eligible, adj, -mx.inf)
    if N > k:
        thresh = mx.min(mx.topk(adj, k, axis=-1), axis=-1, keepdims=True)
        above = eligible & (adj > thresh)
        ties = eligible & (adj == thresh)
        need = k - mx.sum(above, axis=-1, keepdims=True).astype(mx.int32)
        sel = above | (ties & (mx.cumsum(ties.astype(mx.int32), axis=-1) <= need))
    else:
        sel = eligible
    count = mx.sum(sel, axis=-1, keepdims=True).astype(mx.int32)
    rank = mx.cumsum(sel.astype(mx.int32), axis=-1) - 1
    width = max(k, N)
    slot = mx.where(sel, rank, width)  # unselected ids land in a discarded column
    out = mx.zeros((S, width + 1), dtype=mx.int32)
    out = mx.put_along_axis(out, slot, mx.broadcast_to(ids_n[None, :], (S, N)), axis=-1)
    valid = mx.arange(k, dtype=mx.int32)[None, :] < count
    ids = mx.where(valid, out[:, :k], 0)
    scores = mx.where(valid, mx.take_along_axis(adj, ids, axis=-1), -mx.inf)
    return ids, valid, scores


def select_rows(
    q: mx.array,
    keys_t: mx.array | None,
    penalty: mx.array | None,
    positions: mx.array,
    ratio: int,
    k: int,
    chunk: int,
    pooled: mx.array | None = None,
    impl: str = "portable",
    ctr: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Score and select for every row, `chunk` query rows per pass (bounded score memory).

    q `[1, H_I, S, d_I]`, keys_t `[d_I, N]` float32, positions int32 `[S]`; returns the
    `top_blocks` triple for all S rows. With `impl="cuda"` and the `pooled` backing
    `[1, N, d_I]` (the bf16 rows keys_t mirrors), short calls run the CUDA selector, the one
    score routine every path of that backend uses (RUNTIME.md §10.5); keys_t and penalty may
    then be None, and `ctr` is the counter slot of a one-launch selector (default: a fresh one).
    """
    if impl == "cuda" and pooled is not None and cuda_selector_supports(q, pooled):
        from .kernels.selector import select_blocks_cuda

        return select_blocks_cuda(q, pooled, positions, block_topk=k, ratio=ratio, ctr=ctr)
    if impl == "cuda" and pooled is not None:
        from .kernels.prefill_score import prefill_score_supports, select_prefill_cuda

        if prefill_score_supports(q, pooled):  # many rows: the tensor-core producer
            return select_prefill_cuda(q, pooled, positions, block_topk=k, ratio=ratio, chunk=chunk)
    S = q.shape[2]
    nb_rows = (positions + 1) // ratio
    parts = []
    for r0 in range(0, S, chunk):
        r1 = min(S, r0 + chunk)
        adj = score_blocks(q[:, :, r0:r1, :], keys_t, penalty)
        parts.append(top_blocks(adj, nb_rows[r0:r1], k))
    if len(parts) == 1:
        return parts[0]
    ids, valid, scores = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    return ids, valid, scores


def cuda_selector_supports(q: mx.array, pooled: mx.array) -> bool:
    """Whether the CUDA selector covers q `[1, H_I, S, d_I]` against these block keys (its
    launcher's own rule; decided once per shape, since every layer asks at every step)."""
    return _selector_supports(q.shape, q.dtype, pooled.shape, pooled.dtype)


@functools.lru_cache(maxsize=512)
def _selector_supports(q_shape: tuple, q_dtype, pooled_shape: tuple, pooled_dtype) -> bool:
    from .kernels.selector import selector_unsupported

    _, n_heads, S, d_i = q_shape
    if pooled_dtype != q_dtype or pooled_shape[2] != d_i:
        return False
    return selector_unsupported(q_dtype, S, n_heads, d_i, pooled_shape[1]) is None


@dataclass
class Selection:
    """A selection in one of RUNTIME.md §7's formats.

    kind: "blocks" | "prefill_blocks" | "row_tokens" | "token_list" | "dense_mask".
    """

    kind: str
    ids: mx.array | None = None  # [S, K] int32
    valid: mx.array | None = None  # [S, K] bool
    scores: mx.array | None = None  # [S, K] float32
    slots: mx.array | None = None  # row tokens [S, B + r] / token list [n]
    slot_valid: mx.array | None = None
    mask: mx.array | None = None  # dense mask [1, 1, S, T]
    tail_start: int = 0


def select_row_tokens(
    q: mx.array,
    keys_t: mx.array | None,
    penalty: mx.array | None,
    positions: mx.array,
    ratio: int,
    k: int,
    chunk: int,
    pooled: mx.array | None = None,
    impl: str = "portable",
    ctr: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The `row_tokens` selection `(slots, slot_valid)` `[S, k·r + r]` of every row (RUNTIME
    §7): :func:`select_rows`, then :func:`row_token_slots`. Where the CUDA selector runs, it
    writes the slots itself (the same values), so no portable ops follow it: each one is a
    primitive, and host time, per step."""
    if impl == "cuda" and pooled is not None and cuda_selector_supports(q, pooled):
        from .kernels.selector import select_blocks_cuda

        out = select_blocks_cuda(
            q, pooled, positions, block_topk=k, ratio=ratio, mode="row_tokens", ctr=ctr
        )
        return out[3], out[4]
    ids, valid, _ = select_rows(q, keys_t, penalty, positions, ratio, k, chunk, pooled, impl, ctr)
    return row_token_slots(ids, valid, positions, ratio)


def row_token_slots(
    ids: mx.array, valid: mx.array, positions: mx.array, ratio: int
) -> tuple[mx.array, mx.array]:
    """Row-tokens format `[S, K·r + r]` (RUNTIME §7): block groups ascending, then the tail."""
    S, k = ids.shape
    j = mx.arange(ratio, dtype=mx.int32)
    blk = (ids[:, :, None] * ratio + j[None, None, :]).reshape(S, k * ratio)
    blk_valid = mx.repeat(valid, ratio, axis=1)
    tail = ((positions + 1) // ratio * ratio)[:, None] + j[None, :]
    tail_valid = tail <= positions[:, None]
    slots = mx.concatenate([mx.where(blk_valid, blk, 0), mx.where(tail_valid, tail, 0)], axis=1)
    return slots, mx.concatenate([blk_valid, tail_valid], axis=1)


def dense_keep_mask(
    ids: mx.array, valid: mx.array, positions: mx.array, width: int, ratio: int
) -> mx.array:
    """Boolean keep-mask `[S, width]` over tokens: selected blocks OR visible tail, AND causal.

    Scatter into `width // ratio + 1` block columns; the last one absorbs invalid slots.
    """
    S, _ = ids.shape
    n_blk = -(-width // ratio)
    sentinel = n_blk
    cols = mx.where(valid, ids, sentinel)
    blocks = mx.zeros((S, n_blk + 1), dtype=mx.bool_)
    blocks = mx.put_along_axis(blocks, cols, mx.ones(cols.shape, dtype=mx.bool_), axis=-1)
    t = mx.arange(width, dtype=mx.int32)
    in_block = mx.take(blocks[:, :n_blk], t // ratio, axis=1)
    p = positions[:, None]
    tail = (t[None, :] >= (p + 1) // ratio * ratio) & (t[None, :] <= p)
    return (in_block | tail) & (t[None, :] <= p)
