"""Tests of the float64 NumPy oracle (mlx_qsa.oracle) on small random geometries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_qsa import oracle
from mlx_qsa.config import QSAConfig, inv_frequencies

R = 4


def small_cfg(**kw: object) -> QSAConfig:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        rope_theta=10_000.0,
        mrope_section=(2, 1, 1),
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=R,
    )
    base.update(kw)
    return QSAConfig(**base)


def no_indexer(cfg: QSAConfig) -> QSAConfig:
    return cfg.replace(
        **{
            k: None
            for k in (
                "indexer_n_heads",
                "indexer_kv_heads",
                "indexer_head_dim",
                "indexer_budget",
                "indexer_compress_ratio",
            )
        }
    )


def make_weights(cfg: QSAConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, H, Hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def lin(o: int, i: int) -> np.ndarray:
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    w = {
        "q_proj.weight": lin(2 * H * d, D),
        "k_proj.weight": lin(Hkv * d, D),
        "v_proj.weight": lin(Hkv * d, D),
        "o_proj.weight": lin(D, H * d),
        "q_norm.weight": (1 + 0.3 * rng.standard_normal(d)).astype(np.float32),
        "k_norm.weight": (1 + 0.3 * rng.standard_normal(d)).astype(np.float32),
    }
    if cfg.attention_bias:
        for name, n in (
            ("q_proj", 2 * H * d),
            ("k_proj", Hkv * d),
            ("v_proj", Hkv * d),
            ("o_proj", D),
        ):
            w[f"{name}.bias"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
    if cfg.has_indexer:
        hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
        w["indexer.index_qk_proj.weight"] = lin((hi + 1) * di, D)
        w["indexer.q_layernorm.weight"] = (1 + 0.3 * rng.standard_normal(di)).astype(np.float32)
        w["indexer.k_layernorm.weight"] = (1 + 0.3 * rng.standard_normal(di)).astype(np.float32)
    return w


def make_hidden(cfg: QSAConfig, T: int, seed: int) -> np.ndarray:
    return (
        np.random.default_rng(seed + 1000).standard_normal((T, cfg.hidden_size)).astype(np.float32)
    )


# -- an independent dense reference (explicit loops / complex RoPE / full causal mask) ------


def ref_rope(x: np.ndarray, pos: np.ndarray, cfg: QSAConfig) -> np.ndarray:
    """Rotate-half RoPE via complex multiplication; x [T, heads, width], pos [T] text."""
    h = cfg.rotary_dim // 2
    f = np.array(inv_frequencies(cfg), dtype=np.float64)
    z = (x[..., :h] + 1j * x[..., h : 2 * h]) * np.exp(1j * pos[:, None, None] * f)
    out = x.astype(np.float64).copy()
    out[..., :h], out[..., h : 2 * h] = z.real, z.imag
    return out


def ref_dense(
    w: dict[str, np.ndarray], cfg: QSAConfig, x: np.ndarray, mask: np.ndarray | None = None
) -> np.ndarray:
    """Gated GQA with an explicit [T, T] mask (default causal); returns [T, D]."""
    x = x.astype(np.float64)
    T = x.shape[0]
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b = cfg.attention_bias

    def lin(name: str) -> np.ndarray:
        y = x @ w[f"{name}.weight"].astype(np.float64).T
        return y + w[f"{name}.bias"] if b else y

    def rms(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v**2).mean(-1, keepdims=True) + cfg.rms_norm_eps) * g

    u = lin("q_proj")
    q = np.stack([u[:, 2 * d * h : 2 * d * h + d] for h in range(H)], 1)
    g = np.stack([u[:, 2 * d * h + d : 2 * d * (h + 1)] for h in range(H)], 1)
    k = lin("k_proj").reshape(T, Hkv, d)
    v = lin("v_proj").reshape(T, Hkv, d)
    pos = np.arange(T)
    q = ref_rope(rms(q, w["q_norm.weight"]), pos, cfg)
    k = ref_rope(rms(k, w["k_norm.weight"]), pos, cfg)
    if mask is None:
        mask = np.tril(np.ones((T, T), dtype=bool))
    out = np.zeros((T, H, d))
    for h in range(H):
        j = h * Hkv // H
        a = q[:, h] @ k[:, j].T / np.sqrt(d)
        a = np.where(mask, a, -np.inf)
        p = np.exp(a - a.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v[:, j]
    y = (out / (1 + np.exp(-g))).reshape(T, H * d) @ w["o_proj.weight"].astype(np.float64).T
    return y + w["o_proj.bias"] if b else y


# -- dense regime / no indexer ---------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("start", [0, 7, 18])
def test_dense_regime_equals_causal(bias: bool, start: int) -> None:
    cfg = small_cfg(attention_bias=bias)
    T = R * (cfg.block_topk + 1) - 1  # last query p = T-1 still has nb(p) = K_b
    w, x = make_weights(cfg, 1), make_hidden(cfg, T, 1)
    res = oracle.forward(w, cfg, x, start)
    np.testing.assert_allclose(res.output, ref_dense(w, cfg, x)[start:], rtol=1e-10, atol=1e-10)
    for p, blocks, toks in zip(range(start, T), res.selected, res.tokens, strict=True):
        np.testing.assert_array_equal(blocks, np.arange((p + 1) // R))
        np.testing.assert_array_equal(toks, np.arange(p + 1))


def test_dense_flag_and_no_indexer_equal_causal() -> None:
    cfg = small_cfg()
    T = 45
    w, x = make_weights(cfg, 2), make_hidden(cfg, T, 2)
    ref = ref_dense(w, cfg, x)
    res = oracle.forward(w, cfg, x, 10, dense=True)
    np.testing.assert_allclose(res.output, ref[10:], rtol=1e-10, atol=1e-10)
    assert all(len(s) == cfg.block_topk for s in res.selected[-5:])  # indexer still ran
    sparse = oracle.forward(w, cfg, x, 10)
    assert not np.allclose(sparse.output[-1], ref[-1])  # the sparse regime really differs
    cfg0 = no_indexer(cfg)
    w0 = {k: v for k, v in w.items() if not k.startswith("indexer.")}
    res0 = oracle.forward(w0, cfg0, x, 3)
    np.testing.assert_allclose(res0.output, ref[3:], rtol=1e-10, atol=1e-10)
    assert res0.block_keys is None and all(s.size == 0 for s in res0.selected)


# -- sparse regime --------------------------------------------------------------------


@pytest.mark.parametrize("budget", [16, 32])
def test_first_sparse_positions(budget: int) -> None:
    cfg = small_cfg(indexer_budget=budget)
    kb = cfg.block_topk
    first = R * (kb + 1) - 1  # nb(first) = K_b + 1
    T = first + 8
    w, x = make_weights(cfg, 3), make_hidden(cfg, T, 3)
    res = oracle.forward(w, cfg, x, first - 1)
    assert len(res.tokens[0]) == first  # p = first-1: still dense (whole prefix)
    for p, blocks, toks in zip(
        res.query_positions[1:], res.selected[1:], res.tokens[1:], strict=True
    ):
        assert len(blocks) == kb and np.all(np.diff(blocks) > 0)
        assert np.all(blocks < (p + 1) // R)
        assert len(toks) == R * kb + (p + 1) % R and toks.max() <= p
        tail = toks[R * kb :]
        np.testing.assert_array_equal(tail, np.arange(R * ((p + 1) // R), p + 1))
        if (p + 1) % R == 0:
            assert tail.size == 0
            assert (p in toks) == (p // R in blocks)
    # the sparse output is attention over exactly the token sets (dense mask form)
    mask = np.tril(np.ones((T, T), dtype=bool))
    mask[first - 1 :] = oracle.dense_mask(res.selected, res.query_positions, T, cfg)
    np.testing.assert_allclose(
        res.output, ref_dense(w, cfg, x, mask)[first - 1 :], rtol=1e-10, atol=1e-10
    )


def _keys_and_query(cfg: QSAConfig, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index query [1, H_I, d_I] and block keys [nb, d_I] whose head-0 dots are `scores`."""
    hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    q = np.zeros((1, hi, di))
    q[0, 0, 0] = 1.0
    keys = np.zeros((len(scores), di))
    keys[:, 0] = scores
    return q, keys


