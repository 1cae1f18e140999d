"""The benchmark scripts' pure parts: the timeline's per-step split (benchmarks/timeline.py) and
the tables BENCHMARKS.md takes from bench documents (benchmarks/summarize.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_timeline_splits_each_step_and_ties_a_graphs_kernels_to_its_launch():
    tl = _script("timeline")
    trace = {"traceEvents": [
        _x("user_annotation", "d:0", 0, 200),
        _x("user_annotation", "build", 2, 40),
        _x("user_annotation", "eval", 45, 150),
        _x("cuda_runtime", "cudaGraphLaunch", 60, 8, corr=7),
        _x("kernel", "score", 70, 30, corr=7),  # one graph launch, two kernels
        _x("kernel", "attend", 101, 12, corr=7),
        _x("cuda_runtime", "cudaEventSynchronize", 80, 110, corr=8),
        _x("user_annotation", "d:1", 300, 100),  # a second step: its own launch
        _x("cuda_runtime", "cudaGraphLaunch", 310, 5, corr=9),
        _x("kernel", "score", 320, 31, corr=9),
        _x("kernel", "other process", 50, 5, corr=99),  # launched by no step's call
        {"ph": "i", "cat": "overhead", "name": "marker", "ts": 0},
    ]}  # fmt: skip
    first, second = tl.steps_of(trace, "d")
    assert (first["wall_us"], first["build_us"], first["eval_us"]) == (200, 40, 150)
    assert [k for k, _ in first["kernels"]] == ["score", "attend"]
    assert first["gpu_busy_us"] == 42 and first["gpu_span_us"] == 43  # 70 .. 113
    assert first["first_launch_after_us"] == 70
    assert first["last_kernel_end_before_us"] == 200 - 113  # the wake-up and what follows it
    assert first["api"] == {"cudaEventSynchronize": (1, 110), "cudaGraphLaunch": (1, 8)}
    assert second["kernels"] == [("score", 31)] and second["build_us"] == 0.0
    med = tl.median_row([first, second])
    assert med["wall_us"] == 150 and med["gpu_span_us"] == pytest.approx(37)
    assert med["api_median_us"]["cudaGraphLaunch"] == 6.5


def _doc(timings: dict[str, float]) -> dict:
    return {
        "points": [
            {"prefix": 32768, "rows": 2048,
             "timings": {k: {"median_us": v} for k, v in timings.items()}}
        ]
    }  # fmt: skip


def test_prefill_table_compares_like_with_like():
    sm = _script("summarize")
    table = sm.prefill_table(_doc({
        "qsa_cuda_selection_attention": 2570.0, "qsa_cuda_selection_attention_gpu": 2040.0,
        "qsa_cuda_selection_attention_spin": 2312.0,
        "qsa_cuda_layer": 3670.0, "qsa_cuda_layer_gpu": 2570.0,
        "qsa_portable_layer": 61710.0, "torch_dense_causal_sdpa": 5290.0,
        "torch_dense_causal_sdpa_sync": 5780.0,
    }))  # fmt: skip
    row = table.splitlines()[2]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["32K", "2048"]
    assert cells[2:10] == ["2.57", "2.04", "2.31", "3.67", "2.57", "61.71", "5.29", "5.78"]
    # events against our GPU clock, synchronized torch against our eval and spin-wait steps
    assert cells[10] == "2.59 / 2.25 / 2.50" and cells[11] == "2.06 / 1.57"
    # an older document: neither GPU-clock entries nor torch synchronized
    old = sm.prefill_table(_doc({
        "qsa_cuda_selection_attention": 2490.0, "qsa_cuda_layer": 3730.0,
        "qsa_portable_layer": 62290.0, "torch_dense_causal_sdpa": 5420.0,
    }))  # fmt: skip
    cells = [c.strip() for c in old.splitlines()[2].strip("|").split("|")]
    assert cells[3] == cells[4] == cells[9] == "–" and cells[10] == "– / – / –"


def test_large_lane_table_sets_the_two_routings_side_by_side():
    sm = _script("summarize")
    doc = _doc({
        "qsa_cuda_layer": 5120.0, "qsa_cuda_layer_gpu": 4800.0,
        "qsa_cuda_layer_large": 2900.0, "qsa_cuda_layer_large_gpu": 2400.0,
        "torch_dense_causal_sdpa": 1700.0,
    })  # fmt: skip
    t = doc["points"][0]["timings"]
    t["qsa_cuda_layer"] |= {"selector": "oracle", "consumers": ["sdpa"]}
    t["qsa_cuda_layer_large"] |= {"selector": "compiled_core", "consumers": ["prefill_flash"]}
    table = sm.prefill_table(doc).split("\n\n")[1]
    cells = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    assert cells[:2] == ["32K", "oracle + sdpa → compiled_core + prefill_flash"]
    assert cells[2:7] == ["4.80", "2.40", "5.12", "2.90", "1.70"]
    assert cells[7] == "2.00 / 1.77" and cells[8] == "0.71"
    # documents without the large lane have no second table
    assert "\n\n" not in sm.prefill_table(_doc({"qsa_cuda_layer": 1.0}))


def test_fail_log_keeps_each_failure_as_it_happens(tmp_path, monkeypatch):
    """conftest's `QSA_FAIL_LOG` hook (device runs stopped at their time limit keep the
    reasons): a failed report is appended at once, a passed one leaves no trace."""
    from types import SimpleNamespace

    from conftest import pytest_runtest_logreport

    log = tmp_path / "failures.txt"
    monkeypatch.setenv("QSA_FAIL_LOG", str(log))
    report = SimpleNamespace(failed=False, nodeid="t.py::ok", when="call", longreprtext="")
    pytest_runtest_logreport(report)
    assert not log.exists()
    for name in ("a", "b"):
        report = SimpleNamespace(
            failed=True, nodeid=f"t.py::{name}", when="call", longreprtext=f"E  {name} failed"
        )
        pytest_runtest_logreport(report)
    assert log.read_text() == (
        "== t.py::a (call)\nE  a failed\n\n== t.py::b (call)\nE  b failed\n\n"
    )
    monkeypatch.delenv("QSA_FAIL_LOG")
    pytest_runtest_logreport(report)
    assert log.read_text().count("==") == 2


def test_selection_diff_scores_and_ulps():
    """benchmarks/selection_diff.py: its float64 scores are QSA.md §8.2's (the portable float32
    scores lie within float32 rounding of them), and distances count float32 ulps."""
    import mlx.core as mx
    import numpy as np

    from mlx_qsa.bench import DecodeSet
    from mlx_qsa.config import QSAConfig
    from mlx_qsa.indexer import block_penalty, score_blocks

    sd = _script("selection_diff")
    assert sd.ulps_apart(1.0, 1.0 + 2**-23) == pytest.approx(1.0)
    assert sd.ulps_apart(3.0, 3.0) == 0.0
    assert sd.ulps_apart(2.0, 2.0 + 2**-21) == pytest.approx(2.0)  # ulp 2^-22 in [2, 4)
    cfg = QSAConfig()
    s = DecodeSet(cfg, 2112, 64, seed=3)
    keys_t = s.pooled[0].astype(mx.float32).T
    f32 = np.array(score_blocks(s.index_q, keys_t, block_penalty(keys_t.shape[1])))
    for row in (0, 63):
        nb = (2048 + row + 1) // 4
        exact = sd.float64_scores(s, row, nb)
        assert exact.shape == (nb,)
        np.testing.assert_allclose(f32[row, :nb], exact, rtol=2e-6, atol=1e-6)
        assert np.max(np.abs(f32[row, :nb] - exact)) > 0  # float32, not float64


def test_prompt_table_counts_each_entrys_routes():
    sm = _script("summarize")
    dense, masked = [["none", "sdpa"]], [["oracle", "sdpa"]]
    timings = {
        "qsa_cuda_prompt": {"median_us": 70000.0, "routes": dense + masked * 15},
        "qsa_cuda_prompt_gpu": {"median_us": 68000.0},
        "qsa_cuda_prompt_large": {
            "median_us": 40000.0,
            "routes": dense + masked * 2 + [["compiled", "prefill_flash"]] * 13,
        },
        "qsa_cuda_prompt_large_gpu": {"median_us": 34000.0},
        "torch_dense_causal_sdpa": {"median_us": 17000.0},
    }
    doc = {"points": [{"prompt": 32768, "chunks": [2048] * 16, "timings": timings}]}
    cells = [c.strip() for c in sm.prompt_table(doc).splitlines()[2].strip("|").split("|")]
    assert cells[:3] == [
        "32K",
        "16",
        "1 × none + sdpa, 15 × oracle + sdpa; "
        "1 × none + sdpa, 2 × oracle + sdpa, 13 × compiled + prefill_flash",
    ]
    assert cells[3:8] == ["68.00", "34.00", "70.00", "40.00", "17.00"]
    assert cells[8] == "2.00 / 1.75" and cells[9] == "0.50"


def test_select_phases_reads_a_rows_stamps():
    sp = _script("select_phases")
    clocks = [100, 400, 900, 1000, 1300, 1350, 1350, 1400, 1420, 1500]
    ph = sp.phase_cycles(clocks + [713] + [0] * 5)
    assert ph["own_scoring"] == 300 and ph["wait_for_others"] == 500
    assert ph["candidate_scan"] == 300 and ph["tie_select"] == 0 and ph["writes"] == 80
    assert ph["total"] == 1400 and ph["candidates"] == 713
    assert sum(ph[p] for p in sp.PHASES) == ph["total"]
    assert sp.phase_cycles(clocks + [0] * 6) is None  # a dense row: no phases
    garbage = [5, 3] + clocks[2:]  # slots never written hold whatever was there
    assert sp.phase_cycles(garbage + [713] + [0] * 5) is None
