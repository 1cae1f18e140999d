"""`mlx-qsa sweep`: schema against the reference fixture, metrics, grid, rasterisation, CLI."""

from __future__ import annotations

import io
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mlx_qsa import sweep
from mlx_qsa.cli import main
from mlx_qsa.kernels import gemm
from mlx_qsa.kernels.gemm import MAX_DYNAMIC_SMEM, kernel_text, plan_gemm, tile_coords

FIXTURE = Path(__file__).parent / "data" / "qkv_tile_sweep_m5pro.json"


@pytest.fixture(scope="module")
def fixture_text() -> str:
    return FIXTURE.read_text()


@pytest.fixture(scope="module")
def fixture(fixture_text) -> dict:
    return json.loads(fixture_text)


@pytest.fixture(scope="module")
def small_sweep(tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("sweep") / "small.json"
    rc = main(["sweep", "--shape", "64,32", "--tokens", "37", "--no-extra", "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    return text, json.loads(text)


def _backend_key(env: dict) -> str:
    keys = [k for k in env if k in ("cuda", "metal", "cpu")]
    assert len(keys) == 1, f"exactly one backend block expected, got {list(env)}"
    return keys[0]


# ---- schema ---------------------------------------------------------------------------------


def test_fixture_serialization_is_the_reference_rule(fixture_text, fixture):
    assert sweep.serialize(fixture) == fixture_text


def test_schema_keys_order_and_types(small_sweep, fixture):
    _, doc = small_sweep
    assert list(doc) == list(fixture)
    env, fenv = doc["environment"], fixture["environment"]
    backend = _backend_key(env)
    assert [k if k != backend else "<backend>" for k in env] == [
        k if k != "metal" else "<backend>" for k in fenv
    ]
    assert list(env[backend]) == list(fenv["metal"])
    for key, value in env[backend].items():
        # A backend may not report a key (then null); what it reports has the fixture's type.
        assert value is None or type(value) is type(fenv["metal"][key]), key
    assert isinstance(env["platform"], str) and isinstance(env["machine"], str)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env["versions"].items())
    order = list(sweep.VERSION_PACKAGES)
    assert [order.index(k) for k in env["versions"]] == sorted(
        order.index(k) for k in env["versions"]
    )
    assert "mlx" in env["versions"] and "numpy" in env["versions"]
    assert env["precision_environment"] == {
        "MLX_ENABLE_TF32": "0",
        "MLX_CONV_WINOGRAD": "0",
    } or all(isinstance(v, str) for v in env["precision_environment"].values())
    assert list(env["precision_environment"]) == list(fenv["precision_environment"])
    for key in ("warmup", "repeats", "scope"):
        assert type(doc[key]) is type(fixture[key])
    assert (doc["warmup"], doc["repeats"]) == (2, 5)

    ftrial = fixture["trials"][0]
    for trial in doc["trials"]:
        assert list(trial) == list(ftrial)
        for key, value in trial.items():
            assert type(value) is type(ftrial[key]), key
        assert len(trial["tile"]) == 3 and all(type(v) is int for v in trial["tile"])
        assert len(trial["samples_ms"]) == 5
        assert all(type(v) is float for v in trial["samples_ms"])
        assert trial["median_ms"] == sorted(trial["samples_ms"])[2]
        assert trial["min_ms"] == min(trial["samples_ms"])
        assert trial["max_ms"] == max(trial["samples_ms"])
        assert (trial["operator"], trial["tokens"]) == ("gemm.k64_n32", 37)


def test_baseline_trial_first(small_sweep):
    _, doc = small_sweep
    base = doc["trials"][0]
    assert (base["tile"], base["simdgroups"], base["walk_m"]) == ([0, 0, 0], 0, 0)
    assert (base["max_abs"], base["relative_rmse"], base["equal_fraction"]) == (0.0, 0.0, 1.0)


def test_serialization_rules(small_sweep):
    text, doc = small_sweep
    assert "\n" not in text and not text.endswith(" ")
    assert text == json.dumps(doc, indent=0).replace("\n", " ")
    assert '"tile": [ 0, 0, 0 ]' in text
    assert text.startswith('{ "environment": { "platform": ')


def test_cpu_runs_baseline_only_and_says_why(tmp_path, capsys):
    import mlx.core as mx

    if mx.cuda.is_available():
        pytest.skip("CUDA present: custom trials run (covered by test_gemm_cuda.py)")
    out = tmp_path / "cpu.json"
    assert (
        main(
            [
                "sweep",
                "--op",
                "indexer.qk_proj",
                "--tokens",
                "5",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "need MLX with CUDA" in err and "baseline only" in err
    doc = json.loads(out.read_text())
    assert len(doc["trials"]) == 1
    assert doc["trials"][0]["operator"] == "indexer.qk_proj"
    assert "cpu" in doc["environment"] or "metal" in doc["environment"]


def test_extra_block_comes_after_the_schema_keys(tmp_path):
    out = tmp_path / "extra.json"
    main(["sweep", "--shape", "64,32", "--tokens", "3", "--repeats", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert list(doc)[:5] == ["environment", "warmup", "repeats", "scope", "trials"]
    assert set(doc) - {"environment", "warmup", "repeats", "scope", "trials"} <= {"extra"}
    assert "steady" not in doc.get("extra", {})  # off unless asked for


def test_steady_block(tmp_path):
    out = tmp_path / "steady.json"
    argv = ["sweep", "--shape", "64,32", "--tokens", "3", "--repeats", "1", "--steady", "3x2"]
    assert main([*argv, "--out", str(out)]) == 0
    steady = json.loads(out.read_text())["extra"]["steady"]
    assert "3 back-to-back calls" in steady["method"] and "2 rounds" in steady["method"]
    (base,) = [e for e in steady["entries"] if e["config"] == "baseline"]
    assert len(base["samples_ms"]) == 2 and all(s > 0 for s in base["samples_ms"])
    assert base["vs_baseline"] == 1.0
    assert base["median_ms"] == float(np.median(base["samples_ms"]))


@pytest.mark.parametrize("graphs", [None, "0"])
def test_steady_block_records_the_cuda_graphs_variable(tmp_path, monkeypatch, graphs):
    if graphs is None:
        monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", graphs)
    out = tmp_path / "steady.json"
    argv = ["sweep", "--shape", "64,32", "--tokens", "3", "--repeats", "1", "--steady", "2x1"]
    assert main([*argv, "--out", str(out)]) == 0
    extra = json.loads(out.read_text())["extra"]
    assert extra["timing_variables"] == {"MLX_USE_CUDA_GRAPHS": graphs}


def test_paired_block(tmp_path):
    out = tmp_path / "paired.json"
    argv = ["sweep", "--shape", "64,32", "--tokens", "3", "--repeats", "1", "--paired", "4"]
    assert main([*argv, "--out", str(out)]) == 0
    paired = json.loads(out.read_text())["extra"]["paired"]
    assert "4 rounds of one call" in paired["method"]
    (base,) = paired["entries"]  # the CPU runs the baseline only
    assert base["config"] == "baseline" and base["vs_baseline"] == 1.0
    assert len(base["samples_ms"]) == 4 and all(s > 0 for s in base["samples_ms"])
    assert base["median_ms"] == float(np.median(base["samples_ms"]))
    assert base["q1_ms"] <= base["median_ms"] <= base["q3_ms"]


def test_time_steady_one_call_rounds_interleave_entries(monkeypatch):
    import mlx.core as mx

    order = []

    def entry(name):
        def call():
            order.append(name)
            return mx.zeros((1,))

        return call

    got = sweep.time_steady({"a": entry("a"), "b": entry("b")}, 1, 3)  # sweep --paired
    assert order == ["a", "b"] + ["a", "b"] * 3  # one warm call each, then round-robin
    assert [len(v) for v in got.values()] == [3, 3]


def test_time_steady_async_evaluates_each_call_then_synchronizes_once(monkeypatch):
    import mlx.core as mx

    log = []
    monkeypatch.setattr(mx, "async_eval", lambda *a: log.append("async_eval"))
    monkeypatch.setattr(mx, "eval", lambda *a: log.append("eval"))
    monkeypatch.setattr(mx, "synchronize", lambda *a: log.append("sync"))

    def call():
        log.append("call")
        return mx.zeros((1,))

    got = sweep.time_steady({"a": call}, 3, 2)  # PERFORMANCE.md §7: each call async_eval'd
    assert log == (["call", "async_eval"] * 3 + ["sync"]) * 3  # warm round + 2 timed
    assert len(got["a"]) == 2 and all(v >= 0 for v in got["a"])
    log.clear()
    sweep.time_steady({"a": call}, 1, 2)  # --paired: the schema's one call + eval + sync
    assert log == ["call", "eval", "sync"] * 3


def _compare_rows(a: dict, b: dict, prefix: str) -> dict[str, list[str]]:
    """`--compare`'s rows that start with `prefix`: label -> the two documents' cells."""
    return {
        line[:26].strip(): line[26:].split()
        for line in sweep.compare_text(a, b).splitlines()
        if line.startswith(prefix)
    }


def test_compare_shows_paired_rows(fixture):
    doc = json.loads(json.dumps(fixture))
    entry = {"q1_ms": 0.0, "q3_ms": 0.0, "samples_ms": []}
    doc["extra"] = {
        "paired": {
            "method": "m",
            "entries": [
                {"config": "baseline", "median_ms": 2.0, "vs_baseline": 1.0, **entry},
                {"config": "[1,2,3]/4/0", "median_ms": 1.9, "vs_baseline": 0.95, **entry},
                {"config": "[1,2,3]/4/8", "median_ms": 2.2, "vs_baseline": 1.1, **entry},
            ],
        }
    }
    rows = _compare_rows(fixture, doc, "paired")
    assert rows["paired best custom"] == ["-", "[1,2,3]/4/0"]
    assert rows["paired best / baseline"] == ["-", "0.9500"]
    assert rows["paired torch ms"] == rows["paired best / torch"] == ["-", "-"]
    assert "paired" not in sweep.compare_text(fixture, fixture)
    # torch's rounds of the same rotation
    doc["extra"]["peers"] = [
        {"median_ms": 1.0, "paired_median_ms": 2.5, "paired_wall_median_ms": 3}
    ]
    rows = _compare_rows(fixture, doc, "paired")
    assert rows["paired torch ms"] == ["-", "2.500"]
    assert rows["paired best / torch"] == ["-", "0.7600"]  # 1.9 / 2.5
    assert rows["paired torch wall ms"] == ["-", "3.000"]


def test_compare_shows_steady_rows(fixture):
    doc = json.loads(json.dumps(fixture))
    doc["extra"] = {
        "steady": {
            "method": "m",
            "entries": [
                {"config": "baseline", "median_ms": 2.0, "vs_baseline": 1.0, "samples_ms": [2.0]},
                {"config": "[1,2,3]/4/0", "median_ms": 3.0, "vs_baseline": 1.5, "samples_ms": [3]},
                {"config": "[1,2,3]/4/8", "median_ms": 2.5, "vs_baseline": 1.25, "samples_ms": []},
            ],
        }
    }
    rows = _compare_rows(fixture, doc, "steady")
    assert rows["steady best custom"] == ["-", "[1,2,3]/4/8"]
    assert rows["steady best / baseline"] == ["-", "1.2500"]
    assert rows["steady best / torch"] == ["-", "-"]  # no torch peer in either document
    assert "steady" not in sweep.compare_text(fixture, fixture)


def _fake_torch(monkeypatch, log: list) -> None:
    """A stand-in for torch with CUDA (this machine has neither): enough of it for torch_peer."""
    import types

    class Tensor:
        def __init__(self, a):
            self.a = np.asarray(a, dtype=np.float32)

        def to(self, *_):
            return self

        def float(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.a

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing
            self.t = None

        def record(self):
            log.append("record")
            self.t = time.perf_counter()

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3

    def linear(x, w, b):
        log.append("linear")
        return Tensor(x.a @ w.a.T + b.a)

    torch = types.ModuleType("torch")
    torch.__version__ = "fake"
    torch.bfloat16 = "bfloat16"
    torch.from_numpy = Tensor
    torch.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        synchronize=lambda: log.append("sync"),
        get_device_name=lambda: "Fake GPU",
        Event=Event,
    )
    nn = types.ModuleType("torch.nn")
    functional = types.ModuleType("torch.nn.functional")
    functional.linear = linear
    torch.nn, nn.functional = nn, functional
    for name, mod in (("torch", torch), ("torch.nn", nn), ("torch.nn.functional", functional)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_torch_peer_steady_rounds_by_events_and_by_wall_clock(monkeypatch):
    import mlx.core as mx

    log: list = []
    _fake_torch(monkeypatch, log)
    x, w, b = mx.ones((3, 4)), mx.ones((5, 4)), mx.zeros((5,))
    reference = np.full((3, 5), 4.0, dtype=np.float32)
    peer, steady_round = sweep.torch_peer(x, w, b, 1, 2, reference, "op", 3)
    assert peer["device"] == "Fake GPU" and peer["relative_rmse"] == 0.0
    assert peer["equal_fraction"] == 1.0 and len(peer["event_samples_ms"]) == 2
    log.clear()
    rounds = [steady_round(4) for _ in range(3)]
    assert log == (["record"] + ["linear"] * 4 + ["record", "sync"]) * 3
    sweep.add_round_fields(peer, "steady", rounds)
    assert len(peer["steady_samples_ms"]) == len(peer["steady_wall_samples_ms"]) == 3
    # wall clock spans the events and the synchronize: never shorter
    for e, wall in zip(peer["steady_samples_ms"], peer["steady_wall_samples_ms"], strict=True):
        assert 0 <= e <= wall
    assert peer["steady_median_ms"] == float(np.median(peer["steady_samples_ms"]))
    assert peer["steady_wall_median_ms"] == float(np.median(peer["steady_wall_samples_ms"]))


def test_time_steady_peers_take_turns_and_settle_adds_untimed_rounds():
    import mlx.core as mx

    order = []

    def call():
        order.append("a")
        return mx.zeros((1,))

    def peer_round(calls: int):
        order.append(("p", calls))
        return (1.0, 2.0)

    got = sweep.time_steady({"a": call}, 2, 3, {"p": peer_round})
    assert order == ["a", "a", ("p", 2)] * 4  # one warm round each, then 3 in turn
    assert got["p"] == [(1.0, 2.0)] * 3 and len(got["a"]) == 3
    order.clear()

    def slow_peer(calls: int):
        order.append("p")
        time.sleep(0.02)
        return (1.0, 2.0)

    t0 = time.perf_counter()
    got = sweep.time_steady({"a": call}, 1, 2, {"p": slow_peer}, settle_s=0.1)
    assert time.perf_counter() - t0 >= 0.1
    warm = order[: -2 * 2]  # the timed rounds are the last two of each
    assert len(warm) >= 2 * 5 and warm == ["a", "p"] * (len(warm) // 2)
    assert len(got["a"]) == len(got["p"]) == 2


def test_sweep_times_torch_in_the_steady_and_paired_rotations(monkeypatch):
    log: list = []
    _fake_torch(monkeypatch, log)
    calls = []
    real = sweep.time_steady

    def spy(entries, per_round, rounds, peers=None, settle_s=0.0):
        calls.append((sorted(entries), per_round, rounds, sorted(peers or {}), settle_s))
        return real(entries, per_round, rounds, peers, settle_s)

    monkeypatch.setattr(sweep, "time_steady", spy)
    doc = sweep.run_sweep(
        operator="op", n=5, k=4, tokens=3, configs=[], walks=[0], warmup=1, repeats=2,
        steady=(4, 3), paired=2, settle_s=0.0, log=io.StringIO(),
    )  # fmt: skip
    assert calls == [(["baseline"], 4, 3, ["torch"], 0.0), (["baseline"], 1, 2, ["torch"], 0.0)]
    (peer,) = doc["extra"]["peers"]
    assert len(peer["steady_samples_ms"]) == 3 and len(peer["paired_wall_samples_ms"]) == 2
    assert [e["config"] for e in doc["extra"]["steady"]["entries"]] == ["baseline"]
    assert "entries and torch round-robin" in doc["extra"]["steady"]["method"]
    assert "entries and torch round-robin" in doc["extra"]["paired"]["method"]


def test_compare_shows_torch_wall_clock_steady_row(fixture):
    doc = json.loads(json.dumps(fixture))
    entries = [
        {"config": "baseline", "median_ms": 2.0, "vs_baseline": 1.0, "samples_ms": [2.0]},
        {"config": "[1,2,3]/4/8", "median_ms": 2.5, "vs_baseline": 1.25, "samples_ms": [2.5]},
    ]
    peer = {"median_ms": 1.0, "steady_median_ms": 2.0, "steady_wall_median_ms": 2.25}
    doc["extra"] = {"steady": {"method": "m", "entries": entries}, "peers": [peer]}
    rows = _compare_rows(fixture, doc, "steady")
    assert rows["steady torch ms"] == ["-", "2.000"]
    assert rows["steady torch wall ms"] == ["-", "2.250"]
    assert rows["steady best / torch"] == ["-", "1.2500"]  # time over torch's event time


# ---- metrics --------------------------------------------------------------------------------


def test_agreement_formulas_on_hand_made_arrays():
    r = np.array([[1.0, -2.0], [0.5, 4.0]], dtype=np.float32)
    c = np.array([[1.0, -2.0], [0.75, 3.0]], dtype=np.float32)
    max_abs, rmse, equal = sweep.agreement(r, c)
    assert max_abs == 1.0
    expected = math.sqrt((0.25**2 + 1.0) / 4) / math.sqrt((1 + 4 + 0.25 + 16) / 4)
    assert rmse == pytest.approx(expected, rel=1e-15)
    assert equal == 0.5


def test_agreement_identical_zero_reference_and_nan():
    r = np.array([1.5, -3.0, 0.0], dtype=np.float32)
    assert sweep.agreement(r, r.copy()) == (0.0, 0.0, 1.0)
    zeros = np.zeros(4, dtype=np.float32)
    out = np.array([0.0, 2.0, 0.0, 0.0], dtype=np.float32)
    max_abs, rmse, equal = sweep.agreement(zeros, out)
    assert (max_abs, rmse, equal) == (2.0, 1.0, 0.75)  # numerator alone: sqrt(4 / 4)
    nan = np.array([np.nan, 1.0], dtype=np.float32)
    max_abs, rmse, equal = sweep.agreement(nan, nan.copy())
    assert equal == 0.5  # NaN is never equal
    assert math.isnan(rmse)
    with pytest.raises(ValueError, match="shapes differ"):
        sweep.agreement(r, zeros)


# ---- grid and rasterisation -----------------------------------------------------------------


def test_default_grid_is_the_fixture_grid(fixture):
    fixture_trials = [
        (tuple(t["tile"]), t["simdgroups"], t["walk_m"]) for t in fixture["trials"][1:]
    ]
    ours = sweep.expand_grid(sweep.parse_tiles("default"), sweep.parse_walks("0,8"))
    assert ours == fixture_trials
    assert len(ours) == 28


def test_every_default_configuration_plans_within_limits():
    for tile, warps in sweep.DEFAULT_GRID:
        for walk in sweep.DEFAULT_WALKS:
            plan = plan_gemm(tile, warps, walk)
            assert 1 <= plan.stages <= 4
            assert plan.shared_memory <= MAX_DYNAMIC_SMEM
            assert plan.family == ("mma" if warps < 4 else "wgmma"), (tile, warps)
            assert [name for name, _ in plan.template()][:5] == [
                "TM",
                "TN",
                "TK",
                "WARPS",
                "WALK_M",
            ]
    assert plan_gemm((32, 64, 128), 2).stages == 4
    assert plan_gemm((128, 128, 256), 8).stages == 1  # 128 KiB per stage
    assert plan_gemm((128, 128, 128), 4, family="mma").family == "mma"


def test_plan_errors():
    with pytest.raises(ValueError, match="TK must be a multiple of 64"):
        plan_gemm((64, 64, 32), 4)
    with pytest.raises(ValueError, match="warps"):
        plan_gemm((64, 64, 64), 3)
    with pytest.raises(ValueError, match="family"):
        plan_gemm((64, 64, 64), 4, family="tensor")
    with pytest.raises(NotImplementedError, match="shared memory"):
        plan_gemm((256, 256, 256), 16)
    with pytest.raises(NotImplementedError, match="stage"):
        plan_gemm((128, 128, 128), 4, stages=4)
    with pytest.raises(NotImplementedError, match="warp layout"):
        plan_gemm((32, 64, 128), 2, family="wgmma")


def test_tma_plans():
    plan = plan_gemm((128, 256, 64), 8, 8, family="tma")
    # 48 KiB stages: four fit beside the tensor maps and barriers; 8 consumer + 1 producer warp.
    assert (plan.family, plan.stages, plan.layout_m, plan.threads) == ("tma", 4, 2, 288)
    assert plan.shared_memory == 4 * 48 * 1024 + 1024 + 384 <= MAX_DYNAMIC_SMEM
    assert "WGMMA" not in dict(plan.template())
    assert plan_gemm((128, 128, 64), 4, family="tma").stages == 7  # 32 KiB stages
    assert plan_gemm((128, 128, 64), 4, family="tma", stages=3).stages == 3
    assert plan_gemm((64, 128, 64), 4, family="tma").stages == 8  # capped
    # The persistent grid: one block per SM, or one per tile when there are fewer tiles.
    assert plan.tiles(4181, 13312) == 33 * 52
    assert plan.blocks(4181, 13312, sms=132) == 132
    assert plan.blocks(300, 256, sms=132) == 3
    assert plan_gemm((128, 256, 64), 8).blocks(4181, 13312) == 33 * 52
    with pytest.raises(ValueError, match="sms"):
        plan.blocks(4181, 13312)


def test_tma_register_budget():
    # 192x192 as two 192x96 warpgroups: 144 accumulators do not fit the 168 registers a thread
    # gets beside one producer warp, so the producer is a warpgroup and the consumers get 232.
    wide = plan_gemm((192, 192, 64), 8, 8, family="tma")
    assert (wide.layout_m, wide.consumer_regs, wide.producer_warps) == (1, 232, 4)
    assert wide.threads == 384
    assert ("CONSUMER_REGS", 232) in wide.template() and wide.label.endswith("_r232")
    # 128 accumulators fit beside one producer warp: no setmaxnreg.
    plain = plan_gemm((128, 256, 64), 8, 8, family="tma")
    assert (plain.consumer_regs, plain.producer_warps, plain.threads) == (0, 1, 288)
    assert ("CONSUMER_REGS", 0) in plain.template()
    # 17 warps leave 96 registers per thread; four consumer warpgroups with a producer
    # warpgroup get 112.
    assert plan_gemm((128, 256, 64), 16, family="tma").consumer_regs == 112
    with pytest.raises(NotImplementedError, match="accumulators per thread need"):
        plan_gemm((192, 256, 64), 16, family="tma")
    assert plan_gemm((128, 256, 64), 8).producer_warps == 0


def test_three_consumer_warpgroups():
    # 192x192 as three 64x192 warpgroups (one m64n192 wgmma per k-step each, where two 192x96
    # warpgroups issue three m64n96): 96 accumulators, 12 consumer warps + a producer warpgroup,
    # (512 - 40) / 3 registers per consumer thread rounded down to a multiple of 8.
    for family in ("tma", "tma_st", "tma_mc_st"):
        plan = plan_gemm((192, 192, 64), 12, 8, family=family)
        assert (plan.layout_m, plan.consumer_regs, plan.producer_warps) == (3, 152, 4), family
        assert plan.threads == 512 and plan.stages == 4
        assert ("WARPS", 12) in plan.template() and ("LAYOUT_M", 3) in plan.template()
    assert plan.label == "192x192x64_w12_g8_s4_tma3_c2_st1_r152"
    # The cp.async families keep whole power-of-two warp counts.
    for family in ("auto", "wgmma", "mma"):
        with pytest.raises(NotImplementedError, match="12 warps: three consumer warpgroups"):
            plan_gemm((192, 192, 64), 12, family=family)
    with pytest.raises(ValueError, match="expected 1, 2, 4, 8, 12 or 16, got 6"):
        plan_gemm((192, 192, 64), 6, family="tma")


def test_tma_multicast_plans():
    plan = plan_gemm((128, 256, 64), 8, 8, family="tma_mc")
    assert (plan.family, plan.cluster, plan.tma, plan.threads) == ("tma_mc", 2, True, 288)
    assert ("CLUSTER", 2) in plan.template() and "_c2" in plan.label
    assert ("CLUSTER", 1) in plan_gemm((128, 256, 64), 8, 8, family="tma").template()
    # Whole clusters; a unit is two vertically adjacent tiles: 33 tile rows make 17 units.
    assert plan.blocks(4181, 13312, sms=132) == 132
    assert plan.blocks(300, 256, sms=132) == 4  # 3 tile rows -> 2 units -> 2 clusters
    assert plan.blocks(4181, 13312, sms=131) == 130
    # The same register rule as the single-CTA family.
    assert plan_gemm((192, 192, 64), 8, family="tma_mc").consumer_regs == 232


def test_tma_store_plans():
    st = plan_gemm((192, 192, 64), 8, 16, family="tma_st")
    assert (st.family, st.tma_store, st.cluster, st.threads) == ("tma_st", True, 1, 384)
    assert ("TMA_STORE", 1) in st.template() and "_st" in st.label
    assert ("TMA_STORE", 0) in plan_gemm((192, 192, 64), 8, family="tma").template()
    # The tile is staged in the ring's last stage plus, for the box a 48 KiB stage cannot hold,
    # a 24 KiB spare region after the ring, so the ring is as deep as without the TMA store:
    # 4 stages of 48 KiB in 227 KiB, the depth of cuBLASLt's 192x192 kernel.
    assert st.maps == 3 and st.spare_boxes == 1 and ("SPARE_BOXES", 1) in st.template()
    assert st.stages == 4 and plan_gemm((192, 192, 64), 8, family="tma").stages == 4
    assert st.shared_memory == 4 * 49152 + 192 * 128 + 1024 + 3 * 128 + 2 * 8 * 8
    assert st.shared_memory <= 232_448
    # 128x192 and 128x256 spare one 16 KiB box; one stage holds the whole 64x256 tile; where
    # no room is left after the ring (four 56 KiB stages at 192x256), two stages are held.
    from mlx_qsa.kernels.gemm import _spare_boxes

    assert _spare_boxes(192, 256, 64, stages=4) == 0 and _spare_boxes(192, 256, 64, stages=3) == 2
    assert plan_gemm((128, 192, 64), 8, family="tma_st").spare_boxes == 1
    assert plan_gemm((64, 256, 64), 4, family="tma_st").spare_boxes == 0
    assert plan_gemm((128, 256, 64), 8, family="tma_st").spare_boxes == 1
    assert plan_gemm((192, 192, 64), 8, family="tma").spare_boxes == 0
    assert plan_gemm((128, 128, 64), 4, family="tma_st").stages == 7  # 32 KiB stages
    plain = plan_gemm((128, 256, 64), 8, family="tma")
    assert (plain.tma_store, plain.maps) == (False, 2)
    assert plan_gemm((128, 256, 64), 8).maps == 0
    # Same register rule as the other TMA families.
    assert st.consumer_regs == 232
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        plan_gemm((128, 96, 64), 4, family="tma_st")
    with pytest.raises(NotImplementedError, match="stages"):
        plan_gemm((192, 192, 64), 8, family="tma_st", stages=5)
    both = plan_gemm((192, 192, 64), 8, 16, family="tma_mc_st")
    assert (both.family, both.cluster, both.tma_store, both.stages) == ("tma_mc_st", 2, True, 4)
    assert "_c2_st" in both.label
    header, body = kernel_text(st)
    assert "TMA_STORE" in body and header.rstrip().endswith("__launch_bounds__(384, 1)")
    # The text MLX copies and hashes per call is short: gemm.cuh goes in as an #include line,
    # the body without comments or indentation.
    path = Path(gemm.__file__).with_name("gemm.cuh")
    assert f'#include "{path}"\n' in header and len(header) + len(body) < 1000
    assert "//" not in body and "\n " not in body
    assert "qsa_gemm_tma<TM, TN, TK, WARPS" in body.replace("\n", " ")


def test_cluster_launch_needs_cuda_graphs_off():
    from mlx_qsa.kernels.gemm import cluster_launch_unsupported

    # MLX's reading (env::get_var: atoi of the value, default on): only a value that reads as
    # zero turns its CUDA graphs off, and only then may cluster kernels run.
    for value in ("0", " 0", "00", "-0", "off", ""):
        assert cluster_launch_unsupported(value) is None, value
    for value in (None, "1", "2", "-1", "1x"):
        assert "MLX_USE_CUDA_GRAPHS=0" in cluster_launch_unsupported(value), value


def test_tma_kernel_has_launch_bounds():
    header, body = kernel_text(plan_gemm((192, 192, 64), 8, 8, family="tma"))
    # The redefinition closes the header, right before MLX writes `__global__ void <name>(`.
    last = header.rstrip().splitlines()[-1]
    assert last == "#define __global__ __location__(global) __launch_bounds__(384, 1)"
    assert "qsa_gemm_tma<" in body and "CONSUMER_REGS" in body
    header, _ = kernel_text(plan_gemm((128, 256, 64), 8, 8, family="tma_mc"))
    assert (
        header.rstrip()
        .splitlines()[-1]
        .endswith("__launch_bounds__(288, 1) __cluster_dims__(2, 1, 1)")
    )
    # The cp.async families keep MLX's plain `__global__`.
    header, body = kernel_text(plan_gemm((128, 256, 64), 8, 8))
    assert "#define __global__" not in header and "qsa_gemm<" in body


def test_tma_plan_errors():
    with pytest.raises(NotImplementedError, match="warpgroups"):
        plan_gemm((64, 64, 64), 2, family="tma")
    with pytest.raises(NotImplementedError, match="256 rows"):
        plan_gemm((512, 64, 64), 8, family="tma")
    with pytest.raises(NotImplementedError, match="stages"):
        plan_gemm((128, 256, 64), 8, family="tma", stages=5)
    with pytest.raises(NotImplementedError, match="stages"):
        plan_gemm((128, 256, 64), 8, family="tma", stages=1)


@pytest.mark.parametrize("walk", [0, 1, 3, 8])
def test_rasterisation_is_a_permutation(walk):
    for tiles_m in range(1, 13):
        for tiles_n in range(1, 8):
            seen = {tile_coords(p, tiles_m, tiles_n, walk) for p in range(tiles_m * tiles_n)}
            assert seen == {(m, n) for m in range(tiles_m) for n in range(tiles_n)}, (
                tiles_m,
                tiles_n,
            )


def test_rasterisation_orders():
    # walk 0 sweeps N first; walk G visits G M-tiles of one N-tile before moving on.
    assert [tile_coords(p, 3, 2, 0) for p in range(6)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert [tile_coords(p, 3, 2, 2) for p in range(6)] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (2, 0),
        (2, 1),
    ]


# ---- compare and CLI --------------------------------------------------------------------------


def test_compare_fixture_with_itself(capsys):
    assert main(["sweep", "--compare", str(FIXTURE), str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "Apple M5 Pro (metal)" in out
    best = next(line for line in out.splitlines() if line.startswith("best custom"))
    assert best.split()[2:] == ["[64,128,256]/4/8", "[64,128,256]/4/8"]
    ratio = next(line for line in out.splitlines() if line.startswith("best / baseline median"))
    assert ratio.split()[-2:] == ["1.0136", "1.0136"]
    ratio_min = next(line for line in out.splitlines() if line.startswith("best / baseline min"))
    assert ratio_min.split()[-1] == "1.0162" or ratio_min.split()[-1].startswith("1.01")
    assert "28/28" in out
    assert "[32,64,128]/2/0" in out and "3.6832" in out


def test_summary_ratios(fixture):
    s = sweep.summarize(fixture)
    assert s["best"]["tile"] == [64, 128, 256] and s["best"]["walk_m"] == 8
    assert s["best"]["median_ms"] / s["baseline"]["median_ms"] == pytest.approx(1.0136, abs=1e-4)
    assert s["identical"] == 28


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--op", "attn.q_proj"], "invalid choice"),
        (["--shape", "2560"], "--shape: expected K,N"),
        (["--shape", "a,b"], "--shape: expected K,N"),
        (["--shape", "0,64"], "must be >= 1"),
        (["--op", "attn.o_proj", "--shape", "64,64"], "not allowed with"),
        (["--tiles", "128x128/4"], "--tiles: expected"),
        (["--tokens", "0"], ">= 1"),
        (["--steady", "4x0"], "ROUNDS >= 1"),
        (["--steady", "ax2"], "--steady: expected CALLS"),
        (["--paired", "-1"], "expected an integer >= 0"),
    ],
    ids=[
        "bad-op",
        "shape-one-number",
        "shape-not-int",
        "shape-zero",
        "op-and-shape",
        "bad-tiles",
        "zero-tokens",
        "steady-zero-rounds",
        "steady-not-int",
        "paired-negative",
    ],
)
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sweep", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_tiles():
    assert sweep.parse_tiles("128x256x64/8, 64X64X128/4") == [
        ((128, 256, 64), 8),
        ((64, 64, 128), 4),
    ]
    assert sweep.parse_shape("2560,13312") == (2560, 13312)
    assert sweep.parse_walks("0,8,16") == [0, 8, 16]
    assert sweep.parse_steady("20") == (20, 5)
    assert sweep.parse_steady("20x3") == (20, 3)
    assert sweep.parse_steady("0") == (0, 5)


def test_tensor_map_argument_checks():
    # Checked before the CUDA driver is loaded, so these run on any machine.
    from mlx_qsa.kernels import tensormap

    with pytest.raises(ValueError, match="cols a multiple of 8"):
        tensormap.encode_bf16_rows(16, 60, 64)
    with pytest.raises(ValueError, match="rows >= 1"):
        tensormap.encode_bf16_rows(0, 64, 64)
    with pytest.raises(ValueError, match=r"box_rows\): expected 1..256, got 512"):
        tensormap.encode_bf16_rows(16, 64, 512)


def test_kernel_text_names_the_plans_wgmma_wrapper():
    # QSA_WGMMA names the plan's qsa_wgmma_n<N> (gemm.cuh's WG_TN: the tile's N over the
    # warpgroups side by side along N), a wrapper the included gemm.cuh defines.
    from mlx_qsa.kernels._launch import included_text

    cases = [
        ((192, 192, 64), 8, "tma_st", 96),  # two 192x96 warpgroups
        ((192, 192, 64), 12, "tma_st", 192),  # three 64x192
        ((128, 256, 64), 8, "tma", 256),  # two 64x256 stacked along M
        ((128, 128, 64), 4, "wgmma", 128),
        ((128, 128, 64), 4, "mma", None),  # no wgmma: the macro names no wrapper
    ]
    for tile, warps, family, n in cases:
        plan = plan_gemm(tile, warps, 8, family=family)
        assert gemm.wgmma_n(plan) == n, (tile, warps, family)
        header, _ = kernel_text(plan)
        define = f"QSA_WGMMA qsa_wgmma_n{n}" if n else "QSA_WGMMA(d, da, db)"
        assert header.startswith(f"#define {define}\n")
        if n:  # gemm.cuh defines qsa_wgmma_n<N> through its wrapper macro
            assert f"\nQSA_WGMMA_WRAPPER({n}," in included_text(header), (tile, family)
    # and one wrapper for every N extent a plan may have, no more
    text = included_text(kernel_text(plan_gemm((128, 128, 64), 4, 8, family="wgmma"))[0])
    wrapped = {int(m) for m in re.findall(r"^QSA_WGMMA_WRAPPER\((\d+),", text, re.M)}
    assert wrapped == set(gemm.TMA_WGMMA_N)


def test_tensor_maps_made_once_per_geometry(monkeypatch):
    # The driver's encoder is replaced by one whose bytes name its arguments: the maps come
    # back in x, W, y order as uint64, and a second call with the same geometry encodes nothing.
    import mlx.core as mx

    from mlx_qsa.kernels import tensormap

    calls = []

    def fake(rows: int, cols: int, box_rows: int) -> bytes:
        calls.append((rows, cols, box_rows))
        return np.array([rows, cols, box_rows] + [0] * 13, dtype=np.uint64).tobytes()

    monkeypatch.setattr(tensormap, "encode_bf16_rows", fake)
    gemm._tensor_maps.cache_clear()
    try:
        maps = gemm._tensor_maps(4181, 13312, 2560, 192, 96, True)
        assert maps.dtype == mx.uint64 and maps.shape == (48,)
        got = np.array(maps).reshape(3, 16)[:, :3].tolist()
        assert got == [[4181, 2560, 192], [13312, 2560, 96], [4181, 13312, 192]]
        assert gemm._tensor_maps(4181, 13312, 2560, 192, 96, True) is maps
        assert len(calls) == 3
        assert gemm._tensor_maps(4181, 13312, 2560, 192, 96).shape == (32,)  # no y map
        assert len(calls) == 5
    finally:
        gemm._tensor_maps.cache_clear()


def test_gemm_bias_plans_once_per_signature(monkeypatch):
    # A stand-in kernel records its launches: the first call of a signature plans (kernel,
    # tensor maps, grid), later calls launch with the same arguments; new shapes plan again;
    # bad input raises every time and plans nothing.
    import mlx.core as mx

    launches, planned = [], []

    class FakeKernel:
        def __call__(self, **kw):
            launches.append(kw)
            (m, n), *_ = kw["output_shapes"]
            return [mx.zeros((m, n), dtype=mx.bfloat16)]

    real_plan_run = gemm._plan_run

    def plan_run(*args):
        planned.append(args[0].shape)
        return real_plan_run(*args)

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gemm, "_kernel", lambda plan: FakeKernel())
    monkeypatch.setattr(gemm, "_tensor_maps", lambda *a: ("maps", a))
    monkeypatch.setattr(gemm, "_plan_run", plan_run)
    from mlx_qsa.kernels import device

    monkeypatch.setattr(device, "current", lambda: None)
    monkeypatch.setattr(device, "sm_count", lambda: 132)
    gemm._runs.cache_clear()
    try:
        x = mx.zeros((100, 256), dtype=mx.bfloat16)
        w = mx.zeros((512, 256), dtype=mx.bfloat16)
        b = mx.zeros((512,), dtype=mx.bfloat16)
        opts = {"tile": (192, 192, 64), "warps": 8, "family": "tma_st"}
        y1 = gemm.gemm_bias(x, w, b, **opts)
        y2 = gemm.gemm_bias(x, w, b, **opts)
        assert y1.shape == y2.shape == (100, 512) and planned == [(100, 256)]
        first, second = launches
        assert first["inputs"][3] == ("maps", (100, 512, 256, 192, 192, True))
        assert first["grid"] == second["grid"] == (3 * 384, 1, 1)  # 1 x 3 tiles, persistent
        assert first["output_shapes"] == [(100, 512), (128 * 3 * 3 + 128,)]
        gemm.gemm_bias(x[:50], w, b, **opts)
        assert planned == [(100, 256), (50, 256)]
        with pytest.raises(ValueError, match=r"gemm_bias\(b\): expected \[N=512\]"):
            gemm.gemm_bias(x, w, b[:256], **opts)
        with pytest.raises(ValueError, match=r"gemm_bias\(b\): expected \[N=512\]"):
            gemm.gemm_bias(x, w, b[:256], **opts)
        assert len(planned) == 4 and len(launches) == 3
        # a cp.async family: one block per tile, no tensor maps, no scratch
        gemm.gemm_bias(x, w, b, tile=(128, 128, 64), warps=4, family="mma")
        last = launches[-1]
        assert len(last["inputs"]) == 3 and last["output_shapes"] == [(100, 512)]
        assert last["grid"] == (4 * 128, 1, 1) and last["threadgroup"] == (128, 1, 1)
    finally:
        gemm._runs.cache_clear()
