"""Float64 NumPy reference of one QSA layer (QSA.md §11; selection formats of RUNTIME.md §7).

Everything is computed in float64 from float64 casts of the inputs; none of the bf16/float32
rounding steps of QSA.md §3/§5/§9 are modelled, so the oracle is the exact math that every path
approximates (compare with bf16 tolerances). Imports only NumPy, the stdlib and `mlx_qsa.config`.

Layouts: token axis first everywhere. Per-token head tensors are `[n, heads, width]`; RoPE tables
are `[n, d_r/2]`; positions are int `[n]` (text) or `[3, n]` (T, H, W ids).
Weights are keyed by HF names relative to `self_attn.` with norm weights in the stored plain form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mlx_qsa.config import QSAConfig, inv_frequencies, mrope_axes

Weights = Mapping[str, np.ndarray]

__all__ = [
    "OracleResult",
    "adjusted",
    "apply_rope",
    "block_scores",
    "dense_mask",
    "forward",
    "gate_and_project",
    "pool_blocks",
    "prepare",
    "project",
    "rms_norm",
    "rope_cos_sin",
    "row_token_slots",
    "select_blocks",
    "sparse_attention",
    "token_sets",
    "visible_blocks",
]


def _f64(x: object) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _linear(weights: Weights, name: str, x: np.ndarray, bias: bool) -> np.ndarray:
    """`x Wᵀ (+ b)` with the weight `name.weight` (and `name.bias` when `bias`)."""
    y = x @ _f64(weights[f"{name}.weight"]).T
    if bias:
        y = y + _f64(weights[f"{name}.bias"])
    return y


# ------------------------------------------------------------------------------------
# Norm and RoPE (QSA.md §3, §5)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Plain-weight RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) * w`."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(w)


def rope_cos_sin(positions: np.ndarray, cfg: QSAConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin `[n, d_r/2]` for int positions `[n]` (text) or `[3, n]` (T, H, W).

    Pair i uses the float32 frequency `inv_frequencies(cfg)[i]` and the position of axis
    `mrope_axes(cfg)[i]`; 1-D positions drive every axis.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim == 1:
        pos = np.stack([pos, pos, pos])
    if pos.ndim != 2 or pos.shape[0] != 3:
        raise ValueError(f"positions: expected [n] or [3, n], got shape {pos.shape}")
    freqs = np.asarray(inv_frequencies(cfg), dtype=np.float64)
    axes = np.asarray(mrope_axes(cfg), dtype=np.int64)
    per_pair = pos[axes].T.astype(np.float64)  # [n, d_r/2]: position of pair i's axis
    angles = per_pair * freqs
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, d_r: int) -> np.ndarray:
    """Rotate-half RoPE on channels `[0, d_r)` of the last axis; the rest passes through.

    `x` is `[n, width]` or `[n, heads, width]` (token axis first); `cos`/`sin` are `[n, d_r/2]`.
    """
    x = _f64(x)
    cos, sin = _f64(cos), _f64(sin)
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    half = d_r // 2
    a, b = x[..., :half], x[..., half:d_r]
    out = x.copy()
    out[..., :half] = a * cos - b * sin
    out[..., half:d_r] = b * cos + a * sin
    return out


# ------------------------------------------------------------------------------------
# Projections (QSA.md §4, §6)


def project(weights: Weights, cfg: QSAConfig, x: np.ndarray) -> dict[str, np.ndarray]:
    """Input projections of `x [n, D]`, before norms and RoPE.

    Returns q, gate `[n, H, d]` (q_proj slab h = query then gate), k, v `[n, Hkv, d]`, and with an
    indexer index_q `[n, H_I, d_I]` and index_k_raw `[n, d_I]`.
    """
    x = _f64(x)
    n = x.shape[0]
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bias = cfg.attention_bias
    u = _linear(weights, "q_proj", x, bias).reshape(n, H, 2, d)
    out = {
        "q": u[:, :, 0, :],
        "gate": u[:, :, 1, :],
        "k": _linear(weights, "k_proj", x, bias).reshape(n, Hkv, d),
        "v": _linear(weights, "v_proj", x, bias).reshape(n, Hkv, d),
    }
    if cfg.has_indexer:
        hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
        z = _linear(weights, "indexer.index_qk_proj", x, False)
        out["index_q"] = z[:, : hi * di].reshape(n, hi, di)
        out["index_k_raw"] = z[:, hi * di : (hi + 1) * di]
    return out


def _text_positions(positions: np.ndarray) -> np.ndarray:
    pos = np.asarray(positions, dtype=np.int64)
    if pos.ndim == 1:
        return pos
    if pos.ndim == 2 and bool(np.all(pos == pos[:1])):
        return pos[0]
    raise ValueError("index_positions: required when positions are not text (T = H = W)")


def prepare(
    weights: Weights,
    cfg: QSAConfig,
    proj: Mapping[str, np.ndarray],
    positions: np.ndarray,
    index_positions: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Per-head norms then RoPE: attention q, k at `positions`, index_q at `index_positions`.

    `index_positions` defaults to the text positions of `positions` (itself when 1-D, or the
    common row of a `[3, n]` array with T = H = W; otherwise it must be given). v, gate and
    index_k_raw pass through unchanged (the raw index key is never normalised per token).
    """
    eps, d_r = cfg.rms_norm_eps, cfg.rotary_dim
    cos, sin = rope_cos_sin(positions, cfg)
    out = dict(proj)
    out["q"] = apply_rope(rms_norm(proj["q"], weights["q_norm.weight"], eps), cos, sin, d_r)
    out["k"] = apply_rope(rms_norm(proj["k"], weights["k_norm.weight"], eps), cos, sin, d_r)
    if cfg.has_indexer:
        ipos = _text_positions(positions) if index_positions is None else index_positions
        icos, isin = rope_cos_sin(ipos, cfg)
        qi = rms_norm(proj["index_q"], weights["indexer.q_layernorm.weight"], eps)
        out["index_q"] = apply_rope(qi, icos, isin, d_r)
    return out