def test_self_visibility_caveat() -> None:
    cfg = small_cfg()  # K_b = 4
    p = 23  # (p + 1) % 4 == 0: tail empty, own block 5 competes
    scores = np.array([5.0, 4.0, 3.0, 2.0, 1.0, -1.0])
    q, keys = _keys_and_query(cfg, scores)
    sel = oracle.select_blocks(q, keys, [p], cfg)
    np.testing.assert_array_equal(sel[0], [0, 1, 2, 3])
    toks = oracle.token_sets(sel, [p], cfg)[0]
    assert p not in toks and len(toks) == 16
    scores[5] = 10.0
    sel = oracle.select_blocks(*_keys_and_query(cfg, scores), [p], cfg)
    np.testing.assert_array_equal(sel[0], [0, 1, 2, 5])
    assert p in oracle.token_sets(sel, [p], cfg)[0]
    # blocks beyond nb(p) are never eligible, however high they score
    scores = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0])
    sel = oracle.select_blocks(*_keys_and_query(cfg, scores), [22], cfg)
    np.testing.assert_array_equal(sel[0], [0, 1, 2, 3])


def test_tie_order_lowest_ids_win() -> None:
    cfg = small_cfg()
    q, keys = _keys_and_query(cfg, -np.arange(1.0, 11.0))  # all dots < 0 → all scores 0
    np.testing.assert_array_equal(oracle.block_scores(q, keys, cfg), 0.0)
    assert np.all(np.diff(oracle.adjusted(np.zeros((1, 10)))[0]) < 0)
    np.testing.assert_array_equal(oracle.select_blocks(q, keys, [40], cfg)[0], [0, 1, 2, 3])
    scores = np.array([1.0, 3.0, 2.0, 3.0, 0.5, 3.0, 3.0, 3.0])  # five 3.0s: lowest four win
    sel = oracle.select_blocks(*_keys_and_query(cfg, scores), [31], cfg)
    np.testing.assert_array_equal(sel[0], [1, 3, 5, 6])
    scores = np.array([1.0, 3.0, 2.0, 0.0, 2.0, 2.0, 0.0, 2.0])
    sel = oracle.select_blocks(*_keys_and_query(cfg, scores), [31], cfg)
    np.testing.assert_array_equal(sel[0], [1, 2, 4, 5])
    # end to end: a zero indexer projection gives all-zero scores → blocks 0..K_b-1
    w, x = make_weights(cfg, 4), make_hidden(cfg, 40, 4)
    w["indexer.index_qk_proj.weight"] = np.zeros_like(w["indexer.index_qk_proj.weight"])
    res = oracle.forward(w, cfg, x, 30)
    for blocks in res.selected:
        np.testing.assert_array_equal(blocks, np.arange(cfg.block_topk))


