"""Tests of `mlx_qsa.profiles`: the §9.2 table, the int-level cache model, purity."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_qsa import plan, profiles
from mlx_qsa.config import QSAOptions
from mlx_qsa.plan import Capabilities
from mlx_qsa.profiles import PROFILES, CacheModel, LayerModel, Profile, expected_profile_records

SRC = Path(plan.__file__).parent


# ---------------------------------------------------------------------------- the table

TABLE = [
    # p, fused, vision, flash_min, prefill_gather, prefix, calls
    (0, 4, "none", 2049, True, 0, [(1, 0), (4, 1), (33, 5)]),
    (1, 3, "none", 2049, True, 0, [(2048, 0), (1, 2048)]),
    (2, 4, "none", 2049, True, 2051, [(1, 2051), (4, 2052), (33, 2054)]),
    (3, 0, "none", 32768, True, 2051, [(33, 2051), (1, 2084), (4, 2085)]),
    (4, 3, "none", 32768, False, 2051, [(33, 2051), (1, 2084), (4, 2085)]),
    (5, 0, "none", 32768, True, 2051, [(1, 2051), (4, 2052)]),
    (6, 4, "none", 32768, True, 32768, [(2048, 32768), (1, 34816), (4, 34817)]),
    (7, 4, "table", 2049, True, 2051, [(1, 2051), (4, 2052), (2, 2054), (1, 2056)]),
    (8, 0, "none", 2049, True, 0, [(3, 0), (1, 3), (4, 4)]),
    (9, 3, "no_axes", 2049, True, 2051, [(1, 2051), (4, 2052)]),
]


@pytest.mark.parametrize("row", TABLE, ids=[f"p{r[0]}" for r in TABLE])
def test_profile_row(row) -> None:
    p, fused, vision, flash_min, prefill_gather, prefix, calls = row
    prof = PROFILES[p]
    assert (prof.profile, prof.fused_level, prof.vision, prof.flash_min) == (
        p,
        fused,
        vision,
        flash_min,
    )
    assert (prof.prefill_gather, prof.prefix, list(prof.calls)) == (prefill_gather, prefix, calls)
    assert (prof.no_indexer, prof.biased) == ((True, True) if p == 8 else (False, False))


def test_profile_option_changes() -> None:
    changes = {p.profile: p.option_changes for p in PROFILES if p.option_changes}
    assert changes == {
        3: dict(compiled=False, flash=False, gather=False),
        5: dict(fused=False, compiled=False, flash=False, gather_decode=True),
    }
    # The fusion level never changes options.fused; only p5 lists it.
    assert [p.profile for p in PROFILES if not p.options().fused] == [5]


def test_profile_options_are_trace_defaults_plus_changes() -> None:
    p4 = PROFILES[4].options(tf32=False)
    assert p4 == QSAOptions.trace(flash_min=32768, prefill_gather=False, tf32=False)
    assert p4.phase_prefill and p4.prefill_min_context == 2049 and p4.gather_min_context == 0


def test_profile_trims() -> None:
    trims = {p.profile: [s for s in p.steps if s[0] == "trim"] for p in PROFILES}
    assert trims[2] == trims[7] == [("trim", 2)]
    assert all(not v for k, v in trims.items() if k not in (2, 7))
    assert PROFILES[2].steps[2] == ("trim", 2) and PROFILES[7].steps[2] == ("trim", 2)


def test_profile_is_frozen_and_hashable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PROFILES[0].prefix = 5  # type: ignore[misc]
    assert len({*PROFILES}) == 10
    assert [f.name for f in dataclasses.fields(Profile)] == [
        "profile", "fused_level", "vision", "no_indexer", "biased", "flash_min",
        "prefill_gather", "option_changes", "prefix", "steps",
    ]  # fmt: skip


# ---------------------------------------------------------------------------- cache model


@pytest.mark.parametrize(
    ("prefix", "caps", "mirror", "plen"),
    [(0, (0, 0, 0), False, 0), (3, (256, 0, 256), False, 0), (4, (256, 256, 256), True, 1),
     (2051, (2304, 512, 2304), True, 512), (32768, (32768, 8192, 32768), True, 8192)],
    ids=lambda v: str(v),
)  # fmt: skip
def test_prefix_fill(prefix: int, caps: tuple, mirror: bool, plen: int) -> None:
    c = CacheModel()
    c.prefix_fill(prefix)
    assert (c.cap_raw, c.cap_pool, c.cap_kv) == caps
    assert (c.mirror, c.pooled_len, c.offset) == (mirror, plen, prefix)


def test_prefix_fill_without_indexer() -> None:
    c = CacheModel(has_indexer=False)
    c.prefix_fill(2051)
    assert c.state_present == [False, False, False, True, True] and c.cap_kv == 2304


def test_shapes_follow_presence() -> None:
    c = CacheModel()
    c.prefix_fill(2051)
    assert c.shapes() == [[1, 2304, 128], [1, 512, 128], [1, 1, 128, 512],
                          [1, 2, 2304, 256], [1, 2, 2304, 256]]  # fmt: skip


def test_trim_changes_no_backing() -> None:
    c = CacheModel()
    c.prefix_fill(2056)
    before = (c.cap_raw, c.cap_pool, c.mirror, c.cap_kv)
    assert c.trim(2) == 2
    assert (c.offset, c.pooled_len) == (2054, 513)
    assert (c.cap_raw, c.cap_pool, c.mirror, c.cap_kv) == before
    assert c.trim(0) == 0 and c.pooled_len == 513  # pooled_len never grows on trim
    with pytest.raises(ValueError, match=r"trim\(n\)"):
        c.trim(3000)


def test_call_must_continue_at_offset() -> None:
    layer = LayerModel(PROFILES[0])
    with pytest.raises(ValueError, match="offset"):
        layer.call(1, 5, PROFILES[0].options())


def test_eager_call_below_one_block_leaves_pooled_absent() -> None:
    layer = LayerModel(PROFILES[0])
    layer.call(2, 0, QSAOptions.trace(compiled=False))
    assert layer.cache.state_present == [True, False, False, True, True]
    layer.call(2, 2, QSAOptions.trace(compiled=False))  # completes block 0
    assert layer.cache.state_present == [True] * 5 and layer.cache.pooled_len == 1


def test_compiled_call_drops_mirror_and_eager_oracle_restores_it() -> None:
    layer = LayerModel(PROFILES[2])
    layer.cache.prefix_fill(2051)
    layer.call(1, 2051, QSAOptions.trace())
    assert not layer.cache.mirror and layer.core is not None
    # The legacy selector completing no block leaves the mirror absent (§2.3)...
    layer.call(1, 2052, QSAOptions.trace(compiled=False))
    assert not layer.cache.mirror
    # ...the oracle scorer creates it.
    layer.call(1, 2053, QSAOptions.trace(compiled=False, fused=False))
    assert layer.cache.mirror and layer.cache.cap_pool == 1024


def test_portable_profile_is_all_eager() -> None:
    recs = expected_profile_records(PROFILES[0], caps=Capabilities.portable())
    assert [r["state_present"] for r in recs] == [
        [True, False, False, True, True], [True, True, True, True, True],
        [True, True, True, True, True],
    ]  # fmt: skip
    assert all(r["core"] is None and r["consumers"] == ["sdpa"] for r in recs)


OPTION_SETS = [
    QSAOptions.trace(),
    QSAOptions.trace(compiled=False),
    QSAOptions.trace(fused=False, compiled=False, flash=False, gather_decode=True),
    QSAOptions.trace(gather=False, flash=False),
    QSAOptions.trace(phase_prefill=False, tile_rows=2),
    QSAOptions(),
]
CAPS = [Capabilities.reference(), Capabilities.portable(), Capabilities(f32_selector=False),
        Capabilities(prefill_selector=False, prefill_flash=False, compiled_core=False)]  # fmt: skip

step = st.one_of(
    st.tuples(st.just("call"), st.integers(1, 40)),
    st.tuples(st.just("call"), st.sampled_from([1, 2048, 600])),
    st.tuples(st.just("trim"), st.integers(0, 6)),
)


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.sampled_from([0, 3, 2040, 2051, 2300]),
    steps=st.lists(step, min_size=1, max_size=12),
    opt_i=st.integers(0, len(OPTION_SETS) - 1),
    caps_i=st.integers(0, len(CAPS) - 1),
    level=st.sampled_from([0, 3, 4]),
)
def test_cache_model_invariants(prefix, steps, opt_i, caps_i, level) -> None:
    prof = dataclasses.replace(PROFILES[0], fused_level=level, prefix=prefix)
    opts, caps = OPTION_SETS[opt_i], CAPS[caps_i]
    layer = LayerModel(prof, caps)
    c = layer.cache
    c.prefix_fill(prefix)
    compiled_calls = 0
    for kind, n in steps:
        if kind == "trim":
            c.trim(min(n, c.offset))
            continue
        calls_before = layer.core.calls if layer.core else 0
        out = layer.call(n, c.offset, opts)
        was_compiled = (layer.core.calls if layer.core else 0) > calls_before
        compiled_calls += was_compiled
        assert c.cap_raw >= c.offset and c.cap_kv >= c.offset
        assert c.pooled_len == c.offset // 4 and c.cap_pool >= c.pooled_len
        assert not c.mirror or c.cap_pool > 0
        if was_compiled:
            assert not c.mirror
            for cap in (c.cap_raw, c.cap_pool):
                assert cap >= 256 and cap & (cap - 1) == 0
        assert out["consumers"][-1] in ("sdpa", "flash", "rows_gather", "prefill_flash")
        assert set(out["names"]) <= set(plan.LIBRARY_COUNTERS)
    if layer.core:
        d = layer.core.to_dict()
        assert d["calls"] == compiled_calls == sum(d["modes"].values())
        assert d["traces"] == d["entry_count"] <= d["calls"]
        assert sum(d["buckets"].values()) == d["calls"]
    if not caps.compiled_core or not opts.compiled:
        assert layer.core is None


# ---------------------------------------------------------------------------- purity


@pytest.mark.parametrize("name", ["plan.py", "profiles.py"])
def test_decision_modules_import_no_arrays(name: str) -> None:
    tree = ast.parse((SRC / name).read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add(node.module or "")
    third_party = {m for m in mods if m.split(".")[0] in ("mlx", "numpy")}
    assert third_party == set(), third_party
    local = {m for m in mods if m.startswith("mlx_qsa")}
    assert local <= {"mlx_qsa", "mlx_qsa.config", "mlx_qsa.plan"}
    assert profiles.__name__ == "mlx_qsa.profiles"