# ------------------------------------------------------------------------------------
# Compression, scoring, selection (QSA.md §7, §8)


def pool_blocks(
    index_k_raw: np.ndarray,
    weights: Weights,
    cfg: QSAConfig,
    n_blocks: int,
    block_positions: np.ndarray | None = None,
) -> np.ndarray:
    """Block keys `[n_blocks, d_I]`: mean of the r raw keys → k_layernorm → RoPE.

    Block b uses raw rows `r·b .. r·b + r − 1` of `index_k_raw` and is rotated at
    `block_positions[..., b]` (default: text position `r·b`, its first token).
    """
    r = cfg.indexer_compress_ratio
    raw = _f64(index_k_raw)
    if raw.shape[0] < r * n_blocks:
        raise ValueError(f"index_k_raw: {raw.shape[0]} rows cannot fill {n_blocks} blocks")
    groups = raw[: r * n_blocks].reshape(n_blocks, r, -1)
    mean = groups[:, 0]
    for j in range(1, r):
        mean = mean + groups[:, j]
    mean = mean / r
    normed = rms_norm(mean, weights["indexer.k_layernorm.weight"], cfg.rms_norm_eps)
    if block_positions is None:
        block_positions = r * np.arange(n_blocks)
    cos, sin = rope_cos_sin(block_positions, cfg)
    return apply_rope(normed, cos, sin, cfg.rotary_dim)


def block_scores(index_q: np.ndarray, block_keys: np.ndarray, cfg: QSAConfig) -> np.ndarray:
    """`[S, nb]`: Σ_h ReLU(⟨index_q[s, h], block_keys[b]⟩) / sqrt(d_I) (no visibility applied)."""
    dots = np.einsum("shi,bi->shb", _f64(index_q), _f64(block_keys))
    return np.maximum(dots, 0.0).sum(axis=1) / np.sqrt(float(cfg.indexer_head_dim))


def adjusted(scores: np.ndarray) -> np.ndarray:
    """`score − b · 1e-12` along the last (block) axis."""
    scores = _f64(scores)
    return scores - np.arange(scores.shape[-1], dtype=np.float64) * 1e-12


def visible_blocks(p: int, cfg: QSAConfig) -> int:
    """nb(p) = (p + 1) // r: the complete blocks visible to a query at position p."""
    return (int(p) + 1) // cfg.indexer_compress_ratio


def top_blocks(adj: np.ndarray, k: int) -> np.ndarray:
    """The first `k` ids of the order (adj descending, id ascending), returned ascending."""
    adj = _f64(adj)
    order = np.lexsort((np.arange(adj.shape[0]), -adj))
    return np.sort(order[:k]).astype(np.int64)


