"""Reliability (issue 8): property tests over random geometries and call schedules, a long
decode soak, no state lost on any error, and run-to-run / process-to-process determinism.

Knobs (environment):
- `QSA_PROPERTY_EXAMPLES` (default 25): examples per property test; `QSA_PROPERTY_RANDOM=1`
  draws fresh random examples instead of the fixed (derandomized) CI sequence.
- `QSA_SOAK_STEPS` (default 300): decode steps of the soak; the full form is 10000.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    TOLERANCES,
    as_f64,
    build,
    hidden_rows,
    layer_index_queries,
    rel_err,
    small_config,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mlx_qsa.consumers as consumers_mod
import mlx_qsa.core as core_mod
import mlx_qsa.layer as layer_mod
from mlx_qsa import oracle
from mlx_qsa.cache import QSACache
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.indexer import Selection
from mlx_qsa.layer import QSAAttention, VisionState
from mlx_qsa.plan import Capabilities

BF16, F32 = mx.bfloat16, mx.float32
EXAMPLES = int(os.environ.get("QSA_PROPERTY_EXAMPLES", "25"))
SOAK_STEPS = int(os.environ.get("QSA_SOAK_STEPS", "300"))
# CI runs one fixed example sequence (reproducible failures); the env var opts into fresh draws.
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("QSA_PROPERTY_RANDOM", "") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)


# -- layers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    ratio: int
    block_topk: int
    index_heads: int
    fused: int
    dtype: mx.Dtype

    @property
    def config(self) -> QSAConfig:
        # Tiny hidden / head sizes keep one call at a few ms; budget = K_b · r in [8, 64].
        return small_config(
            False,
            indexer_n_heads=self.index_heads,
            indexer_budget=self.block_topk * self.ratio,
            indexer_compress_ratio=self.ratio,
        )


@st.composite
def geometries(draw: st.DrawFn) -> Geometry:
    r = draw(st.integers(2, 8))
    # Budgets 8..64 tokens; K_b capped at 8 so the sparse regime starts within ~70 tokens.
    k = draw(st.integers(max(1, -(-8 // r)), min(8, 64 // r)))
    return Geometry(
        r, k, draw(st.integers(1, 4)), draw(st.sampled_from((0, 3, 4))),
        draw(st.sampled_from((F32, BF16))),
    )  # fmt: skip


# -- observing selections -----------------------------------------------------------------


@dataclass
class Seen:
    """What one consumer dispatch received."""

    sel: Selection
    positions: np.ndarray
    T: int
    consumers: tuple[str, ...]


class Spy:
    """Records every consumer dispatch (no pytest fixture: hypothesis re-runs the body)."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._real = layer_mod.dispatch

    def __enter__(self) -> Spy:
        def recording(
            cplan, q, keys, values, sel, positions, T, ratio, scale, impl="portable", gate=None
        ):
            self.seen.append(Seen(sel, np.array(positions), T, cplan.consumers))
            return self._real(
                cplan, q, keys, values, sel, positions, T, ratio, scale, impl, gate=gate
            )

        self._patch = mock.patch.object(layer_mod, "dispatch", recording)
        self._patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.stop()


