"""Conformance: the fixture's non-hash fields re-derived from `mlx_qsa.plan` alone (RUNTIME §9).

The int-level cache model and the profile table live in `mlx_qsa.profiles`; here every one of
the 56 recorded records is compared field by field with what that model predicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlx_qsa.plan import Capabilities
from mlx_qsa.profiles import NON_HASH_KEYS, PROFILES, RECORD_KEYS, expected_records

FIXTURE = Path(__file__).parent / "data" / "qsa_trace_m5pro.jsonl"


def _load() -> list[dict]:
    text = FIXTURE.read_text()
    assert not text.endswith("\n"), "§9.5: no newline after the last record"
    return [json.loads(line) for line in text.split("\n")]


RECORDED = _load()
EXPECTED = expected_records()
IDS = [
    f"pass{1 + i // 28}-{r['kernel'].removeprefix('qsa_attention_')}"
    for i, r in enumerate(RECORDED)
]


def test_record_count_and_order() -> None:
    assert len(RECORDED) == len(EXPECTED) == 56
    assert [r["kernel"] for r in RECORDED] == [e["kernel"] for e in EXPECTED]
    assert [r["options"]["tf32"] for r in RECORDED] == [True] * 28 + [False] * 28


def test_fixture_key_order_is_the_schema() -> None:
    for rec in RECORDED:
        assert tuple(rec) == RECORD_KEYS


@pytest.mark.parametrize("index", range(56), ids=IDS)
@pytest.mark.parametrize("key", NON_HASH_KEYS)
def test_field_matches_fixture(index: int, key: str) -> None:
    assert EXPECTED[index][key] == RECORDED[index][key]


@pytest.mark.parametrize("index", range(56), ids=IDS)
def test_record_serialises_identically(index: int) -> None:
    """Key order and value types too: the JSON text of the hash-free fields is identical."""
    rec = {k: RECORDED[index][k] for k in NON_HASH_KEYS}
    dump = json.dumps(EXPECTED[index], separators=(",", ":"))
    assert dump == json.dumps(rec, separators=(",", ":"))


def test_shapes_count_matches_present_states() -> None:
    for rec in EXPECTED:
        assert len(rec["shapes"]) == 1 + sum(rec["state_present"])


def test_passes_differ_only_in_tf32() -> None:
    for a, b in zip(EXPECTED[:28], EXPECTED[28:], strict=True):
        assert a["options"] == {**b["options"], "tf32": True}
        assert {k: v for k, v in a.items() if k != "options"} == {
            k: v for k, v in b.items() if k != "options"
        }


def test_profiles_cover_the_fixture() -> None:
    assert [p.profile for p in PROFILES] == list(range(10))
    recorded = [(r["profile"], r["rows"], r["pos"]) for r in RECORDED[:28]]
    assert recorded == [(p.profile, S, P) for p in PROFILES for S, P in p.calls]


def test_portable_capabilities_change_the_routing() -> None:
    """The simulator really reads the capability profile: `portable` disables the core."""
    portable = expected_records(Capabilities.portable())
    assert all(r["core"] is None for r in portable)
    diff = [r["kernel"] for r, e in zip(portable, EXPECTED, strict=True) if r != e]
    assert "qsa_attention_p0_s0" in diff and "qsa_attention_p6_s0" in diff
    p2s2 = next(r for r in portable if r["kernel"] == "qsa_attention_p2_s2")
    # No prefill_flash routine, no selector kernel: gather tier, and metal_selector not counted.
    assert p2s2["consumers"] == ["prefill_gather", "rows_gather"]
    assert p2s2["counts"] == {"gather_tier": 1}