def select_blocks(
    index_q: np.ndarray,
    block_keys: np.ndarray,
    query_positions: Sequence[int] | np.ndarray,
    cfg: QSAConfig,
) -> list[np.ndarray]:
    """Per row, the selected block ids ascending (k_eff = min(K_b, nb(p)), only b < nb(p)).

    `index_q [S, H_I, d_I]` holds the rows' (rotated) index queries, `block_keys [nb, d_I]` the
    keys of blocks 0..nb−1; row s is the query at position `query_positions[s]`.
    """
    adj = adjusted(block_scores(index_q, block_keys, cfg))
    n_keys = adj.shape[1]
    out = []
    for s, p in enumerate(query_positions):
        nb = visible_blocks(p, cfg)
        if nb > n_keys:
            raise ValueError(f"block_keys: {n_keys} blocks, position {p} sees {nb}")
        out.append(top_blocks(adj[s, :nb], min(cfg.block_topk, nb)))
    return out


def token_sets(
    selected: Sequence[np.ndarray], query_positions: Sequence[int] | np.ndarray, cfg: QSAConfig
) -> list[np.ndarray]:
    """Per row: tokens of the selected blocks in ascending id order, then the tail r·nb(p)..p."""
    r = cfg.indexer_compress_ratio
    out = []
    for blocks, p in zip(selected, query_positions, strict=True):
        b = np.sort(np.asarray(blocks, dtype=np.int64))
        expanded = (r * b[:, None] + np.arange(r)).reshape(-1)
        tail = np.arange(r * visible_blocks(p, cfg), int(p) + 1, dtype=np.int64)
        out.append(np.concatenate([expanded, tail]))
    return out


def row_token_slots(
    selected: Sequence[np.ndarray], query_positions: Sequence[int] | np.ndarray, cfg: QSAConfig
) -> tuple[np.ndarray, np.ndarray]:
    """RUNTIME §7 row-token slots `[S, K_b·r + r]` int32 and their validity (bool).

    Slots r·i .. r·i + r − 1 hold the i-th selected block (ascending id); slot K_b·r + j holds
    r·nb(p) + j, valid while ≤ p. Invalid slots hold token 0.
    """
    r, kb = cfg.indexer_compress_ratio, cfg.block_topk
    width = kb * r + r
    slots = np.zeros((len(selected), width), dtype=np.int32)
    valid = np.zeros((len(selected), width), dtype=bool)
    for s, (blocks, p) in enumerate(zip(selected, query_positions, strict=True)):
        b = np.sort(np.asarray(blocks, dtype=np.int64))
        n = r * b.shape[0]
        slots[s, :n] = (r * b[:, None] + np.arange(r)).reshape(-1)
        valid[s, :n] = True
        tail = r * visible_blocks(p, cfg) + np.arange(r)
        ok = tail <= int(p)
        slots[s, kb * r :] = np.where(ok, tail, 0)
        valid[s, kb * r :] = ok
    return slots, valid


def dense_mask(
    selected: Sequence[np.ndarray],
    query_positions: Sequence[int] | np.ndarray,
    T: int,
    cfg: QSAConfig,
) -> np.ndarray:
    """RUNTIME §7 dense mask `[S, T]`: selected-block tokens OR the visible tail, AND causal."""
    mask = np.zeros((len(selected), T), dtype=bool)
    for s, toks in enumerate(token_sets(selected, query_positions, cfg)):
        mask[s, toks[toks < T]] = True
    cols = np.arange(T)
    return mask & (cols[None, :] <= np.asarray(query_positions, dtype=np.int64)[:, None])


# ------------------------------------------------------------------------------------
# Attention, gate, output (QSA.md §9)


