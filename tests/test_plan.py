"""Unit tests of `mlx_qsa.plan`: every decision of RUNTIME §2, §4–§6 with its example values."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from mlx_qsa.config import QSAOptions
from mlx_qsa.plan import (
    LIBRARY_COUNTERS,
    TRACE_COUNTERS,
    CallShape,
    Capabilities,
    CompiledKey,
    CoreReceipt,
    bucket,
    compiled_blockers,
    compiled_reservation,
    eager_growth,
    indexer_mode,
    kv_growth,
    make_compiled_key,
    next_pow2,
    ordered_counts,
    plan_consumers,
    plan_indexer,
    predicates,
    prefill_flash_contract,
    prefill_score_producer,
    roundup256,
    selector_chunk_rows,
    staging_window_start,
)

TRACE = QSAOptions.trace()
REF = Capabilities.reference()
PORTABLE = Capabilities.portable()
FIXTURE = Path(__file__).parent / "data" / "qsa_trace_m5pro.jsonl"
BF16 = "bfloat16"

# Row counts 1..40 at offsets 0..9 and straddling the dense/sparse threshold (first sparse T 2052).
GRID = [(S, P) for S in range(1, 41) for P in [*range(10), *range(2040, 2061)]]


def _id(S: int, P: int) -> str:
    return f"S{S}-pos{P}"


# ---------------------------------------------------------------------------- counters


def test_counter_names() -> None:
    assert TRACE_COUNTERS == (
        "metal_selector", "flash_kernel", "gather_tier", "dense_fallback", "decode_gather",
        "compiled_selector",
    )  # fmt: skip
    assert LIBRARY_COUNTERS[6:] == (
        "eager_selector", "decode_flash_skip", "decode_dense_mask", "direct_kernel",
    )  # fmt: skip


def test_ordered_counts_fixed_order_not_call_order() -> None:
    # p6s0 records flash_kernel before compiled_selector although the selector ran first.
    got = ordered_counts(["compiled_selector", "flash_kernel"])
    assert list(got.items()) == [("flash_kernel", 1), ("compiled_selector", 1)]


def test_ordered_counts_tallies_and_drops_library_counters() -> None:
    names = ["decode_flash_skip", "metal_selector", "gather_tier", "metal_selector"]
    assert ordered_counts(names) == {"metal_selector": 2, "gather_tier": 1}
    lib = ordered_counts(names, trace_only=False)
    assert list(lib.items()) == [
        ("metal_selector", 2),
        ("gather_tier", 1),
        ("decode_flash_skip", 1),
    ]
    assert ordered_counts([]) == {}


def test_ordered_counts_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="bogus"):
        ordered_counts(["bogus"])


# ---------------------------------------------------------------------------- capacities


@pytest.mark.parametrize(
    ("n", "up", "pow2", "buck"),
    [(0, 0, 1, 0), (1, 256, 1, 256), (255, 256, 256, 256), (256, 256, 256, 256),
     (257, 512, 512, 512), (513, 768, 1024, 1024), (768, 768, 1024, 1024),
     (2304, 2304, 4096, 4096), (34816, 34816, 65536, 65536)],
    ids=lambda v: str(v),
)  # fmt: skip
def test_roundup_pow2_bucket(n: int, up: int, pow2: int, buck: int) -> None:
    assert (roundup256(n), next_pow2(n), bucket(n)) == (up, pow2, buck)


def test_capacity_helpers_exhaustive() -> None:
    for n in range(1, 5000):
        assert roundup256(n) % 256 == 0 and 0 <= roundup256(n) - n < 256
        p = next_pow2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)
        assert bucket(n) == max(256, p)


@pytest.mark.parametrize("fn", [roundup256, next_pow2, bucket])
def test_capacity_helpers_reject_negative(fn) -> None:
    with pytest.raises(ValueError):
        fn(-1)


@pytest.mark.parametrize(
    ("cap", "P", "S", "expected"),
    [
        (0, 0, 1, (0, 256)),  # KV 1 -> 256
        (0, 0, 2048, (0, 2048)),  # 2048 -> 2048
        (2048, 2048, 1, (2048, 2304)),  # +1 -> 2304
        (0, 0, 2051, (0, 2304)),  # 2051 -> 2304
        (0, 0, 32768, (0, 32768)),
        (32768, 32768, 2048, (32768, 34816)),  # +2048 -> 34816
        (34816, 34816, 1, (34816, 35072)),  # +1 -> 35072
        (256, 5, 300, (5, 517)),  # frontier off a 256 boundary: cut to P, then append 512
        (512, 256, 300, (512, 1024)),  # on a boundary after a trim: keep the stale rows
        (2304, 2051, 1, None),
        (256, 255, 1, None),
        (256, 256, 1, (256, 512)),
    ],
    ids=lambda v: str(v),
)
def test_kv_growth(cap: int, P: int, S: int, expected) -> None:
    assert kv_growth(cap, P, S) == expected


def test_kv_growth_invariants() -> None:
    for cap in (0, 256, 512, 2304):
        for P in range(0, cap + 1, 37):
            for S in (1, 4, 33, 255, 256, 257):
                got = kv_growth(cap, P, S)
                if got is None:
                    assert cap > 0 and P + S <= cap
                    continue
                kept, new = got
                assert kept >= P if cap else kept == 0  # rows [0, P) survive
                assert new >= P + S and new - kept == roundup256(S)


def test_kv_growth_rejects_bad_rows() -> None:
    with pytest.raises(ValueError, match="S"):
        kv_growth(0, 0, 0)


def test_eager_growth_examples() -> None:
    assert eager_growth(0, 2051) == 2304  # prefix 2051 -> raw 2304
    assert eager_growth(0, 2051 // 4) == 512  # pooled 512
    assert eager_growth(512, 513) == 1024  # one more block: max(768, 1024)
    assert eager_growth(2304, 2500) == 4608  # 2·cap dominates
    assert eager_growth(256, 300) == 512
    assert eager_growth(1024, 1024) == 1024 and eager_growth(1024, 3) == 1024
    assert eager_growth(0, 0) == 0  # nothing written: an absent state stays absent


def test_eager_growth_exhaustive() -> None:
    for cap in (0, 256, 512, 768, 2304):
        for end in range(1, 3000, 7):
            new = eager_growth(cap, end)
            assert new >= end and new >= cap
            assert new == cap if end <= cap else new == max(roundup256(end), 2 * cap)


@pytest.mark.parametrize(
    ("caps_in", "P", "S", "caps_out"),
    [
        ((0, 0), 0, 1, (256, 256)),  # p0s0: minimum 256 both
        ((2048, 512), 2048, 1, (4096, 512)),  # p1s1
        ((2304, 512), 2051, 1, (4096, 1024)),  # eager 2304/512 -> 4096/1024 at 2052
        ((32768, 8192), 32768, 2048, (65536, 16384)),  # -> 65536/16384 at 34816
        ((4096, 1024), 2052, 4, (4096, 1024)),  # already bucketed: unchanged
        ((300, 0), 0, 1024, (1024, 256)),  # raw >= 4·m, pool >= m
    ],
    ids=lambda v: str(v),
)
def test_compiled_reservation(caps_in, P: int, S: int, caps_out) -> None:
    assert compiled_reservation(*caps_in, P, S) == caps_out


def test_compiled_reservation_invariants() -> None:
    for cap_raw, cap_pool in ((0, 0), (256, 256), (2304, 512), (4096, 1024)):
        for S, P in GRID:
            call = CallShape(S, P)
            raw, pool = compiled_reservation(cap_raw, cap_pool, P, S)
            for v in (raw, pool):
                assert v >= 256 and v & (v - 1) == 0
            assert raw >= max(cap_raw, call.T, 4 * call.m)  # never shrinks, fits the write
            assert pool >= max(cap_pool, call.nb, call.m)
            assert compiled_reservation(raw, pool, P, S) == (raw, pool)  # idempotent


# ---------------------------------------------------------------------------- capabilities


def test_capabilities_profiles() -> None:
    names = [f.name for f in dataclasses.fields(Capabilities)]
    assert names == [
        "indexer_kernels", "compiled_core", "flash_decode", "prefill_selector", "prefill_flash",
        "fused_score_producer", "f32_selector",
    ]  # fmt: skip
    assert all(getattr(REF, n) for n in names) and REF == Capabilities()
    assert not any(getattr(PORTABLE, n) for n in names)


@pytest.mark.parametrize(
    ("field", "option"),
    [("indexer_kernels", "fused"), ("compiled_core", "compiled"), ("flash_decode", "flash")],
)
def test_effective_options_gates_one_option(field: str, option: str) -> None:
    caps = dataclasses.replace(REF, **{field: False})
    eff = caps.effective_options(TRACE)
    assert getattr(eff, option) is False
    assert eff.replace(**{option: True}) == TRACE  # nothing else changed
    assert REF.effective_options(TRACE) is TRACE


def test_effective_options_other_capabilities_change_no_option() -> None:
    caps = Capabilities(prefill_selector=False, prefill_flash=False, fused_score_producer=False,
                        f32_selector=False)  # fmt: skip
    assert caps.effective_options(TRACE) == TRACE
    off = PORTABLE.effective_options(TRACE)
    assert (off.fused, off.compiled, off.flash) == (False, False, False)


# ---------------------------------------------------------------------------- call and mode


def test_call_shape_properties() -> None:
    for S, P in GRID:
        c = CallShape(S, P)
        assert (c.T, c.decode, c.nb, c.m) == (P + S, S == 1, (P + S) // 4, math.ceil(S / 4))
    assert CallShape(2048, 32768).nb == 8704 and CallShape(2048, 32768).m == 512


@pytest.mark.parametrize(
    "kw", [dict(rows=0, pos=0), dict(rows=1, pos=-1), dict(rows=1, pos=0, ratio=0)]
)
def test_call_shape_validates(kw) -> None:
    with pytest.raises(ValueError, match="CallShape"):
        CallShape(**kw)


def test_predicates_use_effective_prefill_min_context() -> None:
    low = TRACE.replace(prefill_min_context=100)  # raised to 2049 when used
    assert not predicates(low, CallShape(33, 2000)).large
    assert predicates(low, CallShape(33, 2016)).large
    assert predicates(TRACE.replace(tile_rows=3), CallShape(4, 0)).tiled
    assert not predicates(TRACE.replace(tile_rows=4), CallShape(4, 0)).tiled


@pytest.mark.parametrize(("S", "P"), GRID, ids=[_id(*g) for g in GRID])
def test_indexer_mode_grid(S: int, P: int) -> None:
    call = CallShape(S, P)
    mode = indexer_mode(TRACE, REF, call)
    assert (mode == "update_only") == (call.nb <= 512)
    if call.nb > 512:
        # Trace defaults: decode -> blocks; 2..8 rows -> row_tokens; >= 32 rows -> prefill.
        want = "blocks" if S == 1 else "row_tokens" if S <= 8 else "dense_mask"
        if S >= 32 and call.T >= 2049:
            want = "prefill_blocks"
        assert mode == want
    # Without flash (option or capability) decode goes to the dense mask.
    no_flash = indexer_mode(TRACE.replace(flash=False), REF, call)
    assert no_flash == indexer_mode(TRACE, Capabilities(flash_decode=False), call)
    if mode == "blocks":
        assert no_flash == "dense_mask"
    else:
        assert no_flash == mode


@pytest.mark.parametrize(
    ("opts", "S", "P", "mode"),
    [
        (TRACE, 1, 2051, "blocks"),
        (TRACE, 1, 2050, "update_only"),  # T 2051: nb 512, still dense
        (TRACE, 33, 2051, "prefill_blocks"),
        (TRACE.replace(prefill=False), 33, 2051, "dense_mask"),
        (TRACE.replace(prefill_min_context=32768), 33, 2051, "dense_mask"),
        (TRACE.replace(gather_max_rows=40, prefill=False), 33, 2051, "row_tokens"),
        (TRACE.replace(gather_min_context=16384), 4, 2052, "dense_mask"),
        (TRACE.replace(gather=False), 4, 2052, "dense_mask"),
        (TRACE, 2048, 32768, "prefill_blocks"),
    ],
    ids=["decode", "dense-edge", "large", "prefill-off", "ctx-short", "gather-33", "gather-ctx",
         "gather-off", "p6s0"],
)  # fmt: skip
def test_indexer_mode_examples(opts: QSAOptions, S: int, P: int, mode: str) -> None:
    assert indexer_mode(opts, REF, CallShape(S, P)) == mode


# ---------------------------------------------------------------------------- §5.3 eligibility

# A compiled decode step (p2s0) and the change that breaks exactly one rule.
BASE = dict(raw_backing=(2304, BF16), pooled_backing=(512, BF16), pooled_len=512)
F32 = dict(input_dtype="float32", norm_dtype="float32", raw_backing=(2304, "float32"),
           pooled_backing=(512, "float32"), pooled_len=512)  # fmt: skip
RULE_CASES = [
    ("base-decode", TRACE, REF, 1, 2051, {}, ()),
    ("r1-fused-off", TRACE.replace(fused=False), REF, 1, 2051, {}, (1,)),
    ("r1-compiled-off", TRACE.replace(compiled=False), REF, 1, 2051, {}, (1,)),
    ("r1-no-kernels", TRACE, Capabilities(indexer_kernels=False), 1, 2051, {}, (1,)),
    ("r1-no-core", TRACE, Capabilities(compiled_core=False), 1, 2051, {}, (1,)),
    ("r1-kv-heads", TRACE, REF, 1, 2051, dict(index_kv_heads=2), (1,)),
    ("r1-head-dim", TRACE, REF, 1, 2051, dict(index_head_dim=192), (1,)),
    ("r2-update-in-prefill", TRACE, REF, 4, 1, dict(pooled_len=0), (2,)),
    ("r2-off-decode-phase", TRACE.replace(phase_prefill=False), REF, 4, 1, dict(pooled_len=0), ()),
    ("r3-prefill-33", TRACE, REF, 33, 2051, {}, (3,)),
    ("r3-rows-33", TRACE.replace(gather_max_rows=40, prefill=False), REF, 33, 2051, {}, (3,)),
    ("r3-update-40", TRACE.replace(phase_prefill=False), REF, 40, 0, dict(pooled_len=0), (3,)),
    ("r3-2048-ok", TRACE, REF, 2048, 32768,
     dict(raw_backing=(32768, BF16), pooled_backing=(8192, BF16), pooled_len=8192), ()),
    ("r3-compile-rows", TRACE.replace(prefill_compile_rows=1024), REF, 2048, 32768,
     dict(raw_backing=(32768, BF16), pooled_backing=(8192, BF16), pooled_len=8192), (3,)),
    ("r4-gather-decode", TRACE.replace(gather_decode=True, flash=False), REF, 1, 2051, {}, (4,)),
    ("r4-ok-blocks", TRACE.replace(gather_decode=True), REF, 1, 2051, {}, ()),
    ("r5-norm-dtype", TRACE, REF, 1, 2051, dict(norm_dtype="float16"), (5,)),
    ("r5-raw-dtype", TRACE, REF, 1, 2051, dict(raw_backing=(2304, "float16")), (5,)),
    ("r5-pool-dtype", TRACE, REF, 1, 2051, dict(pooled_backing=(512, "float32")), (5,)),
    ("r5-cap-raw", TRACE, REF, 1, 2051, dict(raw_backing=(2048, BF16)), (5,)),
    ("r5-raw-absent", TRACE, REF, 1, 2051, dict(raw_backing=None), (5,)),
    ("r5-bad-dtype", TRACE, REF, 1, 2051, dict(input_dtype="int8", norm_dtype="int8",
     raw_backing=(2304, "int8"), pooled_backing=(512, "int8")), (5,)),
    ("r6-gap", TRACE, REF, 1, 2051, dict(pooled_len=511), (6,)),
    ("r6-gap-rows", TRACE, REF, 8, 2052, dict(pooled_len=512), (6,)),
    ("r6-window-closes", TRACE, REF, 8, 2052, dict(pooled_len=513), ()),
    ("r7-f32", TRACE, Capabilities(f32_selector=False), 1, 2051, F32, (7,)),
    ("r7-f32-ok", TRACE, REF, 1, 2051, F32, ()),
    ("r7-f32-update", TRACE, Capabilities(f32_selector=False), 1, 2050, F32, ()),
    ("r2-r3-update-40", TRACE, REF, 40, 0, dict(pooled_len=0), (2, 3)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("opts", "caps", "S", "P", "kw", "rules"),
    [c[1:] for c in RULE_CASES],
    ids=[c[0] for c in RULE_CASES],
)
def test_compiled_rules(opts, caps, S: int, P: int, kw: dict, rules: tuple) -> None:
    call = CallShape(S, P)
    kw = {**BASE, **kw}
    mode = indexer_mode(opts, caps, call)
    assert compiled_blockers(opts, caps, call, mode, **kw) == rules
    got = plan_indexer(opts, caps, call, fused_level=4, **kw)
    assert got.compiled == (rules == ()) and got.blockers == rules


@pytest.mark.parametrize(("S", "P"), GRID, ids=[_id(*g) for g in GRID])
def test_compiled_eligibility_grid(S: int, P: int) -> None:
    """A cache kept current by eager calls: only the rules tied to S and the mode decide."""
    call = CallShape(S, P)
    kw = dict(raw_backing=(roundup256(P), BF16) if P else None, pooled_len=P // 4)
    got = plan_indexer(TRACE, REF, call, fused_level=4, **kw)
    if call.decode:
        assert got.compiled
    elif got.mode == "update_only":
        assert got.blockers[0] == 2  # phase_prefill bars multi-row update_only
    else:
        assert got.compiled == (S < 32)
    assert (
        plan_indexer(TRACE.replace(compiled=False), REF, call, fused_level=4, **kw).blockers[0] == 1
    )


# ---------------------------------------------------------------------------- §5.4/§5.5 selection

EAGER = TRACE.replace(compiled=False)
UNFUSED = EAGER.replace(fused=False)
PB, DM, RT = "prefill_blocks", "dense_mask", "row_tokens"
SEL_CASES = [
    # id, opts, caps, S, P, (selection, selector, counts, compiled)
    ("compiled-update", TRACE, REF, 1, 2048, ("none", "compiled", (), True)),
    ("compiled-blocks", TRACE, REF, 1, 2051, ("blocks", "compiled", (), True)),
    ("compiled-rows", TRACE, REF, 4, 2052, (RT, "compiled", (), True)),
    ("compiled-mask", TRACE.replace(flash=False), REF, 1, 2051, (DM, "compiled", (), True)),
    ("compiled-prefill", TRACE, REF, 2048, 32768, (PB, "compiled", ("compiled_selector",), True)),
    ("eager-a-dense", TRACE, REF, 4, 1, ("none", "none", (), False)),
    ("eager-b-kernel", TRACE, REF, 33, 2051, (PB, "prefill_kernel", ("metal_selector",), False)),
    ("eager-b-oracle", TRACE, Capabilities(prefill_selector=False), 33, 2051,
     (PB, "prefill_oracle", ("eager_selector",), False)),
    ("legacy-blocks", EAGER, REF, 1, 2051, ("blocks", "legacy", (), False)),
    ("legacy-rows", EAGER, REF, 4, 2052, (RT, "legacy", (), False)),
    ("legacy-mask-decode", EAGER.replace(flash=False), REF, 1, 2084, (DM, "legacy", (), False)),
    ("legacy-mask-rows", EAGER.replace(gather=False), REF, 4, 2085, (DM, "legacy", (), False)),
    ("legacy-ignores-tiles", EAGER.replace(tile_rows=2), REF, 4, 2052, (RT, "legacy", (), False)),
    ("oracle-unfused-blocks", UNFUSED, REF, 1, 2051, ("blocks", "oracle", (), False)),
    ("oracle-no-kernels", TRACE, PORTABLE, 1, 2051, (DM, "oracle", (), False)),
    ("oracle-gd-flash", EAGER.replace(gather_decode=True), REF, 1, 2051,
     ("blocks", "oracle", (), False)),
    ("oracle-token-list", EAGER.replace(gather_decode=True, flash=False), REF, 1, 2051,
     ("token_list", "oracle", ("decode_gather",), False)),
    ("oracle-rows", UNFUSED, REF, 4, 2052, (RT, "oracle", (), False)),
    ("oracle-tiled", UNFUSED.replace(tile_rows=2), REF, 4, 2052, (DM, "oracle", (), False)),
    ("oracle-33-rows", EAGER.replace(prefill=False, gather_max_rows=40), REF, 33, 2051,
     (RT, "oracle", (), False)),
    ("oracle-33-mask", EAGER.replace(prefill=False), REF, 33, 2051, (DM, "oracle", (), False)),
    # S == prefill_min_rows already bars the legacy selector (visible through tiling).
    ("legacy-31-tiled", EAGER.replace(prefill=False, gather_max_rows=40, tile_rows=2), REF, 31,
     2051, (RT, "legacy", (), False)),
    ("oracle-32-tiled", EAGER.replace(prefill=False, gather_max_rows=40, tile_rows=2), REF, 32,
     2051, (DM, "oracle", (), False)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("opts", "caps", "S", "P", "want"), [c[1:] for c in SEL_CASES], ids=[c[0] for c in SEL_CASES]
)
def test_selection_branches(opts, caps, S: int, P: int, want: tuple) -> None:
    kw = dict(raw_backing=(8192, BF16), pooled_backing=(2048, BF16), pooled_len=P // 4)
    if S == 2048:
        kw = dict(raw_backing=(32768, BF16), pooled_backing=(8192, BF16), pooled_len=8192)
    got = plan_indexer(opts, caps, CallShape(S, P), fused_level=4, **kw)
    assert (got.selection, got.selector, got.counts, got.compiled) == want
    assert got.ensure_mirror == (got.selector == "oracle")


def test_plan_indexer_prep_and_source() -> None:
    call = CallShape(1, 0)
    assert plan_indexer(TRACE, REF, call, fused_level=4).source == "qk_rows"
    for level in (0, 3):
        assert plan_indexer(TRACE, REF, call, fused_level=level).source == "hidden"
    assert plan_indexer(TRACE, REF, call, fused_level=0).fused_prep is True
    assert plan_indexer(TRACE, PORTABLE, call, fused_level=0).fused_prep is False
    with pytest.raises(ValueError, match="fused_level"):
        plan_indexer(TRACE, REF, call, fused_level=2)


# ---------------------------------------------------------------------------- §5.6 consumers

PF_OPTS = TRACE.replace(flash_min=2049)
CONSUMER_CASES = [
    # id, opts, caps, S, P, selection, kw, (consumers, sdpa_mask, counts)
    ("none-decode", TRACE, REF, 1, 5, "none", {}, (("sdpa",), "none", ())),
    ("none-rows", TRACE, REF, 4, 5, "none", {}, (("sdpa",), "causal", ())),
    ("blocks", TRACE, REF, 1, 2051, "blocks", {}, (("flash",), "", ("decode_flash_skip",))),
    ("prefill-flash", PF_OPTS, REF, 33, 2054, "prefill_blocks", {},
     (("prefill_flash",), "", ("flash_kernel",))),
    ("prefill-below-flash-min", TRACE, REF, 33, 2051, "prefill_blocks", {},
     (("prefill_gather", "rows_gather"), "", ("gather_tier",))),
    ("prefill-few-rows", PF_OPTS.replace(prefill_min_rows=64), REF, 33, 2054, "prefill_blocks", {},
     (("prefill_gather", "rows_gather"), "", ("gather_tier",))),
    ("prefill-dense-nb", PF_OPTS.replace(flash_min=1024), REF, 33, 2010, "prefill_blocks", {},
     (("prefill_gather", "rows_gather"), "", ("gather_tier",))),
    ("prefill-no-capability", PF_OPTS, Capabilities(prefill_flash=False), 33, 2054,
     "prefill_blocks", {}, (("prefill_gather", "rows_gather"), "", ("gather_tier",))),
    ("prefill-no-contract", PF_OPTS, REF, 33, 2054, "prefill_blocks",
     dict(prefill_flash_contract=False), (("prefill_gather", "rows_gather"), "", ("gather_tier",))),
    ("prefill-dense-fallback", TRACE.replace(prefill_gather=False), REF, 33, 2051, "prefill_blocks",
     {}, (("dense_mask", "sdpa"), "dense_mask", ("dense_fallback",))),
    ("row-tokens", TRACE, REF, 4, 2052, "row_tokens", {}, (("rows_gather",), "", ())),
    ("token-list", TRACE, REF, 1, 2051, "token_list", {}, (("sdpa",), "token_list", ())),
    ("mask-decode", TRACE, REF, 1, 2084, "dense_mask", {},
     (("sdpa",), "dense_mask", ("decode_dense_mask",))),
    ("mask-rows", TRACE, REF, 4, 2085, "dense_mask", {}, (("sdpa",), "dense_mask", ())),
    ("no-indexer", TRACE, REF, 3, 0, "row_tokens", dict(has_indexer=False),
     (("sdpa",), "causal", ())),
    ("vision-table-decode", TRACE, REF, 1, 2051, "blocks", dict(vision="table"),
     (("sdpa",), "none", ())),
    ("vision-no-axes-rows", TRACE, REF, 4, 2052, "row_tokens", dict(vision="no_axes"),
     (("sdpa",), "causal", ())),
    ("vision-sparse-keeps", TRACE.replace(vision_sparse=True), REF, 4, 2052, "row_tokens",
     dict(vision="table"), (("rows_gather",), "", ())),
]  # fmt: skip


@pytest.mark.parametrize(
    ("opts", "caps", "S", "P", "selection", "kw", "want"),
    [c[1:] for c in CONSUMER_CASES],
    ids=[c[0] for c in CONSUMER_CASES],
)
def test_consumer_branches(opts, caps, S: int, P: int, selection: str, kw: dict, want) -> None:
    kw = {"has_indexer": True, **kw}
    got = plan_consumers(opts, caps, CallShape(S, P), selection, **kw)
    assert (got.consumers, got.sdpa_mask, got.counts) == want


@pytest.mark.parametrize(
    ("S", "selection", "kw"),
    [(1, "bogus", {}), (4, "blocks", {}), (4, "token_list", {}), (1, "prefill_blocks", {}),
     (1, "none", dict(vision="video"))],
    ids=["unknown", "blocks-rows", "list-rows", "prefill-decode", "bad-vision"],
)  # fmt: skip
def test_consumers_reject(S: int, selection: str, kw: dict) -> None:
    with pytest.raises(ValueError, match="plan_consumers"):
        plan_consumers(TRACE, REF, CallShape(S, 2051), selection, has_indexer=True, **kw)


@pytest.mark.parametrize(("S", "P"), GRID, ids=[_id(*g) for g in GRID])
def test_routing_grid_end_to_end(S: int, P: int) -> None:
    call = CallShape(S, P)
    ip = plan_indexer(TRACE, REF, call, fused_level=4, raw_backing=(4096, BF16), pooled_len=P // 4)
    cp = plan_consumers(TRACE, REF, call, ip.selection, has_indexer=True)
    assert (cp.consumers == ("flash",)) == (S == 1 and call.nb > 512)
    if call.nb <= 512:
        assert cp.consumers == ("sdpa",) and cp.sdpa_mask == ("none" if S == 1 else "causal")
    assert set(ordered_counts(ip.counts + cp.counts, trace_only=False)) <= set(LIBRARY_COUNTERS)


def test_prefill_flash_contract() -> None:
    ok = dict(n_heads=24, kv_heads=2, head_dim=256, block_topk=512, dtype=BF16, scale=1 / 16)
    assert prefill_flash_contract(**ok) and prefill_flash_contract(**{**ok, "dtype": "float16"})
    for change in (dict(n_heads=16), dict(kv_heads=4), dict(head_dim=128), dict(block_topk=256),
                   dict(dtype="float32"), dict(scale=0.1)):  # fmt: skip
        assert not prefill_flash_contract(**{**ok, **change})


# ---------------------------------------------------------------------------- §6 core


@pytest.mark.parametrize(
    ("caps", "q", "pool", "want"),
    [(REF, BF16, BF16, "mpp"), (REF, "float16", "float16", "mpp"), (REF, BF16, "float16", "mlx"),
     (REF, "float32", "float32", "mlx"),
     (Capabilities(fused_score_producer=False), BF16, BF16, "mlx")],
    ids=["bf16", "f16", "mixed", "f32", "no-capability"],
)  # fmt: skip
def test_prefill_score_producer(caps, q: str, pool: str, want: str) -> None:
    assert prefill_score_producer(caps, q, pool) == want


def test_prefill_score_producer_needs_the_geometry() -> None:
    assert prefill_score_producer(REF, BF16, BF16, n_heads=8) == "mlx"
    assert prefill_score_producer(REF, BF16, BF16, head_dim=64) == "mlx"


@pytest.mark.parametrize(
    ("mode", "S", "cap_pool", "producer", "want"),
    [
        ("update_only", 2048, 16384, "none", 0),
        ("blocks", 1, 1024, "none", 1),
        ("row_tokens", 4, 1024, "none", 4),  # pool 1024 -> 8192 >= S: chunk = S
        ("dense_mask", 10000, 1024, "none", 8192),
        ("row_tokens", 4096, 16384, "none", 512),  # pool 16384 -> 512
        ("dense_mask", 4096, 65536, "none", 128),  # pool 65536 -> 128
        ("prefill_blocks", 2048, 16384, "mpp", 2048),  # N 16384 mpp -> 2048 (p6s0)
        ("prefill_blocks", 4096, 16384, "mpp", 2048),
        ("prefill_blocks", 4096, 65536, "mpp", 512),  # N 65536 mpp -> 512
        ("prefill_blocks", 4096, 65536, "mlx", 96),  # mlx: 102 -> 96
        ("prefill_blocks", 103, 65536, "mlx", 96),  # c 102 < S: rounded
        ("prefill_blocks", 40, 65536, "mlx", 40),  # c == S: no rounding
        ("prefill_blocks", 4096, 1 << 22, "mpp", 8),  # c < 32: no rounding
        ("prefill_blocks", 4096, 1 << 30, "mlx", 1),  # at least one row
    ],
    ids=lambda v: str(v),
)
def test_selector_chunk_rows(mode: str, S: int, cap_pool: int, producer: str, want: int) -> None:
    assert selector_chunk_rows(mode, S, cap_pool, producer=producer) == want


def test_selector_chunk_rows_workspace_and_errors() -> None:
    assert selector_chunk_rows("prefill_blocks", 4096, 16384, producer="mpp",
                               prefill_workspace=1 << 26) == 1024  # fmt: skip
    with pytest.raises(ValueError, match="producer"):
        selector_chunk_rows("prefill_blocks", 33, 1024)
    with pytest.raises(ValueError, match="mode"):
        selector_chunk_rows("token_list", 1, 1024)
    with pytest.raises(ValueError, match="cap_pool"):
        selector_chunk_rows("blocks", 1, 0)


@pytest.mark.parametrize(
    ("args", "want"),
    [((0, 1, 0, 256, 256), 0), ((1, 1, 0, 256, 256), 0), ((513, 1, 512, 4096, 1024), 512),
     ((514, 1, 513, 4096, 1024), 513), ((8704, 512, 8192, 65536, 16384), 8192),
     ((9, 9, 1, 256, 256), 0), ((514, 1, 514, 4096, 1024), 513),
     ((20, 4, 10, 4096, 1024), 10), ((300, 200, 300, 1024, 300), 56),
     ((300, 200, 300, 4096, 250), 50)],
    ids=["p0s0", "T<4", "p2s0", "p2s1", "p6s0", "prefix-33", "rewrite-last", "gap-binds",
         "raw-binds", "pool-binds"],
)  # fmt: skip
def test_staging_window_start(args: tuple, want: int) -> None:
    assert staging_window_start(*args) == want


@pytest.mark.parametrize(("S", "P"), GRID, ids=[_id(*g) for g in GRID])
def test_staging_window_closes_the_gap(S: int, P: int) -> None:
    """After the reservation, a call passing rule 6 re-pools [pooled_len, nb) in the backings."""
    call = CallShape(S, P)
    for pooled_len in range(max(0, call.nb - call.m), P // 4 + 1):
        raw, pool = compiled_reservation(roundup256(P), roundup256(P // 4), P, S)
        start = staging_window_start(call.nb, call.m, pooled_len, raw, pool)
        assert 0 <= start <= pooled_len and start + call.m >= call.nb
        assert start + call.m <= pool and 4 * (start + call.m) <= raw


P6_LABEL = (
    "qk_rows:prefill_blocks:s2048:raw65536:pool16384:out0:scorempp:chunk2048:"
    "mlx.core.bfloat16/mlx.core.bfloat16"
)


def _key(**kw) -> CompiledKey:
    base = dict(source="qk_rows", mode="prefill_blocks", rows=2048, input_width=640,
                input_dtype=BF16, cap_raw=65536, cap_pool=16384, raw_dtype=BF16,
                pooled_dtype=BF16, caps=REF, q_dtype=BF16)  # fmt: skip
    return make_compiled_key(**{**base, **kw})


def test_compiled_key_label_and_fields() -> None:
    key = _key()
    assert key.label == P6_LABEL and key.bucket_label == "raw65536:pool16384:out0"
    assert [f.name for f in dataclasses.fields(CompiledKey)] == list(key.to_dict())[:-1]
    d = key.to_dict()
    assert d["input_shape"] == [1, 2048, 640] and d["raw_shape"] == [1, 65536, 128]
    assert d["input_dtype"] == "mlx.core.bfloat16" and d["label"] == P6_LABEL
    assert (
        _key(caps=Capabilities(fused_score_producer=False)).label.endswith(
            "scoremlx:chunk409:mlx.core.bfloat16/mlx.core.bfloat16"
        )
        is False
    )  # chunk 409 is rounded to 32 rows
    assert _key(caps=Capabilities(fused_score_producer=False)).selector_chunk_rows == 384


def test_compiled_key_dense_and_source() -> None:
    key = _key(
        source="hidden", mode="dense_mask", rows=1, input_width=64, cap_raw=4096, cap_pool=1024
    )
    assert key.dense_output_tokens == (1024 + 1) * 4
    assert key.label == (
        "hidden:dense_mask:s1:raw4096:pool1024:out4100:scorenone:chunk1:"
        "mlx.core.bfloat16/mlx.core.bfloat16"
    )
    with pytest.raises(ValueError, match="source"):
        _key(source="qk")


def test_compiled_keys_equal_fixture_entries() -> None:
    """Every key in the fixture is reproduced from its label's parts."""
    seen = {}
    for line in FIXTURE.read_text().split("\n"):
        core = json.loads(line)["core"]
        for entry in core["compiled_keys"] if core else ():
            seen[entry["label"]] = entry
    assert len(seen) == 10
    for label, entry in seen.items():
        key = _key(source=entry["source"], mode=entry["mode"], rows=entry["input_shape"][1],
                   input_width=entry["input_shape"][2], cap_raw=entry["raw_shape"][1],
                   cap_pool=entry["pooled_shape"][1])  # fmt: skip
        assert key.to_dict() == entry and key.label == label


