"""QSACache: capacities after growth (RUNTIME §2.2), pooled_len and trim (§2.4), the mlx-lm
protocol (state / meta_state / from_state, nbytes, empty), driven through a real layer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import hidden_rows, small_config, synthetic_weights

from mlx_qsa.cache import STATE_NAMES, QSACache
from mlx_qsa.config import INDEXER_KEYS, QSAConfig, QSAOptions
from mlx_qsa.layer import QSAAttention

BF16 = mx.bfloat16
CAPS = ("raw_keys", "pooled", "pooled_f32_t", "keys")


def small_layer(cfg: QSAConfig | None = None, **options) -> QSAAttention:
    cfg = cfg or small_config(True)
    return QSAAttention.from_hf(
        cfg.to_dict(),
        synthetic_weights(cfg, BF16, 7),
        fused=4,
        options=QSAOptions.trace(**options),
        zero_centered_norms=False,
    )


@pytest.fixture(scope="module")
def layer() -> QSAAttention:
    return small_layer()


def rows(n: int, seed: int = 0) -> mx.array:
    return hidden_rows(n, 32, BF16, seed=seed)


def caps(cache: QSACache) -> list[int]:
    """raw / pooled / mirror / KV capacities (0 = absent), as in RUNTIME §9.8."""
    return [cache.capacity(n) for n in CAPS]


def call(layer: QSAAttention, cache: QSACache, n: int, seed: int = 1) -> None:
    y = layer(rows(n, seed), cache=cache)
    mx.eval(y, *cache.state)


def assert_bit_equal(a: QSACache, b: QSACache) -> None:
    assert (a.offset, a.pooled_len, a.state_present) == (b.offset, b.pooled_len, b.state_present)
    for x, y in zip(a.state, b.state, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y)


# -- capacities (RUNTIME §2.2 examples) ----------------------------------------------------


@pytest.mark.parametrize(
    "steps, expected",
    [
        # (rows, via) per step; expected raw / pooled / mirror / KV caps and compiled flag
        pytest.param([(1, "call")], [([256, 256, 0, 256], True)], id="1@0-compiled-minimum"),
        pytest.param(
            [(1, "call"), (4, "call")],
            [([256, 256, 0, 256], True), ([256, 256, 256, 256], False)],
            id="p0-eager-creates-mirror",
        ),
        pytest.param(
            [(2048, "call"), (1, "call")],
            [([2048, 512, 512, 2048], False), ([4096, 512, 0, 2304], True)],
            id="p1-2048-then-1",
        ),
        pytest.param(
            [(2051, "state"), (1, "call")],
            [([2304, 512, 512, 2304], None), ([4096, 1024, 0, 2304], True)],
            id="prefix2051-first-compiled-call",
        ),
        pytest.param(
            [(2051, "state"), (1, "eager")],
            [([2304, 512, 512, 2304], None), ([2304, 1024, 1024, 2304], False)],
            id="prefix2051-block513-eager-doubling",
        ),
        pytest.param(
            [(2048, "state"), (1, "state"), (2, "state")],
            [
                ([2048, 512, 512, 2048], None),
                ([4096, 512, 512, 2304], None),
                ([4096, 512, 512, 2304], None),
            ],
            id="2048-plus-1-raw-doubles",
        ),
        # KV frontier off a 256 boundary: cut to P rows, then append roundup256(S) rows.
        pytest.param(
            [(255, "state"), (2, "call")],
            [([256, 256, 256, 256], None), ([512, 256, 0, 511], True)],
            id="kv-cut-to-255-plus-256",
        ),
        pytest.param(
            [(300, "state"), (300, "state")],
            [([512, 256, 256, 512], None), ([1024, 256, 256, 812], None)],
            id="kv-cut-to-300-plus-512",
        ),
    ],
)
def test_capacities_follow_growth_rules(steps, expected):
    compiled_layer, eager_layer = small_layer(), small_layer(compiled=False)
    cache = compiled_layer.make_cache()
    seed = 0
    for (n, via), (want, compiled) in zip(steps, expected, strict=True):
        seed += 1
        if via == "state":
            compiled_layer.prefill_state(rows(n, seed), cache)
            mx.eval(*cache.state)
        else:
            lay = eager_layer if via == "eager" else compiled_layer
            call(lay, cache, n, seed)
            assert lay.last_call.compiled is compiled
        assert caps(cache) == want, (n, via)
        assert cache.pooled_len == cache.offset // 4


def test_long_context_capacities():
    """32768 → KV 32768; +2048 → 34816 and buckets 65536/16384 (compiled prefill);
    +1 → KV 35072 (RUNTIME §2.2, profile 6)."""
    layer = small_layer(prefill_min_context=2049)
    cache = layer.make_cache()
    layer.prefill_state(rows(32768, 1), cache)
    mx.eval(*cache.state)
    assert caps(cache) == [32768, 8192, 8192, 32768]
    call(layer, cache, 2048, 2)
    assert layer.last_call.compiled and layer.last_call.mode == "prefill_blocks"
    assert caps(cache) == [65536, 16384, 0, 34816]
    call(layer, cache, 1, 3)
    assert caps(cache) == [65536, 16384, 0, 35072]
    assert (cache.offset, cache.pooled_len) == (34817, 8704)


@pytest.mark.parametrize(
    "widths",
    [(1, 1, 1, 1, 1), (3, 5, 2, 7), (6, 17, 1, 2, 9, 4), (33, 1, 3)],
    ids=lambda w: "-".join(map(str, w)),
)
def test_pooled_len_is_offset_div_4_after_every_call(layer, widths):
    cache = layer.make_cache()
    for i, S in enumerate(widths):
        call(layer, cache, S, seed=10 + i)
        assert cache.pooled_len == cache.offset // 4
        assert cache.capacity("pooled_f32_t") in (0, cache.capacity("pooled"))


# -- trim -----------------------------------------------------------------------------------


@pytest.fixture
def filled(layer) -> QSACache:
    """A 27-token cache (sparse regime, pooled_len 6, last block incomplete)."""
    cache = layer.make_cache()
    for i, S in enumerate((20, 1, 4, 2)):
        call(layer, cache, S, seed=20 + i)
    return cache


@pytest.mark.parametrize(
    "n, offset, pooled_len",
    [(0, 27, 6), (1, 26, 6), (3, 24, 6), (4, 23, 5), (11, 16, 4), (27, 0, 0)],
)
def test_trim_lowers_offset_and_pooled_len_only(filled, n, offset, pooled_len):
    before = tuple(filled.state)
    assert filled.is_trimmable()
    assert filled.trim(n) == n
    assert (filled.offset, filled.pooled_len) == (offset, pooled_len)
    # No backing changes capacity or content.
    for a, b in zip(filled.state, before, strict=True):
        assert a is b
    assert not filled.empty()


@pytest.mark.parametrize(
    "n, shown",
    [(28, "28"), (-1, "-1"), (1.0, "1.0"), ("2", "'2'"), (True, "True"), (None, "None")],
    ids=["past-offset", "negative", "float", "str", "bool", "none"],
)
def test_bad_trim_raises_and_leaves_cache_unchanged(filled, n, shown):
    snap = QSACache.from_state(filled.state, filled.meta_state)
    with pytest.raises(
        ValueError, match=r"^trim\(n\): n must be in \[0, offset=27\], got " + shown
    ):
        filled.trim(n)
    assert_bit_equal(filled, snap)


def test_trim_twice_then_regrow(layer, filled):
    """Two rollbacks in a row, then growth past the old frontier, read like a fresh build."""
    filled.trim(2)
    filled.trim(3)
    assert (filled.offset, filled.pooled_len) == (22, 5)
    call(layer, filled, 6, seed=30)
    assert (filled.offset, filled.pooled_len) == (28, 7)


# -- state / meta_state / from_state --------------------------------------------------------


def _caches() -> dict[str, QSACache]:
    lay = small_layer()
    eager = small_layer(compiled=False)
    out = {"empty": lay.make_cache()}
    c = lay.make_cache()
    call(lay, c, 1)
    out["compiled-4-states"] = c
    c = lay.make_cache()
    call(eager, c, 23, 2)
    out["eager-5-states"] = c
    c = lay.make_cache()
    call(lay, c, 2)
    out["raw-no-pooled"] = c  # 2 eager rows: raw written, no block yet
    c = lay.make_cache()
    for i, S in enumerate((20, 1, 4)):
        call(lay, c, S, 3 + i)
    c.trim(3)
    out["after-trim"] = c
    noidx = small_config(True).replace(**dict.fromkeys(INDEXER_KEYS))
    c = small_layer(noidx).make_cache()
    call(small_layer(noidx), c, 5)
    out["no-indexer"] = c
    return out


CACHES = _caches()
PRESENT = {
    "empty": "00000",
    "compiled-4-states": "11011",
    "eager-5-states": "11111",
    "raw-no-pooled": "10011",
    "after-trim": "11011",
    "no-indexer": "00011",
}


@pytest.mark.parametrize("name", list(CACHES))
def test_state_round_trip_bit_for_bit(name, tmp_path):
    cache = CACHES[name]
    bits = "".join("1" if p else "0" for p in cache.state_present)
    assert bits == PRESENT[name]
    meta = cache.meta_state
    assert isinstance(meta, tuple) and all(isinstance(s, str) for s in meta)
    assert meta[:3] == (str(cache.offset), str(cache.pooled_len), bits)
    restored = QSACache.from_state(cache.state, meta)
    assert_bit_equal(restored, cache)
    # Through a safetensors file: arrays by index, meta_state as metadata.
    if cache.state:
        path = str(tmp_path / "cache.safetensors")
        mx.save_safetensors(
            path,
            {str(i): a for i, a in enumerate(cache.state)},
            metadata={str(i): s for i, s in enumerate(meta)},
        )
        arrays, md = mx.load(path, return_metadata=True)
        loaded = QSACache.from_state(
            tuple(arrays[str(i)] for i in range(len(arrays))),
            tuple(md[str(i)] for i in range(len(md))),
        )
        assert_bit_equal(loaded, cache)


def test_restored_cache_continues_identically():
    """A restored cache (after a trim) gives the original's outputs and states, bit for bit."""
    lay = small_layer()
    a = lay.make_cache()
    for i, S in enumerate((20, 1, 4)):
        call(lay, a, S, 40 + i)
    a.trim(3)
    b = QSACache.from_state(a.state, a.meta_state)
    for i, S in enumerate((1, 5, 2, 9)):
        x = rows(S, 50 + i)
        ya, yb = lay(x, cache=a), lay(x, cache=b)
        assert mx.array_equal(ya, yb)
        assert_bit_equal(a, b)