def sparse_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    token_sets: Sequence[np.ndarray],
    cfg: QSAConfig,
) -> np.ndarray:
    """`[S, H, d]`: per row, softmax attention over its token set; head h reads KV head h // G."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    kv_head = np.arange(cfg.num_attention_heads) // cfg.gqa_group
    out = np.zeros(q.shape, dtype=np.float64)
    for s, toks in enumerate(token_sets):
        toks = np.asarray(toks, dtype=np.int64)
        if toks.size == 0:
            continue
        ks, vs = k[toks][:, kv_head], v[toks][:, kv_head]  # [n, H, d]
        logits = np.einsum("hd,nhd->hn", q[s], ks) * cfg.scale
        logits = logits - logits.max(axis=1, keepdims=True)
        prob = np.exp(logits)
        prob = prob / prob.sum(axis=1, keepdims=True)
        out[s] = np.einsum("hn,nhd->hd", prob, vs)
    return out


def gate_and_project(
    o: np.ndarray, gate: np.ndarray, weights: Weights, cfg: QSAConfig
) -> np.ndarray:
    """`[S, D]`: o ⊙ sigmoid(gate), heads concatenated h-major, then o_proj (+ bias)."""
    o, gate = _f64(o), _f64(gate)
    gated = (o * (0.5 + 0.5 * np.tanh(0.5 * gate))).reshape(o.shape[0], -1)  # stable sigmoid
    return _linear(weights, "o_proj", gated, cfg.attention_bias)


# ------------------------------------------------------------------------------------
# Whole layer


@dataclass
class OracleResult:
    """Output and intermediates of `forward` (S = query rows, T = all tokens)."""

    output: np.ndarray  # [S, D]
    selected: list[np.ndarray]  # per row, block ids ascending (empty without an indexer)
    tokens: list[np.ndarray]  # per row, the attended token positions
    k: np.ndarray  # [T, Hkv, d] normalised + rotated
    v: np.ndarray  # [T, Hkv, d]
    index_k_raw: np.ndarray | None  # [T, d_I]
    block_keys: np.ndarray | None  # [T // r, d_I]
    q: np.ndarray  # [S, H, d] normalised + rotated
    index_q: np.ndarray | None  # [S, H_I, d_I] normalised + rotated
    gate: np.ndarray  # [S, H, d]
    attention: np.ndarray  # [S, H, d], before the gate
    query_positions: np.ndarray  # [S] text positions start..T-1


def forward(
    weights: Weights,
    cfg: QSAConfig,
    hidden: np.ndarray,
    start: int,
    positions: np.ndarray | None = None,
    *,
    dense: bool = False,
    index_positions: np.ndarray | None = None,
) -> OracleResult:
    """One QSA layer over `hidden [T, D]` (all tokens 0..T−1); query rows are start..T−1.

    `positions` (int `[3, T]`, or `[T]`) drive the attention q/k RoPE; a layer without
    `mrope_section` ignores them (RUNTIME §1.3 `no_axes`). The indexer uses text positions
    unless `index_positions` is given (HF-exact sparse vision). `dense=True` (or a layer without
    indexer) attends to the whole causal prefix; the indexer still runs and `selected` holds what
    it would have chosen, but `tokens` is 0..p.
    """
    hidden = _f64(hidden)
    T = hidden.shape[0]
    if not 0 <= start < T:
        raise ValueError(f"start: expected 0 <= start < T={T}, got {start}")
    text = np.arange(T, dtype=np.int64)
    attn_pos = text if positions is None or not cfg.has_mrope_axes else positions
    prep = prepare(
        weights,
        cfg,
        project(weights, cfg, hidden),
        attn_pos,
        text if index_positions is None else index_positions,
    )
    qpos = text[start:]
    index_k_raw = block_keys = index_q = None
    if cfg.has_indexer:
        r = cfg.indexer_compress_ratio
        index_k_raw = prep["index_k_raw"]
        index_q = prep["index_q"][start:]
        n_blocks = T // r
        bpos = None
        if index_positions is not None:
            bpos = np.asarray(index_positions, dtype=np.int64)[..., : r * n_blocks : r]
        block_keys = pool_blocks(index_k_raw, weights, cfg, n_blocks, bpos)
        selected = select_blocks(index_q, block_keys, qpos, cfg)
        tokens = token_sets(selected, qpos, cfg)
    else:
        selected = [np.zeros(0, dtype=np.int64) for _ in qpos]
    if dense or not cfg.has_indexer:
        tokens = [np.arange(p + 1, dtype=np.int64) for p in qpos]
    q = prep["q"][start:]
    gate = prep["gate"][start:]
    o = sparse_attention(q, prep["k"], prep["v"], tokens, cfg)
    return OracleResult(
        output=gate_and_project(o, gate, weights, cfg),
        selected=selected,
        tokens=tokens,
        k=prep["k"],
        v=prep["v"],
        index_k_raw=index_k_raw,
        block_keys=block_keys,
        q=q,
        index_q=index_q,
        gate=gate,
        attention=o,
        query_positions=qpos,
    )