def test_core_receipt_counts() -> None:
    r = CoreReceipt()
    blocks = _key(mode="blocks", rows=1, cap_raw=4096, cap_pool=1024)
    rows = _key(mode="row_tokens", rows=4, cap_raw=4096, cap_pool=1024)
    assert r.record(blocks) is True and r.record(rows) is True and r.record(blocks) is False
    d = r.to_dict()
    assert (d["calls"], d["traces"], d["entry_count"], d["selector_dispatches"]) == (3, 2, 2, 3)
    assert d["modes"] == {"blocks": 2, "prefill_blocks": 0, "dense_mask": 0, "row_tokens": 1,
                          "update_only": 0}  # fmt: skip
    assert d["buckets"] == {"raw4096:pool1024:out0": 3} and d["capacity_transitions"] == 0
    assert [k["label"] for k in d["compiled_keys"]] == sorted([blocks.label, rows.label])


def test_core_receipt_dispatches_transitions_producers() -> None:
    r = CoreReceipt()
    r.record(_key(mode="update_only", rows=1, cap_raw=256, cap_pool=256))
    r.record(_key(caps=Capabilities(fused_score_producer=False)))  # chunk 384: ceil(2048/384)
    r.record(_key(mode="row_tokens", rows=4, source="hidden", input_width=64), compiled=False)
    r.record(_key(mode="update_only", rows=1, cap_raw=256, cap_pool=256))
    d = r.to_dict(prefill_workspace=1 << 20)
    assert d["selector_dispatches"] == 0 + 6 + 1 + 0
    assert d["capacity_transitions"] == 2  # 256/256 -> 65536/16384 -> (same) -> 256/256
    assert d["prefill_score_producers"] == {"mpp": 0, "mlx": 1}
    assert (d["compiled_calls"], d["hidden_calls"], d["qk_rows_calls"]) == (3, 1, 3)
    assert list(d["buckets"]) == ["raw256:pool256:out0", "raw65536:pool16384:out0"]
    assert d["prefill_score_workspace_bytes"] == 1 << 20


def test_core_receipt_layout_matches_fixture() -> None:
    first = json.loads(FIXTURE.read_text().split("\n")[0])["core"]
    r = CoreReceipt()
    r.record(_key(mode="update_only", rows=1, cap_raw=256, cap_pool=256))
    d = r.to_dict()
    assert list(d) == list(first)
    assert json.dumps(d) == json.dumps(first)  # same values and value types (1.0 stays a float)


def test_native_capabilities_per_backend():
    from mlx_qsa import plan

    for backend in ("cpu", "metal", "cuda"):
        assert plan.Capabilities.native(backend) == plan.Capabilities.portable()
    with pytest.raises(ValueError, match="backend"):
        plan.Capabilities.native("tpu")