def test_block_score_formula() -> None:
    cfg = small_cfg()  # d_I = 16 → scale 1/4
    q = np.zeros((1, 2, 16))
    q[0, 0, 0], q[0, 1, 1] = 1.0, 1.0
    keys = np.array([[2.0, -1.0] + [0.0] * 14, [-3.0, 6.0] + [0.0] * 14, [1.0, 1.0] + [0.0] * 14])
    np.testing.assert_allclose(oracle.block_scores(q, keys, cfg)[0], [0.5, 1.5, 0.5])
    np.testing.assert_allclose(
        oracle.adjusted(np.array([0.5, 1.5, 0.5])),
        [0.5, 1.5 - 1e-12, 0.5 - 2e-12],
        rtol=0,
        atol=1e-18,
    )
    # exact ties of adj itself (no adjustment applied) also go to the lower id
    np.testing.assert_array_equal(oracle.top_blocks(np.array([1.0, 2.0, 2.0, 2.0]), 2), [1, 2])
    np.testing.assert_array_equal(oracle.top_blocks(np.zeros(6), 3), [0, 1, 2])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2, 3), min_size=1, max_size=24), st.integers(1, 8))
def test_top_blocks_matches_sorted(vals: list[int], k: int) -> None:
    adj = oracle.adjusted(np.maximum(np.array(vals, dtype=np.float64), 0.0))
    want = sorted(sorted(range(len(vals)), key=lambda b: (-adj[b], b))[:k])
    np.testing.assert_array_equal(oracle.top_blocks(adj, k), want)


# -- pooling ---------------------------------------------------------------------------