def decode_selection(s: Seen, cfg: QSAConfig) -> list[np.ndarray] | None:
    """Per row, the selected block ids read back from the selection's RUNTIME §7 format,
    asserting the format along the way: valid entries first in ascending id order, padding
    (id 0 / false / −inf / token 0) after them, and the row's whole visible tail present.
    None for a dense call (no selection)."""
    sel, pos, r, K = s.sel, s.positions, cfg.indexer_compress_ratio, cfg.block_topk
    S = len(pos)
    if sel.kind == "none":
        return None
    out: list[np.ndarray] = []
    if sel.kind in ("blocks", "prefill_blocks"):
        ids, valid, scores = np.array(sel.ids), np.array(sel.valid), np.array(sel.scores)
        assert ids.shape == valid.shape == scores.shape == (S, K)
        for i in range(S):
            n = int(valid[i].sum())
            assert valid[i, :n].all() and (ids[i, n:] == 0).all()
            assert np.isfinite(scores[i, :n]).all() and (scores[i, n:] == -np.inf).all()
            out.append(ids[i, :n])
        if sel.kind == "blocks":
            assert S == 1 and sel.tail_start == r * (s.T // r)
    elif sel.kind == "row_tokens":
        slots, valid = np.array(sel.slots), np.array(sel.slot_valid)
        assert slots.shape == valid.shape == (S, K * r + r)
        for i, p in enumerate(pos):
            groups, gvalid = slots[i, : K * r].reshape(K, r), valid[i, : K * r].reshape(K, r)
            n = int(gvalid[:, 0].sum())
            assert gvalid[:n].all() and not gvalid[n:].any()
            blocks = groups[:n, 0] // r
            np.testing.assert_array_equal(groups[:n], r * blocks[:, None] + np.arange(r))
            tail = r * ((p + 1) // r) + np.arange(r)
            np.testing.assert_array_equal(valid[i, K * r :], tail <= p)
            np.testing.assert_array_equal(slots[i, K * r :], np.where(tail <= p, tail, 0))
            assert (slots[i][~valid[i]] == 0).all()
            out.append(blocks)
    elif sel.kind == "token_list":
        toks, p = np.array(sel.slots), int(pos[0])
        tail_start = r * ((p + 1) // r)
        cut = len(toks) - (p + 1 - tail_start)
        body, tail = toks[:cut], toks[cut:]
        np.testing.assert_array_equal(tail, np.arange(tail_start, p + 1))
        groups = body.reshape(-1, r)
        np.testing.assert_array_equal(groups, groups[:, :1] + np.arange(r))
        assert (groups[:, 0] % r == 0).all()
        out.append(groups[:, 0] // r)
    else:
        assert sel.kind == "dense_mask", sel.kind
        mask = np.array(sel.mask)[0, 0]
        assert mask.shape == (S, s.T)
        for i, p in enumerate(pos):
            nb = (p + 1) // r
            assert not mask[i, p + 1 :].any() and mask[i, r * nb : p + 1].all()
            blk = mask[i, : r * nb].reshape(nb, r)
            assert (blk.all(axis=1) | ~blk.any(axis=1)).all(), "partial block in the mask"
            out.append(np.nonzero(blk[:, 0])[0])
    for b, p in zip(out, pos, strict=True):
        nb = (int(p) + 1) // r
        # Only complete visible blocks, at most the budget (exactly min(K_b, nb)), ascending.
        assert len(b) == min(K, nb), (p, b)
        assert (np.diff(b) > 0).all() and (b < nb).all() and (b >= 0).all(), (p, b)
    return out


def check_against_oracle(
    layer: QSAAttention, cache: QSACache, seen: Seen, blocks: list[np.ndarray] | None,
    x: mx.array, P: int, history: np.ndarray, w: dict, dtype: mx.Dtype,
) -> None:  # fmt: skip
    """The layer's selection equals the float64 oracle's: fed the layer's own (rounded) index
    queries and block keys, and in float32 also the oracle's own full forward."""
    cfg, r, K = layer.config, layer.config.indexer_compress_ratio, layer.config.block_topk
    qpos = np.arange(P, P + x.shape[1])
    np.testing.assert_array_equal(seen.positions, qpos)
    if blocks is None:  # dense == sparse: no row sees more than K_b complete blocks
        assert all((p + 1) // r <= K for p in qpos)
        return
    pooled = as_f64(cache.pooled[0, : cache.pooled_len])
    ref = oracle.select_blocks(layer_index_queries(layer, x, P), pooled, qpos, cfg)
    for p, a, b in zip(qpos, blocks, ref, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"row {p}")
    if dtype == F32:
        full = oracle.forward(w, cfg, history, P)
        for p, a, b in zip(qpos, blocks, full.selected, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"row {p} (full float64 forward)")


# -- cache views ---------------------------------------------------------------------------


def logical_states(cache: QSACache) -> dict[str, mx.array]:
    """The rows below the frontier: K, V, raw keys [0, offset), pooled keys [0, pooled_len)."""
    T, nb = cache.offset, cache.pooled_len
    out: dict[str, mx.array] = {}
    if cache.keys is not None:
        out["keys"], out["values"] = cache.keys[:, :, :T], cache.values[:, :, :T]
    if cache.raw_keys is not None and T:
        out["raw_keys"] = cache.raw_keys[:, :T]
    if nb:
        out["pooled"] = cache.pooled[:, :nb]
    return out


def assert_same_logical(a: QSACache, b: QSACache, what: str) -> None:
    assert (a.offset, a.pooled_len) == (b.offset, b.pooled_len), what
    la, lb = logical_states(a), logical_states(b)
    assert la.keys() == lb.keys(), what
    for k in la:
        assert la[k].dtype == lb[k].dtype and mx.array_equal(la[k], lb[k]), f"{what}: {k}"


@dataclass(frozen=True)
class Snapshot:
    """Everything a cache holds: each state array (bits), offset, pooled_len, meta_state."""

    offset: int
    pooled_len: int
    meta: tuple[str, ...]
    present: tuple[bool, ...]
    arrays: tuple[mx.array, ...]
    digests: tuple[str, ...]

    @classmethod
    def of(cls, c: QSACache) -> Snapshot:
        mx.eval(*c.state)
        return cls(
            c.offset, c.pooled_len, c.meta_state, c.state_present, tuple(c.state),
            tuple(digest(a) for a in c.state),
        )  # fmt: skip

    def assert_matches(self, c: QSACache) -> None:
        assert (c.offset, c.pooled_len, c.meta_state) == (self.offset, self.pooled_len, self.meta)
        assert c.state_present == self.present
        for a, b, d in zip(c.state, self.arrays, self.digests, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert mx.array_equal(a, b) and digest(a) == d


def digest(a: mx.array) -> str:
    """sha256 of an array's dtype, shape and raw bytes (bf16 read through a uint8 view)."""
    h = hashlib.sha256(f"{a.dtype}{list(a.shape)}".encode())
    if a.size:
        h.update(np.ascontiguousarray(np.array(a.reshape(-1).view(mx.uint8))).tobytes())
    return h.hexdigest()


# -- capacity model (RUNTIME §2.2, written from the spec, not from plan.py) ------------------


def roundup256(n: int) -> int:
    return -(-n // 256) * 256


def bucket(n: int) -> int:
    return 0 if n == 0 else max(256, 1 << max(0, (n - 1).bit_length()))


def expected_caps(
    before: dict[str, int], P: int, S: int, r: int, compiled: bool, pooled_len_before: int
) -> dict[str, int]:
    """raw / pooled / KV capacities after a call of S rows at P (mirror checked apart)."""
    T, nb, m = P + S, (P + S) // r, -(-S // r)
    cap = dict(before)
    if compiled:
        cap["raw_keys"] = bucket(max(before["raw_keys"], T, r * m))
        cap["pooled"] = bucket(max(1, nb, before["pooled"], m))
    else:
        if T > before["raw_keys"]:
            cap["raw_keys"] = max(roundup256(T), 2 * before["raw_keys"])
        if nb > pooled_len_before and nb > before["pooled"]:
            cap["pooled"] = max(roundup256(nb), 2 * before["pooled"])
    kv = before["keys"]
    if kv == 0:
        cap["keys"] = roundup256(S)
    elif T > kv:
        cap["keys"] = (P if P % 256 else kv) + roundup256(S)
    return cap


def caps_of(c: QSACache) -> dict[str, int]:
    return {n: c.capacity(n) for n in ("raw_keys", "pooled", "keys")}


def assert_cache_rules(c: QSACache, cfg: QSAConfig) -> None:
    """pooled_len == offset // r; the mirror, when present, is float32(pooled)ᵀ of the whole
    backing; every backing holds the logical rows; K and V share one capacity."""
    r = cfg.indexer_compress_ratio
    assert c.pooled_len == c.offset // r, (c.offset, c.pooled_len, r)
    if c.offset:
        assert c.capacity("keys") >= c.offset and c.capacity("raw_keys") >= c.offset
        assert c.capacity("values") == c.capacity("keys")
    if c.pooled_len:
        assert c.capacity("pooled") >= c.pooled_len
    if c.pooled_f32_t is not None:
        assert c.capacity("pooled_f32_t") == c.capacity("pooled")
        assert mx.array_equal(c.pooled_f32_t, c.pooled.astype(F32).transpose(0, 2, 1)[None])


# -- schedules ------------------------------------------------------------------------------

OPS = st.one_of(
    st.tuples(st.just("prefill"), st.integers(1, 40)),
    st.tuples(st.just("decode"), st.just(1)),
    st.tuples(st.just("verify"), st.integers(2, 8)),
    st.tuples(st.just("trim"), st.integers(1, 8)),
    st.tuples(st.just("state_only"), st.integers(1, 24)),
    st.tuples(st.just("save_restore"), st.just(0)),
)


@dataclass
class Lane:
    """One layer + cache fed a schedule, with the surviving token history (float64 rows)."""

    layer: QSAAttention
    cache: QSACache
    history: list[np.ndarray] = field(default_factory=list)


def run_op(
    lane: Lane, spy: Spy, op: str, n: int, x: mx.array, w: dict, dtype: mx.Dtype
) -> tuple[mx.array | None, list[np.ndarray] | None, bool]:
    """Apply one op; checks (a) and (c) on it. Returns (y, selected blocks, compiled)."""
    c, layer, cfg = lane.cache, lane.layer, lane.layer.config
    r = cfg.indexer_compress_ratio
    before, pl_before, P = caps_of(c), c.pooled_len, c.offset
    if op == "trim":
        arrays = tuple(c.state)
        k = min(n, c.offset)
        assert c.trim(k) == k
        del lane.history[c.offset :]
        assert all(a is b for a, b in zip(c.state, arrays, strict=True))  # no backing moves
        assert caps_of(c) == before and c.pooled_len == min(pl_before, c.offset // r)
        assert_cache_rules(c, cfg)
        return None, None, False
    if op == "save_restore":
        snap = Snapshot.of(c)
        lane.cache = QSACache.from_state(c.state, c.meta_state)
        snap.assert_matches(lane.cache)
        return None, None, False
    if op == "state_only":
        layer.prefill_state(x, c)
        mx.eval(*c.state)
        compiled, y, blocks = False, None, None
    else:
        n_seen = len(spy.seen)
        y = layer(x, cache=c)
        mx.eval(y, *c.state)
        assert len(spy.seen) == n_seen + 1
        compiled = layer.last_call.compiled
    lane.history.extend(as_f64(x[0]))
    assert c.offset == P + x.shape[1]
    assert caps_of(c) == expected_caps(before, P, x.shape[1], r, compiled, pl_before), (
        op, P, x.shape[1], compiled,
    )  # fmt: skip
    if compiled:
        assert c.pooled_f32_t is None  # the graph rewrote pooled wholesale (§2.3 c)
    elif c.pooled_len > pl_before:
        assert c.pooled_f32_t is not None  # eager block writes keep the mirror (§2.3 a)
    assert_cache_rules(c, cfg)
    if op != "state_only":
        seen = spy.seen[-1]
        blocks = decode_selection(seen, cfg)
        check_against_oracle(layer, c, seen, blocks, x, P, np.stack(lane.history), w, dtype)
    return y, blocks, compiled


@given(
    geo=geometries(),
    eager_kind=st.sampled_from(("legacy", "portable")),
    ops=st.lists(OPS, min_size=2, max_size=10),
    seed=st.integers(0, 2**16),
)
# Pinned cases besides the drawn ones: ratios 4 and 6, budget 64, rollbacks across block
# boundaries, restores between trims and verifies.
@example(
    geo=Geometry(4, 4, 4, 4, BF16),
    eager_kind="legacy",
    ops=[("decode", 1), ("trim", 3), ("verify", 5), ("save_restore", 0), ("trim", 8),
         ("decode", 1), ("verify", 8), ("trim", 2), ("state_only", 9), ("decode", 1)],
    seed=1,
)  # fmt: skip
@example(
    geo=Geometry(6, 2, 2, 3, F32),
    eager_kind="portable",
    ops=[("verify", 7), ("trim", 7), ("prefill", 33), ("trim", 1), ("save_restore", 0),
         ("decode", 1), ("decode", 1)],
    seed=2,
)  # fmt: skip
@example(
    geo=Geometry(8, 8, 1, 0, BF16),
    eager_kind="legacy",
    ops=[("prefill", 40), ("trim", 5), ("decode", 1), ("verify", 3), ("trim", 8),
         ("save_restore", 0), ("verify", 2)],
    seed=3,
)  # fmt: skip
@PROPERTY
def test_random_schedules_match_oracle_one_forward_and_eager(
    geo: Geometry, eager_kind: str, ops: list[tuple[str, int]], seed: int
) -> None:
    """(a) selections = the float64 oracle's, in the §7 format; (b) the cache after the
    schedule = one forward of the surviving tokens, bit for bit; (c) pooled_len = offset // r
    and the §2.2 capacities after every op; (d) compiled and eager agree bit for bit."""
    cfg, dtype = geo.config, geo.dtype
    layer_c, w = build(cfg, dtype, geo.fused)
    eager_opts = QSAOptions.trace(compiled=False) if eager_kind == "legacy" else None
    eager_caps = Capabilities.portable() if eager_kind == "portable" else None
    layer_e, _ = build(cfg, dtype, geo.fused, eager_opts, eager_caps)
    lanes = [Lane(layer_c, layer_c.make_cache()), Lane(layer_e, layer_e.make_cache())]
    # Make sure the sparse regime is reached: a prefill past the budget, then the schedule.
    ops = [("prefill", cfg.indexer_budget + 1 + seed % 8), *ops]
    rng = np.random.default_rng(seed)
    with Spy() as spy:
        for i, (op, n) in enumerate(ops):
            x = None
            if op in ("prefill", "decode", "verify", "state_only"):
                a = rng.standard_normal((1, n, cfg.hidden_size), np.float32)
                x = mx.array(a).astype(dtype)
            outs = [run_op(lane, spy, op, n, x, w, dtype) for lane in lanes]
            (yc, bc, cc), (ye, be, ce) = outs
            assert not ce
            # (d) the same selections and logical states on both paths ...
            assert (bc is None) == (be is None), (i, op)
            if bc is not None:
                for a, b in zip(bc, be, strict=True):
                    np.testing.assert_array_equal(a, b, err_msg=f"op {i} {op}")
            assert_same_logical(lanes[0].cache, lanes[1].cache, f"op {i} {op}")
            # ... and, where the same consumer ran, the same output bits.
            if yc is not None and spy.seen[-1].consumers == spy.seen[-2].consumers:
                assert mx.array_equal(yc, ye), (i, op)
    # (b) one forward of the surviving tokens gives the same cache rows, bit for bit.
    history = lanes[0].history
    assert len(history) == lanes[0].cache.offset
    if history:
        x = mx.array(np.stack(history)[None].astype(np.float32)).astype(dtype)
        for lane in lanes:
            fresh = lane.layer.make_cache()
            mx.eval(lane.layer(x, cache=fresh), *fresh.state)
            assert_same_logical(lane.cache, fresh, "one forward of the survivors")
            assert_cache_rules(fresh, cfg)


@pytest.mark.parametrize("ratio", [2, 3, 8])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_trim_keeps_pooled_len_at_offset_div_ratio(ratio, compiled):
    """Regression: trim used a fixed 4 (pooled_len = min(pooled_len, offset // 4)). At r = 8
    a trimmed block stayed 'complete', so the eager path never re-pooled it and kept a stale
    block key; at r = 2 pooled_len fell below offset // r."""
    cfg = small_config(False, indexer_budget=4 * ratio, indexer_compress_ratio=ratio)
    layer, _ = build(cfg, F32, 4, QSAOptions.trace(compiled=compiled))
    x = hidden_rows(6 * ratio, cfg.hidden_size, F32, seed=5)
    c = layer.make_cache()
    layer(x[:, : 2 * ratio], cache=c)
    c.trim(1)
    assert (c.offset, c.pooled_len) == (2 * ratio - 1, 1)
    restored = QSACache.from_state(c.state, c.meta_state)  # the ratio survives a save
    assert restored.ratio == ratio
    survivors = mx.concatenate([x[:, : 2 * ratio - 1], x[:, 5 * ratio : 5 * ratio + 1]], axis=1)
    for cache in (c, restored):
        layer(x[:, 5 * ratio : 5 * ratio + 1], cache=cache)
        ref = layer.make_cache()
        layer(survivors, cache=ref)
        assert_same_logical(cache, ref, f"r={ratio}")


# -- soak -------------------------------------------------------------------------------------

SOAK_PREFIX = 230  # decode then crosses KV 256 / 512 and raw buckets 512 / 1024 even in CI
SOAK_TRIM_EVERY = 200
SOAK_CHECK_EVERY = 100
SOAK_MEMORY_SLACK = 1 << 20  # bytes of transient arrays allowed beyond the cache's growth
# The bf16 tolerance is a relative Frobenius error over outputs; one 32-wide decode row is a
# noisy sample of it (a 10000-step run saw 1.04e-2 on one row), so each row gets twice it and
# the stacked checked rows must meet it.
SOAK_ROW_TOLERANCE = 2 * TOLERANCES[BF16]


def _soak_check(
    layer: QSAAttention, cache: QSACache, seen: Seen, x: mx.array, history: np.ndarray, w: dict
) -> np.ndarray:
    """One decode step against the oracle: the exact selection (on the layer's bf16 states);
    returns the oracle's output over the tokens the layer attended."""
    cfg, P = layer.config, cache.offset - 1
    blocks = decode_selection(seen, cfg)
    assert blocks is not None and seen.sel.kind == "blocks"
    check_against_oracle(layer, cache, seen, blocks, x, P, history, w, BF16)
    text = np.arange(P + 1)
    prep = oracle.prepare(w, cfg, oracle.project(w, cfg, history), text, text)
    tokens = oracle.token_sets(blocks, [P], cfg)
    o = oracle.sparse_attention(prep["q"][P:], prep["k"], prep["v"], tokens, cfg)
    expected = oracle.gate_and_project(o, prep["gate"][P:], w, cfg)
    return expected


def test_decode_soak() -> None:
    """SOAK_STEPS decode steps (budget 16, r 4) with a trim every 200 steps and an oracle
    check every 100: MLX's active memory grows only with the cache's own capacity, and the
    compiled core holds one entry per (mode, bucket) it met, never retracing."""
    cfg = small_config(False)
    layer, w = build(cfg, BF16, 4)
    cache = layer.make_cache()
    rng = np.random.default_rng(2026)

    def rows(n: int) -> mx.array:
        return mx.array(rng.standard_normal((1, n, cfg.hidden_size), np.float32)).astype(BF16)

    x0 = rows(SOAK_PREFIX)
    mx.eval(layer(x0, cache=cache), *cache.state)
    history = list(as_f64(x0[0]))
    kv_caps, compiled_keys, checks, trims = {cache.capacity("keys")}, set(), 0, 0
    checked_y: list[np.ndarray] = []
    checked_ref: list[np.ndarray] = []
    base_active = base_bytes = None
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with Spy() as spy:
        for step in range(1, SOAK_STEPS + 1):
            x = rows(1)
            y = layer(x, cache=cache)
            mx.eval(y, *cache.state)
            history.append(as_f64(x[0, 0]))
            seen = spy.seen.pop()  # keep no selection alive (it would count as a leak)
            info = layer.last_call
            assert info.compiled and info.consumers == ("flash",), (step, info)
            compiled_keys.add((info.mode, cache.capacity("raw_keys"), cache.capacity("pooled")))
            kv_caps.add(cache.capacity("keys"))
            assert cache.pooled_len == cache.offset // cfg.indexer_compress_ratio
            if step % SOAK_CHECK_EVERY == 0:
                expected = _soak_check(layer, cache, seen, x, np.stack(history), w)
                assert rel_err(y[0], expected) <= SOAK_ROW_TOLERANCE, step
                checked_y.append(as_f64(y[0]))
                checked_ref.append(expected)
                checks += 1
            if step % SOAK_TRIM_EVERY == SOAK_TRIM_EVERY // 2:
                n = 1 + (step // SOAK_TRIM_EVERY) % 8
                assert cache.trim(n) == n
                del history[cache.offset :]
                trims += 1
            del seen, y
            if step == 20:  # past the first compiles: the memory baseline
                base_active, base_bytes = mx.get_active_memory(), cache.nbytes
            elif base_active is not None and step % 50 == 0:
                grown = mx.get_active_memory() - base_active
                assert grown <= cache.nbytes - base_bytes + SOAK_MEMORY_SLACK, (step, grown)
    elapsed = time.perf_counter() - t0
    core = layer.core
    # No retrace per step: one trace per key, and a key only per (mode, capacity bucket).
    assert core.python_traces == core.entry_count == len(compiled_keys)
    assert core.entry_count <= 2 * (2 + (cache.offset // 256).bit_length())
    assert len(kv_caps) >= 1 + (SOAK_PREFIX + SOAK_STEPS) // 256 - 1  # many KV transitions
    assert cache.offset == SOAK_PREFIX + SOAK_STEPS - sum(
        1 + (s // SOAK_TRIM_EVERY) % 8
        for s in range(1, SOAK_STEPS + 1)
        if s % SOAK_TRIM_EVERY == SOAK_TRIM_EVERY // 2
    )
    assert checks == SOAK_STEPS // SOAK_CHECK_EVERY
    worst = max(rel_err(a, b) for a, b in zip(checked_y, checked_ref, strict=True))
    overall = rel_err(np.concatenate(checked_y), np.concatenate(checked_ref))
    assert overall <= TOLERANCES[BF16]
    print(
        f"\nsoak: {SOAK_STEPS} decode steps in {elapsed:.1f} s "
        f"({1e3 * elapsed / SOAK_STEPS:.2f} ms/step incl. {checks} oracle checks, {trims} "
        f"trims), final offset {cache.offset}, cache {cache.nbytes / 2**20:.2f} MiB, "
        f"peak memory {mx.get_peak_memory() / 2**20:.1f} MiB, active "
        f"{mx.get_active_memory() / 2**20:.1f} MiB, core entries {core.entry_count}, "
        f"KV capacities {len(kv_caps)}, capacity transitions "
        f"{core.receipt.capacity_transitions}, output rel err {overall:.2e} (worst row "
        f"{worst:.2e})"
    )


# -- errors lose nothing ----------------------------------------------------------------------

ERR_CFG = small_config(True, max_position_embeddings=300)
WARM_ROWS = 254  # a 4-row call from here grows KV (256 → 512) and the raw bucket


def warm(options: QSAOptions | None = None) -> tuple[QSAAttention, QSACache]:
    """A bf16 fused-4 layer and a cache of WARM_ROWS tokens (sparse regime, 5 states)."""
    layer, _ = build(ERR_CFG, BF16, 4, options)
    cache = layer.make_cache()
    layer(hidden_rows(WARM_ROWS - 1, ERR_CFG.hidden_size, BF16, seed=300), cache=cache)
    layer(hidden_rows(1, ERR_CFG.hidden_size, BF16, seed=301), cache=cache)
    mx.eval(*cache.state)
    return layer, cache


@pytest.fixture(scope="module")
def warm_state() -> tuple[tuple[mx.array, ...], tuple[str, ...]]:
    _, cache = warm()
    return tuple(cache.state), cache.meta_state


def fresh(warm_state, options: QSAOptions | None = None) -> tuple[QSAAttention, QSACache]:
    """A layer that has already compiled (so its core has entries) and a copy of the cache."""
    layer, _ = build(ERR_CFG, BF16, 4, options)
    scratch = layer.make_cache()
    layer(hidden_rows(1, ERR_CFG.hidden_size, BF16, seed=302), cache=scratch)
    return layer, QSACache.from_state(*warm_state)


def assert_next_call_matches_clean(
    layer: QSAAttention, cache: QSACache, warm_state, options: QSAOptions | None = None
) -> None:
    """After a rejected call the same cache continues exactly like one never touched."""
    x = hidden_rows(4, ERR_CFG.hidden_size, BF16, seed=303)
    y = layer(x, cache=cache)
    clean_layer, clean = fresh(warm_state, options)
    y_clean = clean_layer(x, cache=clean)
    mx.eval(y, y_clean)
    assert mx.array_equal(y, y_clean)
    Snapshot.of(clean).assert_matches(cache)


def _x(rows: int, dtype: mx.Dtype = BF16, width: int = ERR_CFG.hidden_size) -> mx.array:
    return mx.zeros((1, rows, width), dtype)


# (id, entry point, exception, message regex); each gets the layer and the cache.
BAD_INPUTS: list[tuple[str, Callable[[QSAAttention, QSACache], Any], str]] = [
    ("call-x-2d", lambda L, c: L(mx.zeros((3, 32), BF16), cache=c), "^x: expected shape"),
    ("call-x-batch-2", lambda L, c: L(mx.zeros((2, 3, 32), BF16), cache=c), "^x: expected shape"),
    ("call-x-width", lambda L, c: L(_x(3, width=33), cache=c), "^x: expected shape"),
    ("call-x-zero-rows", lambda L, c: L(_x(0), cache=c), "^x: expected shape"),
    ("call-x-int32", lambda L, c: L(_x(2, mx.int32), cache=c), "^x: expected dtype"),
    ("call-x-numpy", lambda L, c: L(np.zeros((1, 2, 32), np.float32), cache=c), "^x: expected"),
    ("call-x-dtype-vs-cache", lambda L, c: L(_x(2, F32), cache=c), "^x: dtype .*cache"),
    ("call-x-f16-vs-cache", lambda L, c: L(_x(2, mx.float16), cache=c), "^x: dtype .*cache"),
    ("call-position-past-max", lambda L, c: L(_x(47), cache=c), "max_position_embeddings"),
    ("call-vision-array", lambda L, c: L(_x(1), cache=c, vision=mx.zeros((3, 9), mx.int32)),
     "^vision"),
    ("call-vision-tuple", lambda L, c: L(_x(1), cache=c, vision=(mx.zeros((3, 9)), 0)), "^vision"),
    ("vision-state-float-table",
     lambda L, c: L(_x(1), cache=c, vision=VisionState(mx.zeros((3, 9)), 0)), "VisionState"),
    ("vision-state-2-axes",
     lambda L, c: L(_x(1), cache=c, vision=VisionState(mx.zeros((2, 9), mx.int32))),
     "VisionState"),
    ("vision-state-delta", lambda L, c: VisionState(mx.zeros((3, 9), mx.int32), 1.5),
     "VisionState.delta"),
    ("prefill-state-x-width", lambda L, c: L.prefill_state(_x(3, width=31), c), "^x: expected"),
    ("prefill-state-dtype", lambda L, c: L.prefill_state(_x(3, F32), c), "^x: dtype"),
    ("prefill-state-past-max", lambda L, c: L.prefill_state(_x(47), c), "max_position"),
    ("trim-past-offset", lambda L, c: c.trim(WARM_ROWS + 1), r"^trim\(n\)"),
    ("trim-negative", lambda L, c: c.trim(-1), r"^trim\(n\)"),
    ("trim-float", lambda L, c: c.trim(1.0), r"^trim\(n\)"),
    ("trim-bool", lambda L, c: c.trim(True), r"^trim\(n\)"),
    ("state-setter-one-array", lambda L, c: setattr(c, "state", c.state[:1]), "^state"),
    ("state-setter-kv-mismatch",
     lambda L, c: setattr(c, "state", (*c.state[:-1], c.state[-1][:, :1])), "^state: keys"),
    ("state-setter-raw-width",
     lambda L, c: setattr(c, "state", (c.state[0][..., :8], *c.state[1:])), "^state: raw"),
    ("meta-setter-bits", lambda L, c: setattr(c, "meta_state", _meta(c, 2, "11111")),
     "^meta_state: presence"),
    # Regression: the setter assigned the index head dim before checking the offset.
    ("meta-setter-offset-past-cap",
     lambda L, c: setattr(c, "meta_state", _meta(_meta(c, 0, "9999"), 3, "32")),
     "^meta_state: offset"),
    ("meta-setter-pooled-len", lambda L, c: setattr(c, "meta_state", _meta(c, 1, "90")),
     "^meta_state: pooled_len"),
    ("meta-setter-not-ints", lambda L, c: setattr(c, "meta_state", _meta(c, 0, "x")),
     "^meta_state: expected integer"),
    ("meta-setter-ratio", lambda L, c: setattr(c, "meta_state", _meta(c, 5, "0")),
     "^meta_state: ratio"),
    ("meta-setter-length", lambda L, c: setattr(c, "meta_state", ("254",)), "^meta_state"),
    ("cache-of-another-ratio", lambda L, c: L(_x(1), cache=_other_ratio_cache()), "^cache"),
    ("cache-not-a-cache", lambda L, c: L(_x(1), cache={"offset": 0}), "^cache"),
]  # fmt: skip


def _meta(c: QSACache | tuple[str, ...], i: int, value: str) -> tuple[str, ...]:
    """A cache's meta_state (or a given one) with field i replaced."""
    meta = list(c.meta_state if isinstance(c, QSACache) else c)
    meta[i] = value
    return tuple(meta)


def _other_ratio_cache() -> QSACache:
    """A restored (signature-less) cache of a ratio-8 layer with the same array shapes."""
    other, _ = build(small_config(True, indexer_budget=32, indexer_compress_ratio=8), BF16, 4)
    c = other.make_cache()
    other(hidden_rows(9, 32, BF16, seed=304), cache=c)
    return QSACache.from_state(c.state, c.meta_state)


@pytest.mark.parametrize("fn, match", [pytest.param(*b[1:], id=b[0]) for b in BAD_INPUTS])
def test_bad_input_is_rejected_before_the_cache_is_touched(warm_state, fn, match):
    """Every public entry point validates first: the cache keeps every bit, offset,
    pooled_len and meta_state, the layer's counters and last call; the next call matches a
    cache that never saw the bad input."""
    layer, cache = fresh(warm_state)
    snap, counters, last = Snapshot.of(cache), dict(layer.counters), layer.last_call
    entries = layer.core.entry_count
    with pytest.raises(ValueError, match=match):
        fn(layer, cache)
    snap.assert_matches(cache)
    assert layer.counters == counters and layer.last_call is last
    assert layer.core.entry_count == entries
    assert_next_call_matches_clean(layer, cache, warm_state)


def test_from_state_rejects_bad_saves_and_keeps_the_arrays(warm_state):
    state, meta = warm_state
    digests = [digest(a) for a in state]
    bad = [
        (state[:1], meta, "^state"),
        (state, (*meta[:2], "11111", *meta[3:]), "^meta_state: presence"),
        (state, (str(10**6), *meta[1:]), "^meta_state: offset"),
        (state, (meta[0], "-1", *meta[2:]), "^meta_state: pooled_len"),
        (state, (*meta[:5], "0"), "^meta_state: ratio"),
        (state, (*meta[:5], "four"), "^meta_state: expected integer"),
    ]
    for arrays, m, match in bad:
        with pytest.raises(ValueError, match=match):
            QSACache.from_state(arrays, m)
    assert [digest(a) for a in state] == digests
    # A 5-string meta_state (saved before the ratio was stored) still reads, as ratio 4.
    assert QSACache.from_state(state, meta[:5]).ratio == 4


@pytest.mark.parametrize(
    "make, match",
    [
        pytest.param(lambda: ERR_CFG.replace(indexer_budget=18), "^indexer_budget", id="budget"),
        pytest.param(lambda: ERR_CFG.replace(indexer_kv_heads=2), "^indexer_kv_heads", id="kvh"),
        pytest.param(lambda: ERR_CFG.replace(indexer_budget=None), "indexer keys", id="partial"),
        pytest.param(lambda: ERR_CFG.replace(num_key_value_heads=3), "^num_key_value", id="gqa"),
        pytest.param(lambda: ERR_CFG.replace(head_dim=0), "^head_dim", id="head-dim"),
        pytest.param(lambda: QSAOptions(tile_rows=-1), "tile_rows", id="option-int"),
        pytest.param(lambda: QSAOptions(flash=1), "flash", id="option-bool"),
        pytest.param(lambda: QSAOptions().replace(nope=1), "unknown", id="option-unknown"),
        pytest.param(lambda: QSAAttention(ERR_CFG, fused=2), "^fused", id="fused-level"),
        pytest.param(lambda: QSAAttention(ERR_CFG.to_dict()), "^config", id="config-dict"),
        pytest.param(lambda: QSAAttention(ERR_CFG, options={}), "^options", id="options-type"),
    ],
)
def test_invalid_config_is_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


class Injected(RuntimeError):
    pass


def _raise(*args: object, **kwargs: object) -> None:
    raise Injected("injected failure")


def _graph_that_fails(*args: object, **kwargs: object) -> Callable:
    def run(*a: object) -> None:
        raise Injected("injected failure while tracing")

    return run


# (id, object, attribute, replacement, options of the layer, entry point). The first four
# fail before the compiled core has run; the others after it (or on the eager path).
BEFORE_CORE = ("rope-tables", "block-tables", "compiled-core-dispatch", "compiled-graph-trace")
EAGER = {"compiled": False}
INJECTIONS = [
    ("rope-tables", layer_mod, "text_rope", _raise, None, "call"),
    ("block-tables", layer_mod.QSAAttention, "_block_tables", _raise, None, "call"),
    ("compiled-core-dispatch", core_mod.IndexerCore, "dispatch", _raise, None, "call"),
    ("compiled-graph-trace", core_mod, "_graph", _graph_that_fails, None, "call"),
    ("eager-pool-blocks", layer_mod, "pool_blocks", _raise, EAGER, "call"),
    # the 4-row call's selection is row_tokens: the layer selects through select_row_tokens
    ("eager-select-row-tokens", layer_mod, "select_row_tokens", _raise, EAGER, "call"),
    ("kv-append", layer_mod, "kv_append", _raise, None, "call"),
    ("plan-consumers", layer_mod.plan, "plan_consumers", _raise, None, "call"),
    ("consumer-dispatch", layer_mod, "dispatch", _raise, None, "call"),
    ("rows-gather-consumer", consumers_mod, "rows_gather", _raise, None, "call"),
    ("prefill-state-pool-blocks", layer_mod, "pool_blocks", _raise, None, "prefill_state"),
    ("prefill-state-kv-append", layer_mod, "kv_append", _raise, None, "prefill_state"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, target, attr, replacement, options, entry",
    [pytest.param(*i, id=i[0]) for i in INJECTIONS],
)
def test_failure_inside_a_call_leaves_the_cache_as_before(
    warm_state, name, target, attr, replacement, options, entry
):
    """A failure raised anywhere inside a call (a 4-row call that would grow KV and the raw
    bucket) leaves every state bit, offset, pooled_len and meta_state and the layer's
    counters as they were; the next call matches a clean run. The compiled core is a cache
    of graphs, not of tokens: a failure after it ran may leave the (valid) graph of that call,
    never a broken one; a failure before it leaves it untouched."""
    opts = QSAOptions.trace(**options) if options else None
    layer, cache = fresh(warm_state, opts)
    snap, counters, last = Snapshot.of(cache), dict(layer.counters), layer.last_call
    core = layer.core
    entries = core.entry_count if core else 0
    receipt = core.receipt.to_dict(0) if core else None
    x = hidden_rows(4, ERR_CFG.hidden_size, BF16, seed=305)
    with mock.patch.object(target, attr, replacement), pytest.raises(Injected):
        if entry == "call":
            layer(x, cache=cache)
        else:
            layer.prefill_state(x, cache)
    snap.assert_matches(cache)
    assert layer.counters == counters and layer.last_call is last
    if core is not None and name in BEFORE_CORE:
        assert core.entry_count == entries and core.receipt.to_dict(0) == receipt
    elif core is not None:
        assert entries <= core.entry_count <= entries + 1
        assert core.python_traces == core.entry_count
    assert_next_call_matches_clean(layer, cache, warm_state, opts)


# -- determinism ------------------------------------------------------------------------------

DIGEST_SCHEDULE = (("call", 23), ("call", 1), ("call", 1), ("call", 5), ("trim", 2),
                   ("call", 1), ("state", 9), ("call", 40), ("call", 3))  # fmt: skip


def schedule_digest(fused: int = 4, compiled: bool = True) -> str:
    """sha256 over every output's and the final state's bytes (plus meta_state) of a fixed
    schedule crossing dense, sparse, verify, trim, state-only and eager prefill calls."""
    cfg = small_config(True)
    layer, _ = build(cfg, BF16, fused, QSAOptions.trace(compiled=compiled))
    cache = layer.make_cache()
    h = hashlib.sha256()
    for i, (op, n) in enumerate(DIGEST_SCHEDULE):
        if op == "trim":
            cache.trim(n)
            continue
        x = hidden_rows(n, cfg.hidden_size, BF16, seed=400 + i)
        if op == "state":
            layer.prefill_state(x, cache)
        else:
            y = layer(x, cache=cache)
            mx.eval(y)
            h.update(digest(y).encode())
    mx.eval(*cache.state)
    for a in cache.state:
        h.update(digest(a).encode())
    h.update(repr(cache.meta_state).encode())
    return h.hexdigest()


def test_same_inputs_same_digests_across_runs_and_processes():
    """Two runs in this process and one in a fresh interpreter give the same digests of
    outputs and states; fusion levels 0 and 3 give fused 4's digest too (RUNTIME §1.1)."""
    first = schedule_digest()
    assert schedule_digest() == first
    src = Path(layer_mod.__file__).resolve().parents[1]
    tests = Path(__file__).resolve().parent
    script = (
        f"import sys; sys.path[:0] = [{str(tests)!r}, {str(src)!r}]\n"
        "import test_reliability as t\n"
        "print(t.schedule_digest())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(tests)])}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == first
    assert schedule_digest(fused=0) == schedule_digest(fused=3) == first
