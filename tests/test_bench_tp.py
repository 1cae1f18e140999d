"""`bench --tp 1,2,...`: the scaling plan (pure) and one real run over the ring backend."""

from __future__ import annotations

import json
import os
import sys

import mlx.core as mx
import pytest
from test_sharding import SRC

from mlx_qsa import bench, bench_tp
from mlx_qsa.cli import build_parser


def _args(*argv: str):
    return build_parser("bench").parse_args(["bench", *argv])


def test_child_argv_carries_the_run_and_one_size(tmp_path) -> None:
    a = _args("decode", "--tp", "1,2", "--contexts", "32k,128k", "--rows", "1,4", "--repeats", "3")
    assert a.tp == (1, 2)
    argv = bench_tp.child_argv(a, 2, tmp_path / "o.json")
    assert argv == [
        "decode", "--tp", "2", "--warmup", "2", "--repeats", "3", "--contexts", "32768,131072",
        "--rows", "1,4", "--out", str(tmp_path / "o.json"),
    ]  # fmt: skip
    p = _args("prefill", "--tp", "1,4", "--chunk", "512")
    assert bench_tp.child_argv(p, 4, tmp_path / "p.json")[-4:] == [
        "--chunk", "512", "--out", str(tmp_path / "p.json"),
    ]  # fmt: skip


def test_launch_command_keeps_nvls_off_and_names_the_backend() -> None:
    cmd = bench_tp.launch_command(4, "nccl", ["decode", "--tp", "4"], port=5000, python="py")
    assert cmd[:2] == ["py", "-c"] and "mlx._distributed_utils.launch" in cmd[2]
    assert cmd[3:7] == ["--backend", "nccl", "-n", "4"]
    assert cmd[7:9] == ["--nccl-port", "5000"]
    i = cmd.index("--env")
    assert cmd[i + 1] == "NCCL_NVLS_ENABLE=0"
    assert cmd[cmd.index("--") :] == ["--", "py", "-m", "mlx_qsa", "bench", "decode", "--tp", "4"]
    ring = bench_tp.launch_command(2, "ring", ["decode"], port=6000, python="py")
    assert ring[ring.index("-p") + 1] == "6000"
    # a ring of one runs alone (singleton group), not through the launcher
    assert bench_tp.launch_command(1, "ring", ["decode"], python="py") == [
        "py", "-m", "mlx_qsa", "bench", "decode",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="backend.*'ring' or 'nccl'"):
        bench_tp.launch_command(2, "mpi", [])
    with pytest.raises(ValueError, match="group size >= 1"):
        bench_tp.launch_command(0, "ring", [])


def _point(T, rows, step, all_sum):
    return {
        "context": T, "rows": rows, "step": {"median_us": step},
        "all_sum": {"median_us": all_sum}, "all_sum_bytes": 5120, "rank_kv_bytes": 100,
        "rel_err_vs_unsharded": 1e-3,
    }  # fmt: skip


def test_scaling_table_speedups_and_the_decode_bound() -> None:
    runs = {
        1: {"points": [_point(32768, 1, 300.0, 5.0)]},
        2: {"points": [_point(32768, 1, 250.0, 50.0)]},
        4: {"points": [_point(32768, 1, 400.0, 60.0)]},
    }
    t = bench_tp.scaling_table("decode", runs)
    assert [r["tp"] for r in t] == [1, 2, 4]
    assert [r["speedup"] for r in t] == pytest.approx([1.0, 1.2, 0.75])
    # step_N / (step_1 + all_sum_N): 250 / 350 meets the bound, 400 / 360 does not
    assert [r["step_over_base_plus_all_sum"] for r in t] == pytest.approx(
        [300 / 305, 250 / 350, 400 / 360]
    )
    pre = bench_tp.scaling_table("prefill", runs)
    assert "step_over_base_plus_all_sum" not in pre[0] and pre[1]["speedup"] == pytest.approx(1.2)


@pytest.mark.skipif(not mx.distributed.is_available(), reason="mx.distributed is not available")
def test_tp_list_runs_each_size_over_the_ring(tmp_path, monkeypatch) -> None:
    """`bench decode --tp 1,2` starts a group of one and a group of two itself: every rank
    checked its output against the unsharded layer, rank 0's documents side by side."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    )
    out = tmp_path / "tp.json"
    args = _args(
        "decode", "--tp", "1,2", "--tp-backend", "ring", "--contexts", "2100", "--rows", "1",
        "--repeats", "1", "--warmup", "1", "--tp-timeout", "600", "--out", str(out),
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["tp"] == [1, 2] and doc["launcher"]["backend"] == "ring"
    assert sorted(doc["runs"]) == ["1", "2"]
    assert [(r["tp"], r["context"], r["rows"]) for r in doc["scaling"]] == [
        (1, 2100, 1),
        (2, 2100, 1),
    ]
    for r in doc["scaling"]:
        assert r["rel_err_vs_unsharded"] <= bench.REL_TOL
        assert r["step_us"] > 0 and r["all_sum_us"] > 0 and r["speedup"] > 0
    one, two = doc["scaling"]
    assert one["speedup"] == 1.0
    # each rank of two holds one of the two KV heads (backing of 2304 tokens x 256, K and V,
    # bf16); the indexer's states stay whole on every rank
    assert one["rank_kv_bytes"] - two["rank_kv_bytes"] == 2304 * 256 * 2 * 2
    assert sys.executable in doc["launcher"]["commands"]["2"]