def test_pooling_independent_of_split() -> None:
    cfg = small_cfg()
    w, x = make_weights(cfg, 5), make_hidden(cfg, 50, 5)
    full = oracle.forward(w, cfg, x, 0)
    nb = 50 // R
    assert full.block_keys.shape == (nb, cfg.indexer_head_dim)
    for T, start in ((23, 20), (24, 0), (37, 36), (41, 12)):
        part = oracle.forward(w, cfg, x[:T], start)
        np.testing.assert_allclose(part.block_keys, full.block_keys[: T // R], rtol=0, atol=1e-12)
    raw = full.index_k_raw
    for b in range(nb):
        one = oracle.pool_blocks(raw[R * b : R * b + R], w, cfg, 1, np.array([R * b]))
        np.testing.assert_allclose(one[0], full.block_keys[b], rtol=0, atol=1e-12)
    raw2 = raw.copy()
    raw2[R * 3 : R * 4] += 5.0  # only block 3 changes
    keys2 = oracle.pool_blocks(raw2, w, cfg, nb)
    changed = np.any(np.abs(keys2 - full.block_keys) > 1e-12, axis=1)
    np.testing.assert_array_equal(np.nonzero(changed)[0], [3])
    # mean -> norm -> rope at the first token's position
    m = raw[8:12].mean(0)
    n = m / np.sqrt((m**2).mean() + cfg.rms_norm_eps) * w["indexer.k_layernorm.weight"]
    want = ref_rope(n[None, None], np.array([8]), cfg)[0, 0]
    np.testing.assert_allclose(full.block_keys[2], want, rtol=0, atol=1e-12)


# -- RoPE ------------------------------------------------------------------------------


def test_rope_properties() -> None:
    cfg = small_cfg()
    rng = np.random.default_rng(6)
    t = rng.integers(0, 5000, 20)
    x = rng.standard_normal((20, 3, 16))
    c1, s1 = oracle.rope_cos_sin(t, cfg)
    c3, s3 = oracle.rope_cos_sin(np.stack([t, t, t]), cfg)
    c0, s0 = oracle.rope_cos_sin(t, cfg.replace(mrope_section=None))
    np.testing.assert_array_equal(c1, c3)
    np.testing.assert_array_equal(s1, s3)
    np.testing.assert_array_equal(c1, c0)
    y = oracle.apply_rope(x, c1, s1, cfg.rotary_dim)
    np.testing.assert_allclose(y, ref_rope(x, t, cfg), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
    np.testing.assert_allclose(
        np.linalg.norm(y[..., :8], axis=-1), np.linalg.norm(x[..., :8], axis=-1), rtol=1e-12
    )
    y2 = oracle.apply_rope(x[:, 0], c1, s1, cfg.rotary_dim)  # [n, width] layout
    np.testing.assert_array_equal(y2, y[:, 0])
    # relative-position property: <R_m a, R_n b> depends on m - n only
    a, b = x[0, 0], x[0, 1]

    def dot(m: int, n: int) -> float:
        cs = oracle.rope_cos_sin(np.array([m, n]), cfg)
        r = oracle.apply_rope(np.stack([a, b]), *cs, cfg.rotary_dim)
        return float(r[0] @ r[1])

    assert dot(10, 3) == pytest.approx(dot(107, 100), abs=1e-9)
    # MRoPE axis routing: (2, 1, 1) → pairs 0 T, 1 H, 2 W, 3 T
    pos = np.array([[5], [70], [900]])
    c, _ = oracle.rope_cos_sin(pos, cfg)
    f = inv_frequencies(cfg)
    np.testing.assert_allclose(c[0], np.cos(np.array([5, 70, 900, 5]) * f), rtol=1e-15)


# -- projections and gate ----------------------------------------------------------------


def test_gated_layout_per_head() -> None:
    cfg = small_cfg()
    H, d = cfg.num_attention_heads, cfg.head_dim
    w, x = make_weights(cfg, 7), make_hidden(cfg, 6, 7)
    proj = oracle.project(w, cfg, x)
    W = w["q_proj.weight"].astype(np.float64)
    for h in range(H):
        np.testing.assert_allclose(proj["gate"][:, h], x @ W[2 * d * h + d : 2 * d * h + 2 * d].T)
        np.testing.assert_allclose(proj["q"][:, h], x @ W[2 * d * h : 2 * d * h + d].T)
    assert not np.allclose(proj["gate"][:, 0], x @ W[H * d : H * d + d].T)
    # very negative weights in slab 1's second half silence exactly head 1 in the output
    W2 = W.copy()
    W2[2 * d * 1 + d : 2 * d * 2, :] = -50.0  # gate of head 1 → sigmoid ≈ 0 for x > 0
    w2 = dict(w, **{"q_proj.weight": W2})
    res = oracle.forward(w2, cfg, np.abs(x), 0)
    wo = dict(w2)
    Wo = w["o_proj.weight"].astype(np.float64).copy()
    Wo[:, d : 2 * d] = 0.0
    wo["o_proj.weight"] = Wo
    np.testing.assert_allclose(
        oracle.gate_and_project(res.attention, res.gate, wo, cfg), res.output, rtol=0, atol=1e-12
    )
    assert np.all(res.gate[:, 1] < -50) and np.all(np.abs(res.attention[:, 1]) > 0)
    open_gate = oracle.forward(w, cfg, np.abs(x), 0)
    assert not np.allclose(open_gate.output, res.output)


def test_index_projection_layout_and_norms() -> None:
    cfg = small_cfg()
    w, x = make_weights(cfg, 8), make_hidden(cfg, 9, 8)
    proj = oracle.project(w, cfg, x)
    Z = x.astype(np.float64) @ w["indexer.index_qk_proj.weight"].astype(np.float64).T
    np.testing.assert_allclose(proj["index_q"][:, 1], Z[:, 16:32])
    np.testing.assert_allclose(proj["index_k_raw"], Z[:, 32:48])
    prep = oracle.prepare(w, cfg, proj, np.arange(9))
    np.testing.assert_array_equal(prep["index_k_raw"], proj["index_k_raw"])  # raw stays raw
    np.testing.assert_array_equal(prep["v"], proj["v"])
    n = oracle.rms_norm(proj["k"], w["k_norm.weight"], cfg.rms_norm_eps)
    np.testing.assert_allclose(prep["k"][..., 8:], n[..., 8:])  # norm before RoPE
    with pytest.raises(ValueError, match="index_positions"):
        oracle.prepare(w, cfg, proj, np.stack([np.arange(9), np.zeros(9, int), np.arange(9)]))


def test_vision_positions_only_touch_attention_rope() -> None:
    cfg = small_cfg()
    T = 30
    w, x = make_weights(cfg, 9), make_hidden(cfg, T, 9)
    text = oracle.forward(w, cfg, x, 20)
    t = np.arange(T)
    same = oracle.forward(w, cfg, x, 20, np.stack([t, t, t]))
    np.testing.assert_allclose(same.output, text.output, rtol=0, atol=1e-12)
    vis = np.stack([t, t // 5, t % 5])
    v = oracle.forward(w, cfg, x, 20, vis)
    assert not np.allclose(v.k, text.k)
    np.testing.assert_array_equal(v.v, text.v)
    np.testing.assert_array_equal(v.block_keys, text.block_keys)
    for a, b in zip(v.selected, text.selected, strict=True):
        np.testing.assert_array_equal(a, b)
    flat = oracle.forward(w, cfg.replace(mrope_section=None), x, 20, vis)  # no_axes
    np.testing.assert_allclose(flat.output, text.output, rtol=0, atol=1e-12)


# -- selection formats and attention -------------------------------------------------------


@pytest.mark.parametrize("budget", [16, 32])
def test_row_slots_and_mask_match_token_sets(budget: int) -> None:
    cfg = small_cfg(indexer_budget=budget)
    T = 2 * budget + 11
    w, x = make_weights(cfg, 10), make_hidden(cfg, T, 10)
    res = oracle.forward(w, cfg, x, 0)
    slots, valid = oracle.row_token_slots(res.selected, res.query_positions, cfg)
    kb = cfg.block_topk
    assert slots.shape == (T, kb * R + R) and slots.dtype == np.int32
    mask = oracle.dense_mask(res.selected, res.query_positions, T, cfg)
    assert mask.shape == (T, T)
    for s, (p, toks) in enumerate(zip(res.query_positions, res.tokens, strict=True)):
        np.testing.assert_array_equal(slots[s][valid[s]], toks)
        assert np.all(slots[s][~valid[s]] == 0)
        n_tail = (p + 1) % R
        assert valid[s, kb * R :].sum() == n_tail and valid[s, : kb * R].sum() == len(toks) - n_tail
        np.testing.assert_array_equal(np.nonzero(mask[s])[0], np.sort(toks))


def test_sparse_attention_full_prefix_is_causal() -> None:
    cfg = small_cfg()
    rng = np.random.default_rng(11)
    T, H, Hkv, d = 13, 4, 2, 16
    q, k, v = (rng.standard_normal((T, n, d)) for n in (H, Hkv, Hkv))
    got = oracle.sparse_attention(q, k, v, [np.arange(p + 1) for p in range(T)], cfg)
    mask = np.tril(np.ones((T, T), dtype=bool))
    for h in range(H):
        a = np.where(mask, q[:, h] @ k[:, h // 2].T / 4.0, -np.inf)
        pr = np.exp(a - a.max(1, keepdims=True))
        np.testing.assert_allclose(
            got[:, h], (pr / pr.sum(1, keepdims=True)) @ v[:, h // 2], rtol=1e-12, atol=1e-12
        )
    # token order inside a set does not matter
    perm = oracle.sparse_attention(q, k, v, [np.arange(p + 1)[::-1] for p in range(T)], cfg)
    np.testing.assert_allclose(perm, got, rtol=1e-12, atol=1e-12)
