"""QSAAttention against the float64 oracle, and the layer's bit-level invariants.

Small geometries (budget 16, ratio 4: the first sparse query is position 19) reach every
portable regime at a few dozen tokens; the trace geometry (hidden 64, 24 × 256 heads,
budget 2048) covers the large-prefill consumers near T = 2051–2090.

Outputs are compared with the oracle over the token sets the layer actually attended (the
consumer is tested apart from the selection, RUNTIME §8); the selection itself is compared
exactly with `oracle.select_blocks` fed the layer's own (bf16) index queries and block keys,
and in float32 with the oracle's full-forward selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    TOLERANCES,
    Seen,
    as_f64,
    build,
    hidden_rows,
    layer_index_queries,
    rel_err,
    small_config,
    synthetic_weights,
)

from mlx_qsa import oracle
from mlx_qsa.cache import QSACache
from mlx_qsa.config import INDEXER_KEYS, QSAConfig, QSAOptions
from mlx_qsa.layer import QSAAttention, VisionState
from mlx_qsa.plan import Capabilities

R = 4
BF16, F32 = mx.bfloat16, mx.float32
DTYPE_IDS = {BF16: "bf16", F32: "f32"}


# -- building layers ---------------------------------------------------------------------


def no_indexer(cfg: QSAConfig) -> QSAConfig:
    return cfg.replace(**dict.fromkeys(INDEXER_KEYS))


# -- observing what the layer attended ----------------------------------------------------


def attended(s: Seen) -> list[np.ndarray]:
    """Per row, the sorted token positions the consumer attended."""
    pos = s.positions
    if s.consumers[0] == "sdpa" and s.sdpa_mask in ("none", "causal"):
        return [np.arange(p + 1) for p in pos]
    sel = s.sel
    if sel.kind in ("blocks", "prefill_blocks"):
        ids, valid = np.array(sel.ids), np.array(sel.valid)
        blocks = [ids[i][valid[i]] for i in range(len(pos))]
        toks = []
        for b, p in zip(blocks, pos, strict=True):
            tail = np.arange(R * ((p + 1) // R), p + 1)
            toks.append(np.concatenate([(R * b[:, None] + np.arange(R)).ravel(), tail]))
    elif sel.kind == "row_tokens":
        slots, valid = np.array(sel.slots), np.array(sel.slot_valid)
        toks = [slots[i][valid[i]] for i in range(len(pos))]
    elif sel.kind == "token_list":
        toks = [np.array(sel.slots)]
    else:
        mask = np.array(sel.mask)[0, 0]
        toks = [np.nonzero(mask[i])[0] for i in range(len(pos))]
    return [np.sort(t) for t in toks]


def selection_rows(sel) -> dict[str, np.ndarray]:
    """A selection's arrays in its RUNTIME §7 format, one row per query row."""
    names = ("ids", "valid", "slots", "slot_valid", "mask")
    out = {n: np.array(getattr(sel, n)) for n in names if getattr(sel, n) is not None}
    if "mask" in out:
        out["mask"] = out["mask"][0, 0]
    return {n: np.atleast_2d(a) for n, a in out.items()}  # a token list is one row