def test_from_state_rejects_inconsistent_input():
    cache = CACHES["eager-5-states"]
    with pytest.raises(ValueError, match="state"):
        QSACache.from_state(cache.state[:1], cache.meta_state)
    meta = list(cache.meta_state)
    meta[2] = "11011"
    with pytest.raises(ValueError, match="meta_state"):
        QSACache.from_state(cache.state, tuple(meta))
    meta = list(cache.meta_state)
    meta[0] = str(cache.capacity("keys") + 1)
    with pytest.raises(ValueError, match="meta_state: offset"):
        QSACache.from_state(cache.state, tuple(meta))


# -- nbytes, empty ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CACHES))
def test_nbytes_counts_every_present_backing(name):
    cache = CACHES[name]
    d_i, cfg = 16, small_config(True)
    per_row = {
        "raw_keys": d_i * 2,
        "pooled": d_i * 2,
        "pooled_f32_t": d_i * 4,
        "keys": cfg.num_key_value_heads * cfg.head_dim * 2,
    }
    per_row["values"] = per_row["keys"]
    cap = {n: cache.capacity(n) for n in STATE_NAMES}
    assert cache.nbytes == sum(per_row[n] * cap[n] for n in STATE_NAMES)
    assert cache.nbytes == sum(int(np.prod(a.shape)) * a.itemsize for a in cache.state)


def test_empty_until_the_first_call(layer):
    cache = layer.make_cache()
    assert cache.empty() and cache.nbytes == 0 and cache.state == ()
    assert (cache.offset, cache.pooled_len) == (0, 0)
    call(layer, cache, 1)
    assert not cache.empty()