def assert_selections_agree(a: Call, b: Call, cfg: QSAConfig, max_ulps: float = 8.0) -> list[int]:
    """Two paths' selections of one call agree bit for bit, except in rows where the only
    difference is blocks whose float64 scores lie within `max_ulps` float32 ulps of the row's
    K-th. Returns those rows (the call's row indices), whose outputs may then differ too.

    The paths are, for example, the CUDA kernels and the portable ops. Both compute QSA.md
    §8.2's float32 scores from the same bf16 operands, but their sums of the 128 exact products
    run in different orders (tensor-core tiles, MLX's GEMM). Where two blocks lie within a
    rounding of each other at the K-th place, either may go first. The float64 scores come from
    the call's own operands (`a.index_q`, `a.pooled`). Any other difference fails: a wrong
    block, a partial block, or another format of the same tokens. (The near-ties seen were 0.4
    to 1.5 ulps apart. At the real geometry after 16K the 512th and 513th scores of a row lie
    a median 4900 ulps apart, 1st percentile 70, over 128 rows sampled.)"""
    ra, rb = selection_rows(a.seen.sel), selection_rows(b.seen.sel)
    assert ra.keys() == rb.keys(), f"S{a.S}@{a.P}: formats {sorted(ra)} / {sorted(rb)}"
    for k in ra:
        assert ra[k].shape == rb[k].shape, f"S{a.S}@{a.P} {k}: {ra[k].shape} / {rb[k].shape}"
    differ = sorted({int(i) for k in ra for i in np.nonzero((ra[k] != rb[k]).any(axis=1))[0]})
    if not differ:
        return []
    ta, tb = attended(a.seen), attended(b.seen)
    adj = oracle.adjusted(oracle.block_scores(a.index_q, a.pooled, cfg))
    for i in differ:
        only_a, only_b = np.setdiff1d(ta[i], tb[i]), np.setdiff1d(tb[i], ta[i])
        where = f"S{a.S}@{a.P} row {i}"
        assert len(only_a) and len(only_b), f"{where}: the same tokens in another format"
        ba, bb = np.unique(only_a // R), np.unique(only_b // R)
        assert len(only_a) == R * len(ba) and len(only_b) == R * len(bb), f"{where}: part blocks"
        assert len(ba) == len(bb), f"{where}: {len(ba)} blocks against {len(bb)}"
        nb = (a.P + i + 1) // R
        row = adj[i, :nb]
        kth = np.sort(row)[::-1][min(cfg.block_topk, nb) - 1]
        ulp = float(np.spacing(np.float32(abs(kth))))
        far = [int(x) for x in np.concatenate([ba, bb]) if abs(row[x] - kth) > max_ulps * ulp]
        assert not far, f"{where}: blocks {far} differ, not within {max_ulps} ulps of the K-th"
    return differ


def assert_selection_format(s: Seen, ref: list[np.ndarray], cfg: QSAConfig) -> None:
    """The selection is exactly `ref` (blocks per row) in its RUNTIME §7 format."""
    sel, pos, K = s.sel, s.positions, cfg.block_topk
    if sel.kind in ("blocks", "prefill_blocks"):
        ids, valid, scores = np.array(sel.ids), np.array(sel.valid), np.array(sel.scores)
        assert ids.shape == valid.shape == scores.shape == (len(pos), K)
        for i, b in enumerate(ref):
            n = len(b)
            np.testing.assert_array_equal(ids[i, :n], b, err_msg=f"row {pos[i]} ids")
            assert (ids[i, n:] == 0).all() and valid[i, :n].all() and not valid[i, n:].any()
            assert np.isfinite(scores[i, :n]).all() and (scores[i, n:] == -np.inf).all()
        if sel.kind == "blocks":
            assert sel.tail_start == R * (s.T // R)
    elif sel.kind == "row_tokens":
        slots, valid = oracle.row_token_slots(ref, pos, cfg)
        np.testing.assert_array_equal(np.array(sel.slots), slots)
        np.testing.assert_array_equal(np.array(sel.slot_valid), valid)
    elif sel.kind == "token_list":
        np.testing.assert_array_equal(np.array(sel.slots), oracle.token_sets(ref, pos, cfg)[0])
    else:
        assert sel.kind == "dense_mask", sel.kind
        np.testing.assert_array_equal(
            np.array(sel.mask)[0, 0], oracle.dense_mask(ref, pos, s.T, cfg)
        )


# -- running a sequence of calls ----------------------------------------------------------


@dataclass
class Call:
    P: int
    S: int
    y: mx.array
    seen: Seen
    consumers: tuple[str, ...]
    mode: str | None
    compiled: bool
    history: np.ndarray  # hidden rows of tokens [0, P + S) at the time of the call
    index_q: np.ndarray | None  # the layer's index queries of the rows [S, H_I, d_I]
    pooled: np.ndarray | None  # the layer's block keys [0, nb) after the call


class Run:
    """Feeds rows to a layer and a cache, keeping the logical token history."""

    def __init__(self, layer: QSAAttention, spy: list[Seen], cache: QSACache | None = None):
        self.layer, self.spy = layer, spy
        self.cache = cache if cache is not None else layer.make_cache()
        self.history = np.zeros((self.cache.offset, layer.config.hidden_size))
        self.calls: list[Call] = []

    def feed(self, x: mx.array, vision: VisionState | None = None) -> Call:
        P, S = self.cache.offset, x.shape[1]
        n_seen = len(self.spy)
        y = self.layer(x, cache=self.cache, vision=vision)
        mx.eval(y, *self.cache.state)
        assert len(self.spy) == n_seen + 1
        self.history = np.concatenate([self.history[:P], as_f64(x[0])])
        info = self.layer.last_call
        c = self.cache
        call = Call(
            P, S, y, self.spy[-1], info.consumers, info.mode, info.compiled, self.history,
            layer_index_queries(self.layer, x, P) if self.layer.config.has_indexer else None,
            as_f64(c.pooled[0, : c.pooled_len]) if c.pooled is not None else None,
        )  # fmt: skip
        self.calls.append(call)
        return call

    def feed_widths(self, x: mx.array, widths: tuple[int, ...]) -> list[Call]:
        out, r0 = [], 0
        for S in widths:
            out.append(self.feed(x[:, r0 : r0 + S]))
            r0 += S
        return out

    def trim(self, n: int) -> None:
        assert self.cache.trim(n) == n
        self.history = self.history[: self.cache.offset]


def check_call(
    call: Call,
    cfg: QSAConfig,
    w: dict,
    dtype: mx.Dtype,
    positions: np.ndarray | None = None,
    sparse_vision: bool = False,
) -> None:
    """Selection exact, attended tokens as the routing says, output within tolerance.

    The oracle's own full forward (its float64 selection) is only needed in float32 and for
    sparse vision; bf16 calls take the oracle's q/k/v/gate and the layer's token sets.
    """
    T = call.P + call.S
    index_pos = positions if sparse_vision else None
    vision_dense = positions is not None and not sparse_vision
    ref = None
    if dtype == F32 or sparse_vision:
        ref = oracle.forward(
            w, cfg, call.history, call.P, positions, dense=vision_dense, index_positions=index_pos
        )
        q, k, v, gate = ref.q, ref.k, ref.v, ref.gate
    else:
        text = np.arange(T)
        attn_pos = text if positions is None or not cfg.has_mrope_axes else positions
        prep = oracle.prepare(w, cfg, oracle.project(w, cfg, call.history), attn_pos, text)
        q, gate, k, v = prep["q"][call.P :], prep["gate"][call.P :], prep["k"], prep["v"]
    qpos = np.arange(call.P, T)
    np.testing.assert_array_equal(call.seen.positions, qpos)
    tokens = attended(call.seen)
    dense = call.mode in (None, "update_only") or vision_dense
    if cfg.has_indexer and call.seen.sel.kind != "none":
        if sparse_vision:
            ref_blocks = ref.selected  # float32 only: no rounded states to feed
        else:
            ref_blocks = oracle.select_blocks(call.index_q, call.pooled, qpos, cfg)
        assert_selection_format(call.seen, ref_blocks, cfg)
        if dtype == F32:
            for a, b in zip(ref_blocks, ref.selected, strict=True):
                np.testing.assert_array_equal(a, b)
        if not dense:
            for t, e in zip(tokens, oracle.token_sets(ref_blocks, qpos, cfg), strict=True):
                np.testing.assert_array_equal(t, np.sort(e))
    if dense:
        for t, p in zip(tokens, qpos, strict=True):
            np.testing.assert_array_equal(t, np.arange(p + 1))
    o = oracle.sparse_attention(q, k, v, tokens, cfg)
    expected = oracle.gate_and_project(o, gate, w, cfg)
    err = rel_err(call.y[0], expected)
    assert err <= TOLERANCES[dtype], f"S{call.S}@{call.P} {call.consumers}: rel err {err:.3g}"
    if dtype == F32:  # float32 selections equal the oracle's: compare with its own output
        assert rel_err(call.y[0], ref.output) <= TOLERANCES[dtype]


def check_states(
    cache: QSACache, cfg: QSAConfig, w: dict, history: np.ndarray, dtype: mx.Dtype,
    positions: np.ndarray | None = None,
) -> None:  # fmt: skip
    """The cache's logical rows against the oracle's K, V, raw keys and block keys."""
    T = cache.offset
    assert history.shape[0] == T
    ref = oracle.forward(w, cfg, history, T - 1, positions)
    tol = TOLERANCES[dtype]
    assert rel_err(cache.keys[0, :, :T].transpose(1, 0, 2), ref.k) <= tol
    assert rel_err(cache.values[0, :, :T].transpose(1, 0, 2), ref.v) <= tol
    if cfg.has_indexer:
        assert cache.pooled_len == T // R
        assert rel_err(cache.raw_keys[0, :T], ref.index_k_raw) <= tol
        if T >= R:
            assert rel_err(cache.pooled[0, : T // R], ref.block_keys) <= tol
    else:
        assert cache.state_present == (False, False, False, True, True)
        assert cache.pooled_len == 0
    assert_mirror_invariant(cache)


def assert_mirror_invariant(cache: QSACache) -> None:
    """RUNTIME §2.3: the mirror, when present, is float32(pooled)ᵀ over the whole backing."""
    if cache.pooled_f32_t is not None:
        expect = cache.pooled.astype(F32).transpose(0, 2, 1)[None]
        assert mx.array_equal(cache.pooled_f32_t, expect)


def logical_states(cache: QSACache) -> dict[str, mx.array]:
    T, nb = cache.offset, cache.pooled_len
    out = {"keys": cache.keys[:, :, :T], "values": cache.values[:, :, :T]}
    if cache.raw_keys is not None:
        out["raw_keys"] = cache.raw_keys[:, :T]
    if nb:
        out["pooled"] = cache.pooled[:, :nb]
    return out


def assert_same_logical_states(a: QSACache, b: QSACache) -> None:
    assert (a.offset, a.pooled_len) == (b.offset, b.pooled_len)
    la, lb = logical_states(a), logical_states(b)
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k].dtype == lb[k].dtype, k
        assert mx.array_equal(la[k], lb[k]), f"{k} differs"


def tokens_equal(a: Seen, b: Seen) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(attended(a), attended(b), strict=True))


# -- small geometries: regimes, chunking, decode, verify ----------------------------------

SMALL = [
    pytest.param(mrope, dtype, id=f"{'mrope' if mrope else 'rope1d'}-{DTYPE_IDS[dtype]}")
    for mrope in (True, False)
    for dtype in (BF16, F32)
]


def test_selections_agree_only_at_near_ties(spy) -> None:
    """`assert_selections_agree`, the CUDA-against-portable selection check: equal selections
    pass; a row where the K-th and (K+1)-th blocks trade places passes only while their float64
    scores lie within `max_ulps` float32 ulps; a far block, or part of a block, fails."""
    from dataclasses import replace

    from mlx_qsa.indexer import Selection

    cfg = small_config(mrope=False)
    layer, _ = build(cfg, options=QSAOptions.trace(kernels="portable"))
    run = Run(layer, spy)
    run.feed_widths(hidden_rows(100, cfg.hidden_size), (40, 60))
    a = run.calls[-1]
    assert a.seen.sel.kind == "dense_mask"
    assert assert_selections_agree(a, a, cfg) == []
    K = cfg.block_topk
    adj = oracle.adjusted(oracle.block_scores(a.index_q, a.pooled, cfg))
    best = None  # the sparse row whose K-th and (K+1)-th scores lie closest (> 0 apart)
    for i in range(a.S):
        nb = (a.P + i + 1) // R
        order = np.lexsort((np.arange(nb), -adj[i, :nb]))
        gap = adj[i, order[K - 1]] - adj[i, order[K]]
        if nb > K and gap > 0 and (best is None or gap < best[1]):
            best = (i, gap, order)
    i, gap, order = best
    ulps = gap / float(np.spacing(np.float32(abs(adj[i, order[K - 1]]))))
    mask = np.array(a.seen.sel.mask)

    def with_row(drop: int, add: int, tokens: int = R) -> Call:
        m = mask.copy()
        m[0, 0, i, R * drop : R * drop + tokens] = False
        m[0, 0, i, R * add : R * add + R] = True
        return replace(a, seen=replace(a.seen, sel=Selection("dense_mask", mask=mx.array(m))))

    swapped = with_row(order[K - 1], order[K])
    assert assert_selections_agree(a, swapped, cfg, max_ulps=ulps + 1) == [i]
    with pytest.raises(AssertionError, match="not within"):
        assert_selections_agree(a, swapped, cfg, max_ulps=ulps / 2)
    far = with_row(order[K - 1], order[-1])  # the lowest-scored visible block
    with pytest.raises(AssertionError, match="not within"):
        assert_selections_agree(a, far, cfg, max_ulps=ulps + 1)
    with pytest.raises(AssertionError, match="part blocks"):
        assert_selections_agree(a, with_row(order[K - 1], order[K], tokens=1), cfg, ulps + 1)


@pytest.mark.parametrize("mrope, dtype", SMALL)
def test_dense_regime_then_first_sparse_token(spy, mrope, dtype):
    """p <= 18 is dense (nb <= K_b = 4); p = 19 is the first sparse query (QSA.md §8.3)."""
    cfg = small_config(mrope)
    layer, w = build(cfg, dtype)
    run = Run(layer, spy)
    x = hidden_rows(21, cfg.hidden_size, dtype, seed=101)
    prefill = run.feed(x[:, :18])
    decode_dense = run.feed(x[:, 18:19])
    first_sparse = run.feed(x[:, 19:20])
    second = run.feed(x[:, 20:21])
    assert prefill.mode == decode_dense.mode == "update_only"
    assert prefill.consumers == decode_dense.consumers == ("sdpa",)
    assert (prefill.seen.sdpa_mask, decode_dense.seen.sdpa_mask) == ("causal", "none")
    assert first_sparse.mode == second.mode == "blocks"
    assert first_sparse.consumers == ("flash",) and first_sparse.compiled
    for c in run.calls:
        check_call(c, cfg, w, dtype)
    # The first sparse query drops exactly one of its five complete blocks.
    assert len(attended(first_sparse.seen)[0]) == 4 * R
    check_states(run.cache, cfg, w, run.history, dtype)


@pytest.mark.parametrize("mrope, dtype", SMALL)
def test_chunked_prefill_matches_one_shot_and_oracle(spy, mrope, dtype):
    """Uneven chunks 5, 3, 17, 1, 9 = one 35-row prefill: states bit-identical."""
    cfg = small_config(mrope)
    layer, w = build(cfg, dtype)
    x = hidden_rows(35, cfg.hidden_size, dtype, seed=102)
    chunked = Run(layer, spy)
    chunked.feed_widths(x, (5, 3, 17, 1, 9))
    assert [c.consumers for c in chunked.calls] == [("sdpa",)] * 3 + [("flash",), ("sdpa",)]
    modes = ["update_only", "update_only", "dense_mask", "blocks", "dense_mask"]
    assert [c.mode for c in chunked.calls] == modes
    one_shot = Run(layer, spy)
    whole = one_shot.feed(x)
    assert whole.mode == "dense_mask" and not whole.compiled  # S >= 32: eager oracle path
    assert_same_logical_states(chunked.cache, one_shot.cache)
    for c in chunked.calls:
        check_call(c, cfg, w, dtype)
    check_call(whole, cfg, w, dtype)
    # Rows attend the same tokens whichever call computed them.
    rows_chunked = [t for c in chunked.calls for t in attended(c.seen)]
    for a, b in zip(rows_chunked, attended(whole.seen), strict=True):
        np.testing.assert_array_equal(a, b)
    y = mx.concatenate([c.y for c in chunked.calls], axis=1)
    assert rel_err(y[0], as_f64(whole.y[0])) <= TOLERANCES[dtype]
    check_states(chunked.cache, cfg, w, chunked.history, dtype)


@pytest.mark.parametrize("mrope, dtype", SMALL)
def test_decode_steps_and_verifies(spy, mrope, dtype):
    """Decode steps (tail lengths 0-3) and 2..8-row verifies in the sparse regime."""
    cfg = small_config(mrope)
    layer, w = build(cfg, dtype)
    widths = (22, 1, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 1)
    x = hidden_rows(sum(widths), cfg.hidden_size, dtype, seed=103)
    run = Run(layer, spy)
    run.feed_widths(x, widths)
    assert run.calls[0].consumers == ("sdpa",) and run.calls[0].mode == "dense_mask"
    for c in run.calls[1:]:
        want = ("flash",) if c.S == 1 else ("rows_gather",)
        assert c.consumers == want and c.compiled, (c.S, c.P)
    for c in run.calls:
        check_call(c, cfg, w, dtype)
    check_states(run.cache, cfg, w, run.history, dtype)


def test_budget_32_first_sparse_token(spy):
    """Budget 32 (K_b = 8): dense through p = 34, sparse from p = 35."""
    cfg = small_config(True, indexer_budget=32)
    layer, w = build(cfg, BF16)
    run = Run(layer, spy)
    x = hidden_rows(40, cfg.hidden_size, BF16, seed=104)
    calls = run.feed_widths(x, (34, 1, 1, 4))
    assert [c.mode for c in calls] == ["update_only", "update_only", "blocks", "row_tokens"]
    assert [c.consumers for c in calls] == [("sdpa",), ("sdpa",), ("flash",), ("rows_gather",)]
    for c in calls:
        check_call(c, cfg, w, BF16)


# -- every consumer -----------------------------------------------------------------------

SMALL_CONSUMERS = [
    # id, options changes, prefix rows, call rows, consumers, sdpa mask
    ("sdpa-no-mask", {}, 10, 1, ("sdpa",), "none"),
    ("sdpa-causal", {}, 6, 7, ("sdpa",), "causal"),
    ("sdpa-dense-mask", {}, 21, 9, ("sdpa",), "dense_mask"),
    ("sdpa-decode-dense-mask", {"flash": False}, 23, 1, ("sdpa",), "dense_mask"),
    (
        "sdpa-token-list",
        {"gather_decode": True, "fused": False, "compiled": False, "flash": False},
        25, 1, ("sdpa",), "token_list",
    ),
    ("flash", {}, 25, 1, ("flash",), ""),
    ("rows-gather", {}, 23, 5, ("rows_gather",), ""),
    ("rows-gather-eager-oracle", {"fused": False}, 23, 3, ("rows_gather",), ""),
    (
        "sdpa-dense-mask-tiled-oracle",
        {"fused": False, "tile_rows": 3}, 23, 7, ("sdpa",), "dense_mask",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "changes, prefix, rows, consumers, mask",
    [pytest.param(*c[1:], id=c[0]) for c in SMALL_CONSUMERS],
)
def test_small_consumer(spy, changes, prefix, rows, consumers, mask):
    cfg = small_config(True)
    layer, w = build(cfg, BF16, fused=0, options=QSAOptions.trace(**changes))
    x = hidden_rows(prefix + rows, cfg.hidden_size, BF16, seed=105)
    run = Run(layer, spy)
    run.feed(x[:, :prefix])
    call = run.feed(x[:, prefix:])
    assert call.consumers == consumers and call.seen.sdpa_mask == mask
    if mask == "token_list":
        assert layer.last_call.counts == {"decode_gather": 1}
    check_call(call, cfg, w, BF16)


def test_consumers_agree_on_one_selection(spy):
    """sdpa+mask, rows_gather and flash over the same selection give the same attention."""
    cfg = small_config(True)
    x = hidden_rows(24, cfg.hidden_size, BF16, seed=106)
    outs = {}
    for name, opts in (
        ("flash", QSAOptions.trace()),
        ("dense_mask", QSAOptions.trace(flash=False)),
        ("token_list", QSAOptions.trace(fused=False, flash=False, gather_decode=True)),
    ):
        layer, _ = build(cfg, BF16, fused=0, options=opts)
        run = Run(layer, spy)
        run.feed(x[:, :23])
        outs[name] = run.feed(x[:, 23:])
    ref = outs["flash"]
    for c in outs.values():
        assert tokens_equal(c.seen, ref.seen)
        assert rel_err(c.y[0], as_f64(ref.y[0])) <= TOLERANCES[BF16]


@pytest.mark.parametrize(
    "options, caps",
    [
        pytest.param(QSAOptions.trace(), None, id="compiled"),
        pytest.param(QSAOptions.trace(compiled=False), None, id="eager-legacy"),
        pytest.param(QSAOptions.trace(), Capabilities.portable(), id="portable-oracle"),
    ],
)
def test_exact_ties_go_to_lower_block_ids(spy, options, caps):
    """Identical block keys (rotary channels of k_layernorm zeroed, every token the same)
    give bit-equal positive scores; `adj` cannot separate them in float32, so the top-k
    must take the lowest ids (QSA.md §8.3)."""
    cfg = small_config(True, indexer_head_dim=32)
    w = synthetic_weights(cfg, BF16, seed=2)
    kn = np.array(w["indexer.k_layernorm.weight"].astype(F32))
    kn[: cfg.rotary_dim] = 0
    w["indexer.k_layernorm.weight"] = mx.array(kn).astype(BF16)
    layer = QSAAttention.from_hf(
        cfg.to_dict(), w, fused=0, options=options, zero_centered_norms=False, capabilities=caps
    )
    x = mx.broadcast_to(hidden_rows(1, cfg.hidden_size, BF16, seed=302), (1, 38, cfg.hidden_size))
    run = Run(layer, spy)
    run.feed_widths(x, (24, 1, 4, 9))
    for c in run.calls[1:]:
        for p, t in zip(c.seen.positions, attended(c.seen), strict=True):
            tail = np.arange(R * ((p + 1) // R), p + 1)
            np.testing.assert_array_equal(t, np.concatenate([np.arange(16), tail]))
        # The premise: bit-identical block keys and positive scores (zero scores would be
        # separated by the b·1e-12 adjustment instead).
        assert (c.pooled == c.pooled[0]).all()
        assert (oracle.block_scores(c.index_q, c.pooled, cfg) > 0.1).all()


# -- compiled vs eager, fusion levels -----------------------------------------------------

WIDTHS = (5, 3, 17, 1, 9, 1, 4, 2, 1)


def _run_widths(layer, spy, x, widths=WIDTHS) -> Run:
    run = Run(layer, spy)
    run.feed_widths(x, widths)
    return run


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
def test_compiled_and_eager_agree(spy, dtype):
    """compiled=False (legacy eager selector) and the portable profile (oracle scorer) give
    the selections and logical states of the compiled core, bit for bit."""
    cfg = small_config(True)
    x = hidden_rows(sum(WIDTHS), cfg.hidden_size, dtype, seed=107)
    compiled = _run_widths(build(cfg, dtype)[0], spy, x)
    eager = _run_widths(build(cfg, dtype, options=QSAOptions.trace(compiled=False))[0], spy, x)
    portable = _run_widths(build(cfg, dtype, caps=Capabilities.portable())[0], spy, x)
    assert any(c.compiled for c in compiled.calls)
    assert not any(c.compiled for c in eager.calls + portable.calls)
    for other in (eager, portable):
        assert_same_logical_states(compiled.cache, other.cache)
        for a, b in zip(compiled.calls, other.calls, strict=True):
            assert tokens_equal(a.seen, b.seen), (a.S, a.P)
    # Same consumers on the legacy eager path: identical outputs too.
    for a, b in zip(compiled.calls, eager.calls, strict=True):
        assert a.consumers == b.consumers
        assert mx.array_equal(a.y, b.y), (a.S, a.P)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
def test_fusion_levels_bit_identical(spy, dtype):
    """fused 0 / 3 / 4 from the same HF weights: identical K, V, raw, pooled and outputs."""
    cfg = small_config(True)
    x = hidden_rows(sum(WIDTHS), cfg.hidden_size, dtype, seed=108)
    runs = {}
    for fused in (0, 3, 4):
        layer, _ = build(cfg, dtype, fused=fused)
        assert layer.fused == fused
        runs[fused] = _run_widths(layer, spy, x)
    for fused in (3, 4):
        assert_same_logical_states(runs[0].cache, runs[fused].cache)
        for a, b in zip(runs[0].calls, runs[fused].calls, strict=True):
            assert a.consumers == b.consumers
            assert mx.array_equal(a.y, b.y), (fused, a.S, a.P)


# -- trims ---------------------------------------------------------------------------------

TRIMS = [
    # id, widths before, trim n, widths after (new tokens), fresh widths of the survivors
    ("trim6-block-boundary", (5, 3, 17, 1, 4), 6, (2, 1, 5), (5, 3, 16)),
    ("trim3-partial-block", (5, 3, 17, 1, 4), 3, (1, 4, 1), (27,)),
    ("trim1-in-tail", (23, 4), 1, (1, 1), (26,)),
    ("trim-back-to-dense", (22, 8), 13, (1, 7, 2), (17,)),
    ("trim0", (21, 3), 0, (4,), (24,)),
    ("trim-all", (9, 4), 13, (6, 1), ()),
]  # fmt: skip


@pytest.mark.parametrize("before, n, after, fresh", [pytest.param(*t[1:], id=t[0]) for t in TRIMS])
def test_trim_then_reappend_equals_fresh_build(spy, before, n, after, fresh):
    cfg = small_config(True)
    layer, w = build(cfg, BF16)
    xa = hidden_rows(sum(before), cfg.hidden_size, BF16, seed=109)
    xb = hidden_rows(sum(after), cfg.hidden_size, BF16, seed=110)
    run = _run_widths(layer, spy, xa, before)
    run.trim(n)
    keep = sum(before) - n
    assert run.cache.offset == keep and run.cache.pooled_len == keep // R
    regrown = run.feed_widths(xb, after)
    ref = _run_widths(build(cfg, BF16)[0], spy, xa[:, :keep], fresh)
    ref_calls = ref.feed_widths(xb, after)
    assert_same_logical_states(run.cache, ref.cache)
    for a, b in zip(regrown, ref_calls, strict=True):
        assert a.consumers == b.consumers and tokens_equal(a.seen, b.seen)
        assert mx.array_equal(a.y, b.y), (a.S, a.P)
        check_call(a, cfg, w, BF16)
    check_states(run.cache, cfg, w, run.history, BF16)


# -- layer variants -------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [0, 4], ids=["fused0", "fused4-forced-to-0"])
def test_no_indexer_layer_is_dense_gated_gqa(spy, fused):
    cfg = no_indexer(small_config(True))
    layer, w = build(cfg, BF16, fused=fused)
    assert layer.fused == 0 and not hasattr(layer, "indexer")
    run = _run_widths(layer, spy, hidden_rows(33, cfg.hidden_size, BF16, seed=111), (3, 1, 4, 25))
    for c in run.calls:
        assert c.consumers == ("sdpa",) and c.mode is None and not c.compiled
        check_call(c, cfg, w, BF16)
    check_states(run.cache, cfg, w, run.history, BF16)
    assert layer.core is None


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
def test_attention_bias_layer(spy, dtype):
    cfg = small_config(True, attention_bias=True)
    layer, w = build(cfg, dtype, fused=4)
    assert layer.fused == 0 and layer.q_proj.bias is not None
    run = _run_widths(layer, spy, hidden_rows(34, cfg.hidden_size, dtype, seed=112), (20, 1, 4, 9))
    assert [c.consumers[0] for c in run.calls] == ["sdpa", "flash", "rows_gather", "sdpa"]
    for c in run.calls:
        check_call(c, cfg, w, dtype)
    check_states(run.cache, cfg, w, run.history, dtype)


def test_zero_centred_norms_fold_on_load():
    """HF checkpoints store `w` of `(1 + w)`; from_hf folds it to the plain form."""
    cfg = small_config(True)
    plain = synthetic_weights(cfg, BF16, 7)
    hf = {k: (v.astype(F32) - 1).astype(BF16) if "norm" in k else v for k, v in plain.items()}
    a = QSAAttention.from_hf(cfg.to_dict(), hf, fused=0, zero_centered_norms=True)
    b = QSAAttention.from_hf(cfg.to_dict(), plain, fused=0, zero_centered_norms=False)
    x = hidden_rows(9, cfg.hidden_size, BF16, seed=113)
    ya, yb = a(x), b(x)
    assert rel_err(ya[0], as_f64(yb[0])) < 1e-2  # (v - 1) + 1 loses bf16 bits near 1
    assert mx.array_equal(a.k_norm.weight, (1 + hf["k_norm.weight"].astype(F32)).astype(BF16))


def test_from_hf_prefix_purity_and_bad_weights():
    cfg = small_config(True)
    w = synthetic_weights(cfg, BF16, 7)
    before = {k: mx.array(v) for k, v in w.items()}
    plain = QSAAttention.from_hf(cfg.to_dict(), w, fused=4)
    prefixed = QSAAttention.from_hf(cfg.to_dict(), {f"self_attn.{k}": v for k, v in w.items()}, 4)
    assert all(mx.array_equal(w[k], before[k]) for k in w)  # the input is not modified
    x = hidden_rows(6, cfg.hidden_size, BF16, seed=125)
    assert mx.array_equal(plain(x), prefixed(x))
    missing = {k: v for k, v in w.items() if k != "k_proj.weight"}
    with pytest.raises(ValueError, match=r"^weights: missing \['k_proj.weight'\]"):
        QSAAttention.from_hf(cfg.to_dict(), missing)
    with pytest.raises(ValueError, match=r"^weights\['q_proj.weight'\]: expected shape"):
        QSAAttention.from_hf(cfg.to_dict(), {**w, "q_proj.weight": w["q_proj.weight"][1:]})


# -- vision ---------------------------------------------------------------------------------


def vision_table(L: int = 64) -> VisionState:
    t = np.arange(L, dtype=np.int32)
    return VisionState(mx.array(np.stack([t, t // 8, t % 8])), 0)


@pytest.mark.parametrize("mrope", [True, False], ids=["table", "no-axes"])
def test_vision_state_gives_dense_causal_attention(spy, mrope):
    """With a vision state the indexer still runs on text positions, attention is dense
    causal; K differs from text only with MRoPE axes, raw/pooled/V never do (RUNTIME §1.3)."""
    cfg = small_config(mrope)
    layer, w = build(cfg, BF16)
    vision = vision_table()
    x = hidden_rows(33, cfg.hidden_size, BF16, seed=114)
    widths = (21, 1, 4, 7)
    text = _run_widths(layer, spy, x, widths)
    vis = Run(layer, spy)
    r0 = 0
    for S in widths:
        c = vis.feed(x[:, r0 : r0 + S], vision=vision)
        r0 += S
        assert c.consumers == ("sdpa",) and c.seen.sdpa_mask == ("none" if S == 1 else "causal")
        assert c.mode == text.calls[len(vis.calls) - 1].mode  # same indexer routing
    positions = np.array(vision.table[:, :33]) if mrope else None
    for c in vis.calls:
        check_call(c, cfg, w, BF16, positions=np.array(vision.table[:, : c.P + c.S]))
    check_states(vis.cache, cfg, w, vis.history, BF16, positions)
    lt, lv = logical_states(text.cache), logical_states(vis.cache)
    for k in ("raw_keys", "pooled", "values"):
        assert mx.array_equal(lt[k], lv[k]), k
    # Tokens 0..7 have T = H = W only for t = 0; with MRoPE axes every other K row differs.
    assert mx.array_equal(lt["keys"], lv["keys"]) != mrope
    if mrope:
        same_rows = mx.all(lt["keys"] == lv["keys"], axis=(0, 1, 3))
        assert np.array(same_rows).tolist() == [t == 0 for t in range(33)]


def test_vision_chunked_mrope_layout_reaches_the_keys(spy):
    """`mrope_interleaved=False` (chunked sections) is honoured, not replaced by interleaved:
    K follows the oracle at the chunked axes and differs from the interleaved layer's K."""
    vision = vision_table()
    x = hidden_rows(13, small_config(True).hidden_size, BF16, seed=140)
    keys = {}
    for interleaved in (True, False):
        cfg = small_config(True, mrope_interleaved=interleaved)
        layer, w = build(cfg, BF16)
        run = Run(layer, spy)
        for r0, S in ((0, 9), (9, 1), (10, 3)):
            run.feed(x[:, r0 : r0 + S], vision=vision)
        check_states(run.cache, cfg, w, run.history, BF16, np.array(vision.table[:, :13]))
        keys[interleaved] = logical_states(run.cache)["keys"]
    # Row t has (T, H, W) = (t, t // 8, t % 8): only row 0 has T = H = W, where both layouts
    # give the same angles; every other row differs in at least one pair.
    same_rows = np.array(mx.all(keys[True] == keys[False], axis=(0, 1, 3))).tolist()
    assert same_rows == [t == 0 for t in range(13)]


def test_vision_positions_past_the_table_use_delta(spy):
    """A call inside [0, L) reads the table (the boundary T = L included); a call that is
    not inside it uses position + delta on every axis (RUNTIME §1.3)."""
    cfg = small_config(True)
    layer, w = build(cfg, BF16)
    t = np.arange(20, dtype=np.int32)
    vision = VisionState(mx.array(np.stack([t, t // 8, t % 8])), 5)
    x = hidden_rows(25, cfg.hidden_size, BF16, seed=116)
    run = Run(layer, spy)
    for r0, S in ((0, 20), (20, 4), (24, 1)):
        run.feed(x[:, r0 : r0 + S], vision=vision)
    text = np.arange(25)
    positions = np.concatenate([np.stack([t, t // 8, t % 8]), np.stack([text[20:] + 5] * 3)], 1)
    for c in run.calls:
        check_call(c, cfg, w, BF16, positions=positions[:, : c.P + c.S])
    check_states(run.cache, cfg, w, run.history, BF16, positions)


def test_vision_sparse_block_keys_do_not_depend_on_the_path(spy):
    """Regression: with vision_sparse, the compiled staging window (which may reach past the
    table while the call does not) keyed block 0 at position + delta, the eager path at the
    table's column, so compiled and eager pooled keys differed. Each block now takes its
    first token's own position."""
    cfg = small_config(True)
    t = np.arange(6, dtype=np.int32)
    vision = VisionState(mx.array(np.stack([t, t // 2, t % 2])), 3)
    x = hidden_rows(12, cfg.hidden_size, BF16, seed=117)
    runs = []
    for compiled in (True, False):
        layer, w = build(cfg, BF16, options=QSAOptions(vision_sparse=True, compiled=compiled))
        run = Run(layer, spy)
        for r0, S in ((0, 5), (5, 1), (6, 6)):
            run.feed(x[:, r0 : r0 + S], vision=vision)
        runs.append(run)
    assert runs[0].calls[0].compiled and not runs[1].calls[0].compiled
    assert_same_logical_states(runs[0].cache, runs[1].cache)
    text = np.arange(12)
    first = np.concatenate([np.stack([t, t // 2, t % 2]), np.stack([text[6:] + 3] * 3)], 1)
    ref = oracle.forward(w, cfg, runs[0].history, 11, first, index_positions=first)
    assert rel_err(runs[0].cache.pooled[0, :3], ref.block_keys) <= TOLERANCES[BF16]
    assert rel_err(runs[0].cache.keys[0, :, :12].transpose(1, 0, 2), ref.k) <= TOLERANCES[BF16]


def test_vision_sparse_opt_in_is_hf_exact(spy):
    """vision_sparse=True: MRoPE positions in the indexer, selection consumed (float32)."""
    cfg = small_config(True)
    layer, w = build(cfg, F32, options=QSAOptions.trace(vision_sparse=True))
    vision = vision_table()
    x = hidden_rows(35, cfg.hidden_size, F32, seed=115)
    run = Run(layer, spy)
    r0 = 0
    for S in (21, 1, 4, 9):
        run.feed(x[:, r0 : r0 + S], vision=vision)
        r0 += S
    assert [c.consumers for c in run.calls] == [("sdpa",), ("flash",), ("rows_gather",), ("sdpa",)]
    assert [c.seen.sdpa_mask for c in run.calls] == ["dense_mask", "", "", "dense_mask"]
    for c in run.calls:
        table = np.array(vision.table[:, : c.P + c.S])
        check_call(c, cfg, w, F32, positions=table, sparse_vision=True)


# -- errors ---------------------------------------------------------------------------------


def snapshot(cache: QSACache) -> tuple:
    return (cache.offset, cache.pooled_len, cache.state_present, tuple(cache.state))


def assert_unchanged(cache: QSACache, snap: tuple) -> None:
    offset, pooled_len, present, arrays = snap
    assert (cache.offset, cache.pooled_len, cache.state_present) == (offset, pooled_len, present)
    for a, b in zip(cache.state, arrays, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b)


@pytest.fixture(scope="module")
def warm_layer():
    """A small bf16 layer with a 23-token cache (sparse regime)."""
    cfg = small_config(True, max_position_embeddings=30)
    layer, _ = build(cfg, BF16)
    cache = layer.make_cache()
    layer(hidden_rows(23, cfg.hidden_size, BF16, seed=116), cache=cache)
    mx.eval(*cache.state)
    return layer, cache


BAD_X = [
    ("x-2d", lambda D: mx.zeros((3, D), BF16), "^x: expected shape"),
    ("x-batch-2", lambda D: mx.zeros((2, 3, D), BF16), "^x: expected shape"),
    ("x-width", lambda D: mx.zeros((1, 3, D + 1), BF16), "^x: expected shape"),
    ("x-zero-rows", lambda D: mx.zeros((1, 0, D), BF16), "^x: expected shape"),
    ("x-int32", lambda D: mx.zeros((1, 3, D), mx.int32), "^x: expected dtype"),
    ("x-bool", lambda D: mx.zeros((1, 3, D), mx.bool_), "^x: expected dtype"),
    ("x-numpy", lambda D: np.zeros((1, 3, D), np.float32), "^x: expected an mx.array"),
    ("x-float32-into-bf16-cache", lambda D: mx.zeros((1, 3, D), F32), "^x: dtype .*cache"),
    ("positions-past-max", lambda D: mx.zeros((1, 8, D), BF16), "^x: .*max_position_embeddings"),
]


@pytest.mark.parametrize("make_x, name", [pytest.param(*b[1:], id=b[0]) for b in BAD_X])
@pytest.mark.parametrize("entry", ["call", "prefill_state"])
def test_bad_input_raises_and_leaves_cache_unchanged(warm_layer, make_x, name, entry):
    layer, cache = warm_layer
    snap = snapshot(cache)
    x = make_x(layer.config.hidden_size)
    fn = layer.prefill_state if entry == "prefill_state" else layer.__call__
    with pytest.raises(ValueError, match=name):
        fn(x, cache)
    assert_unchanged(cache, snap)


def test_positions_up_to_the_limit_are_accepted(warm_layer):
    layer, cache = warm_layer
    c = QSACache.from_state(cache.state, cache.meta_state)
    layer(hidden_rows(7, layer.config.hidden_size, BF16, seed=117), cache=c)
    assert c.offset == 30 == layer.config.max_position_embeddings


@pytest.fixture(scope="module")
def other_caches() -> list:
    """Caches made for other geometries, by make_cache and restored from a saved state."""
    out = []
    for cfg in (
        small_config(True, head_dim=64, partial_rotary_factor=0.25),
        small_config(True, indexer_head_dim=32),
        no_indexer(small_config(True)),
    ):
        other, _ = build(cfg, BF16)
        c = other.make_cache()
        other(hidden_rows(9, cfg.hidden_size, BF16, seed=118), cache=c)
        out += [c, QSACache.from_state(c.state, c.meta_state)]
    return out


@pytest.mark.parametrize(
    "index",
    range(6),
    ids=[
        f"{g}-{how}"
        for g in ("head-dim", "index-dim", "no-indexer")
        for how in ("made", "restored")
    ],
)
def test_cache_of_another_geometry_is_rejected(warm_layer, other_caches, index):
    """Regression: a cache restored with `from_state` has no signature, and a mismatched
    one used to fail deep inside sdpa (or index silently) instead of naming `cache`."""
    layer, _ = warm_layer
    cache = other_caches[index]
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="cache"):
        layer(hidden_rows(2, layer.config.hidden_size, BF16, seed=119), cache=cache)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize(
    "vision",
    [mx.zeros((3, 64), mx.int32), (mx.zeros((3, 64), mx.int32), 0), "table"],
    ids=["bare-array", "tuple", "string"],
)
def test_vision_must_be_a_vision_state(warm_layer, vision):
    layer, cache = warm_layer
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="vision"):
        layer(hidden_rows(1, layer.config.hidden_size, BF16, seed=120), cache=cache, vision=vision)
    assert_unchanged(cache, snap)


def test_cache_must_be_a_qsa_cache(warm_layer):
    layer, _ = warm_layer
    with pytest.raises(ValueError, match="cache"):
        layer(hidden_rows(1, layer.config.hidden_size, BF16, seed=121), cache={"offset": 0})


@pytest.mark.parametrize(
    "table",
    [np.zeros((2, 8), np.int32), np.zeros((3, 8), np.float32), np.zeros(8, np.int32)],
    ids=["two-axes", "float", "1d"],
)
def test_vision_state_validates_its_table(table):
    with pytest.raises(ValueError, match="VisionState.table"):
        VisionState(mx.array(table), 0)


# -- long context: the selector in several chunks --------------------------------------------


@pytest.fixture(scope="module")
def long_prefix():
    """A small-geometry layer's states after 32768 tokens (state-only prefill)."""
    cfg = small_config(True)
    x = hidden_rows(34816, cfg.hidden_size, BF16, seed=210)
    layer, w = build(cfg, BF16)
    cache = layer.make_cache()
    layer.prefill_state(x[:, :32768], cache)
    mx.eval(*cache.state)
    return cfg, w, x, cache.state, cache.meta_state


@pytest.mark.parametrize("rows, compiled", [(2048, True), (2047, False)], ids=["compiled", "eager"])
def test_long_context_prefill_blocks_in_chunks(spy, long_prefix, rows, compiled):
    """2048 rows at 32768 (compiled, 6 selector chunks of 384) and 2047 rows (eager large
    selector, chunked the same way) select exactly what the oracle selects on their states."""
    cfg, w, x, state, meta = long_prefix
    layer, _ = build(cfg, BF16)
    run = Run(layer, spy, QSACache.from_state(state, meta))
    run.history = as_f64(x[0, :32768])
    c = run.feed(x[:, 32768 : 32768 + rows])
    assert (c.compiled, c.mode) == (compiled, "prefill_blocks")
    assert c.consumers == ("prefill_gather", "rows_gather")
    if compiled:
        key = layer.core.receipt.to_dict()["compiled_keys"][-1]
        assert (key["selector_chunk_rows"], key["prefill_score_producer"]) == (384, "mlx")
    check_call(c, cfg, w, BF16)


# -- trace geometry: hidden 64, 24 × 256 heads, budget 2048 --------------------------------

TRACE_ROWS = 2090


@pytest.fixture(scope="module")
def trace_world():
    """Weights, hidden rows, prefix states (2048 and 2051 tokens) at the trace geometry."""
    cfg = QSAConfig(hidden_size=64)
    w = synthetic_weights(cfg, BF16, 7)
    w64 = {k: as_f64(v) for k, v in w.items()}
    x = hidden_rows(TRACE_ROWS, 64, BF16, seed=200)
    prefixes = {}
    for n in (2048, 2051):
        layer = QSAAttention.from_hf(cfg.to_dict(), w, fused=0, zero_centered_norms=False)
        c = layer.make_cache()
        layer.prefill_state(x[:, :n], c)
        mx.eval(*c.state)
        prefixes[n] = (c.state, c.meta_state)
    return cfg, w, w64, x, prefixes


def trace_run(world, spy, prefix: int, fused: int, options: QSAOptions) -> Run:
    cfg, w, _, x, prefixes = world
    layer = QSAAttention.from_hf(
        cfg.to_dict(), w, fused=fused, options=options, zero_centered_norms=False
    )
    run = Run(layer, spy, QSACache.from_state(*prefixes[prefix]))
    run.history = as_f64(x[0, :prefix])
    return run


def test_trace_prefix_states_one_shot_equal_fused_levels(trace_world):
    """prefill_state of 2051 rows: identical states at fused 0/3/4; pooled_len 512."""
    cfg, w, _, x, prefixes = trace_world
    ref = QSACache.from_state(*prefixes[2051])
    assert (ref.offset, ref.pooled_len) == (2051, 512)
    assert [ref.capacity(n) for n in ("raw_keys", "pooled", "pooled_f32_t", "keys")] == [
        2304, 512, 512, 2304,
    ]  # fmt: skip
    for fused in (3, 4):
        layer = QSAAttention.from_hf(cfg.to_dict(), w, fused=fused, zero_centered_norms=False)
        c = layer.make_cache()
        layer.prefill_state(x[:, :2051], c)
        assert all(mx.array_equal(a, b) for a, b in zip(c.state, ref.state, strict=True))


def test_trace_dense_first_sparse_verify_trim_prefill_flash(spy, trace_world):
    """Profile-2-like run: 1@2048 and 2@2049 dense, 1@2051 first sparse (flash),
    4@2052 rows_gather, trim 2, 33@2054 prefill_flash; all against the oracle."""
    cfg, _, w64, x, _ = trace_world
    run = trace_run(trace_world, spy, 2048, 4, QSAOptions.trace(flash_min=2049))
    plan = [(1, ("sdpa",), "update_only"), (2, ("sdpa",), "update_only"),
            (1, ("flash",), "blocks"), (4, ("rows_gather",), "row_tokens")]  # fmt: skip
    for S, consumers, mode in plan:
        P = run.cache.offset
        c = run.feed(x[:, P : P + S])
        assert (c.consumers, c.mode) == (consumers, mode), (S, P)
    run.trim(2)
    c = run.feed(x[:, 2054:2087])
    assert c.consumers == ("prefill_flash",) and not c.compiled
    assert layer_counts(run) == {"metal_selector": 1, "flash_kernel": 1}
    for c in run.calls:
        check_call(c, cfg, w64, BF16)
    assert run.cache.offset == 2087 and run.cache.pooled_len == 521


def layer_counts(run: Run) -> dict:
    return run.layer.last_call.counts


@pytest.mark.parametrize(
    "fused, options, consumers, counts",
    [
        pytest.param(
            0, QSAOptions.trace(), ("prefill_gather", "rows_gather"),
            {"metal_selector": 1, "gather_tier": 1}, id="prefill_gather",
        ),
        pytest.param(
            3, QSAOptions.trace(prefill_gather=False), ("dense_mask", "sdpa"),
            {"metal_selector": 1, "dense_fallback": 1}, id="dense_mask",
        ),
        pytest.param(
            4, QSAOptions.trace(flash_min=2049), ("prefill_flash",),
            {"metal_selector": 1, "flash_kernel": 1}, id="prefill_flash",
        ),
    ],
)  # fmt: skip
def test_trace_large_prefill_consumers(spy, trace_world, fused, options, consumers, counts):
    """33@2051 (S >= 32, T >= 2049, nb > 512): prefill blocks to each large consumer."""
    cfg, _, w64, x, _ = trace_world
    run = trace_run(trace_world, spy, 2051, fused, options)
    c = run.feed(x[:, 2051:2084])
    assert c.consumers == consumers and c.mode == "prefill_blocks"
    assert layer_counts(run) == counts
    check_call(c, cfg, w64, BF16)
    # Sparse rows really dropped blocks: row p sees 4·512 + (p + 1) % 4 tokens.
    assert [len(t) for t in attended(c.seen)] == [2048 + (p + 1) % 4 for p in range(2051, 2084)]


@pytest.mark.parametrize("rows", [1, 4])
def test_decode_step_memory_does_not_grow_with_the_context(rows):
    """A decode / verify step updates K/V in place and gathers only its selected rows: its
    transient memory barely changes from a 16K to a 64K context (a gather from a view of the
    backing once copied the whole cache every step, making decode linear in the context)."""
    from mlx_qsa.bench import layer_rows, random_cache

    cfg = QSAConfig()
    layer = QSAAttention(cfg, fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    x = layer_rows(cfg, rows, seed=4)
    transient, kv_bytes = [], []
    for T in (16384, 65536):
        cache = random_cache(layer, T, rows, seed=3)
        mx.eval(layer(x, cache=cache))  # first call at this shape: compiles
        cache.trim(rows)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = layer(x, cache=cache)
        mx.eval(y, cache.keys, cache.values)
        transient.append(mx.get_peak_memory() - base)
        kv_bytes.append(cache.keys.nbytes + cache.values.nbytes)
        assert layer.last_call.consumers[0] == ("flash" if rows == 1 else "rows_gather")
        del cache, y
    # the portable scorer's float32 block keys grow (8 bytes per token); K/V (2 KiB) must not
    grew, kv_grew = transient[1] - transient[0], kv_bytes[1] - kv_bytes[0]
    assert grew < 0.1 * kv_grew, (transient, kv_bytes)


@pytest.mark.parametrize("compiled", [True, False])
def test_state_writes_scale_with_the_rows_not_the_backing(compiled):
    """Every state write of a decode step (K, V, raw keys, pooled keys) is a scatter of its own
    rows: no dynamic `slice_update`, whose CUDA kernel in MLX 0.32 runs one thread per element
    of the whole backing (0.5 ms per K/V write at 128K on an H200); the step's rows change and
    every other row keeps its bits."""
    from mlx_qsa.bench import layer_rows, primitive_counts, random_cache

    cfg = QSAConfig()
    layer = QSAAttention(cfg, options=QSAOptions(compiled=compiled), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    rows = 4  # P = T - 4 = 4092: the step completes block 1023 (pooled write)
    cache = random_cache(layer, 4096, rows, seed=7)
    x = layer_rows(cfg, rows, seed=8)
    before = {n: np.array(getattr(cache, n).astype(mx.float32)) for n in ("keys", "raw_keys")}
    y = layer(x, cache=cache)
    kinds = primitive_counts(y, *cache.state)["by_kind"]
    assert "DynamicSliceUpdate" not in kinds and "SliceUpdate" not in kinds, kinds
    assert kinds.get("ScatterAxis", 0) >= 4, kinds
    mx.eval(y, *cache.state)
    assert layer.last_call.compiled == compiled
    P = 4096 - rows
    for name, axis in (("keys", 2), ("raw_keys", 1)):
        after = np.array(getattr(cache, name).astype(mx.float32))
        old = before[name]
        kept = np.delete(after, np.s_[P:], axis=axis)
        assert np.array_equal(kept, np.delete(old, np.s_[P:], axis=axis)), name
        assert not np.array_equal(np.take(after, range(P, P + rows), axis=axis),
                                  np.take(old, range(P, P + rows), axis=axis)), name  # fmt: skip


@pytest.mark.parametrize("rows", [1, 4])
def test_warm_decode_call_does_not_synchronise(rows, monkeypatch):
    """Once warm, a decode / verify call only builds the graph: no `mx.eval` inside the layer
    (each one is a host-device round trip that stalls a pipelined engine)."""
    from mlx_qsa.bench import layer_rows, random_cache

    cfg = QSAConfig()
    layer = QSAAttention(cfg, fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    cache = random_cache(layer, 4096, rows, seed=5)
    x = layer_rows(cfg, rows, seed=6)
    for _ in range(2):
        mx.eval(layer(x, cache=cache))
        cache.trim(rows)
    calls = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (calls.append(1), real_eval(*a, **k))[1])
    y = layer(x, cache=cache)
    monkeypatch.undo()
    assert calls == []
    assert y.shape == (1, rows, cfg.hidden_size)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_compiled_qk_prep_is_bit_identical_to_eager(dtype, rows):
    """Decode / verify widths run the q/k RMSNorm + RoPE through mx.compile; it must give the
    eager routine's bits (no FMA contraction, same casts) on fresh random inputs."""
    from mlx_qsa.layer import _qk_prep
    from mlx_qsa.rope import rope_tables

    cfg = QSAConfig()
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k1, k2, k3, k4 = mx.random.split(mx.random.key(rows), 4)
    q_lin = (3 * mx.random.normal((1, rows, H * 2 * d), key=k1)).astype(dtype)
    k_lin = (3 * mx.random.normal((1, rows, Hkv * d), key=k2)).astype(dtype)
    q_w = (1 + 0.5 * mx.random.normal((d,), key=k3)).astype(dtype)
    k_w = (1 + 0.5 * mx.random.normal((d,), key=k4)).astype(dtype)
    cos, sin = rope_tables(mx.arange(70_000, 70_000 + rows, dtype=mx.int32), cfg)
    args = (q_lin, k_lin, q_w, k_w, cos, sin)
    eager = _qk_prep(H, Hkv, d, cfg.rotary_dim, cfg.rms_norm_eps, False)(*args)
    compiled = _qk_prep(H, Hkv, d, cfg.rotary_dim, cfg.rms_norm_eps, True)(*args)
    for e, c in zip(eager, compiled, strict=True):
        assert e.shape == c.shape and e.dtype == c.dtype == dtype
        assert mx.array_equal(e, c).item()
        assert np.array_equal(
            np.array(e.view(mx.uint16 if dtype != mx.float32 else mx.uint32)),
            np.array(c.view(mx.uint16 if dtype != mx.float32 else mx.uint32)),
        )
    k_only = _qk_prep(H, Hkv, d, cfg.rotary_dim, cfg.rms_norm_eps, True)(
        None, k_lin, None, k_w, cos, sin
    )
    assert mx.array_equal(k_only[0], eager[1]).item()


def test_layers_at_one_step_share_the_rope_tables():
    """A model's QSA layers at one step use one set of text RoPE tables (rows and staging
    window): a later layer's graph holds fewer primitives, and its output and states are bit
    for bit those it gives when it makes its own tables."""
    from mlx_qsa.bench import layer_rows, primitive_counts, random_cache
    from mlx_qsa.rope import rope_window, text_rope

    cfg = QSAConfig()
    layers = []
    for seed in (1, 2):
        mx.random.seed(seed)
        layer = QSAAttention(cfg, fused=4)
        layer.set_dtype(mx.bfloat16)
        mx.eval(layer.parameters())
        layers.append(layer)
    a, b = layers
    x = layer_rows(cfg, 1, seed=3)

    def step_b(after_a: bool):
        text_rope.cache_clear()
        rope_window.cache_clear()  # the step's first layer makes the tables too
        if after_a:
            a(x, cache=random_cache(a, 4096, 1, seed=4))  # the step's first layer, unevaluated
        cache = random_cache(b, 4096, 1, seed=5)
        y = b(x, cache=cache)
        n = primitive_counts(y, *cache.state)["total"]
        mx.eval(y, *cache.state)
        return n, y, cache.state

    n_own, y_own, s_own = step_b(after_a=False)
    n_shared, y_shared, s_shared = step_b(after_a=True)
    assert n_shared <= n_own - 10, (n_own, n_shared)  # rows' and window's tables not remade
    assert np.array_equal(np.array(y_own.astype(mx.float32)), np.array(y_shared.astype(mx.float32)))
    for u, v in zip(s_own, s_shared, strict=True):
        assert np.array_equal(np.array(u.astype(mx.float32)), np.array(v.astype(mx.float32)))
