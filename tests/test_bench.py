"""`mlx-qsa bench` on this machine: the decode and prefill documents, their checks and errors.

Small contexts and few samples keep it quick; on a CPU the CUDA columns and the torch peer are
absent, with the reason recorded."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import small_config
from test_sharding import SRC, _free_base_port, _have_ring

from mlx_qsa import bench
from mlx_qsa.cli import build_parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser("bench").parse_args(["bench", *argv])


@pytest.fixture
def turns(monkeypatch):
    """Each `take_turns` call of the bench's points: (entry names, rounds, warm rounds, settle);
    the host calibration's two calls (before and after) are checked and left out."""
    calls = []
    real = bench.take_turns

    def spy(entries, rounds, warm_rounds=1, settle_s=0.0):
        if "mlx_eval_one_op_us" in entries:
            calibrations.append(list(entries))
        else:
            calls.append((list(entries), rounds, warm_rounds, settle_s))
        return real(entries, rounds, warm_rounds, settle_s)

    calibrations: list[list[str]] = []
    monkeypatch.setattr(bench, "take_turns", spy)
    yield calls
    assert len(calibrations) == 2 and calibrations[0][0] == "mlx_eval_one_op_us"


def test_decode_document(tmp_path, turns) -> None:
    out = tmp_path / "d.json"
    args = _args(
        "decode", "--contexts", "3k", "--rows", "1,3", "--sets", "2", "--repeats", "2",
        "--warmup", "1", "--settle", "0.05", "--copy-bytes", "8000000", "--out", str(out),
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    # every entry of a point in one rotation, after the warm-up passes and the settle time
    cuda = mx.cuda.is_available()
    modes = {"cuda": ("", "_async", "_gpu", "_spin"), "portable": ("", "_async")}
    names = [f"qsa_{i}{m}" for i in (("cuda", "portable") if cuda else ("portable",))
             for m in modes[i]]  # fmt: skip
    names += ["mlx_gather_sdpa", "mlx_gather_sdpa_async", "mlx_dense_sdpa"]
    names += ["mlx_one_kernel_gpu"] if cuda else []  # MLX's floor for a queued step
    names += [f"qsa_{i}_layer{m}" for i in (("cuda", "portable") if cuda else ("portable",))
              for m in ("", "_async")]  # fmt: skip
    for entries, rounds, warm, settle in turns:
        assert entries[: len(names)] == names and (rounds, warm, settle) == (2, 1, 0.05)
        assert set(entries[len(names) :]) <= {"torch_dense_sdpa", "torch_dense_sdpa_sync"}
    assert len(turns) == 2  # one per point
    timing = doc["timing"]
    assert timing["order"].startswith("in turns") and timing["settle_s"] == 0.05
    for when in ("before", "after"):  # the host's speed at trivial work, around the run
        calib = doc["host_calibration"][when]
        assert calib["mlx_eval_one_op_us"] > 0
        assert ("torch_one_op_sync_us" in calib) == (bench._torch_cuda() is not None)
    assert (timing["warmup_passes"], timing["samples"]) == (1, 2)
    assert doc["bench"] == "decode" and doc["command"].startswith("mlx-qsa bench")
    assert doc["geometry"]["num_attention_heads"] == 24 and doc["geometry"]["head_dim"] == 256
    assert [(p["context"], p["rows"]) for p in doc["points"]] == [(3072, 1), (3072, 3)]
    for p in doc["points"]:
        t = p["timings"]
        expected = {"qsa_portable", "mlx_gather_sdpa", "mlx_dense_sdpa", "qsa_portable_layer"}
        expected |= {"qsa_portable_async", "mlx_gather_sdpa_async", "qsa_portable_layer_async"}
        assert expected <= set(t)
        assert ("qsa_cuda" in t) == cuda
        for v in t.values():
            assert 0 < v["min_us"] <= v["median_us"] <= v["max_us"]
            assert len(v["samples_us"]) == 2
        for name, c in p["checks"].items():
            assert c["rel_err"] <= bench.REL_TOL, name
            assert c.get("selection_equal", True), name
        # library defaults: flash for one row; below gather_min_context verifies go dense
        assert t["qsa_portable_layer"]["consumers"] == (["flash"] if p["rows"] == 1 else ["sdpa"])
        # block keys (768 x 128) + the rows' selections (at most 3 x 2051 tokens) of K and V
        floor = p["floor"]["bytes"]
        assert (
            2 * (768 * 128 + 2051 * 2 * 256 * 2)
            <= floor
            <= 2 * (768 * 128 + 3072 * 2 * 256 * 2 + 3 * 13000)
        )
        ours = "qsa_cuda" if cuda else "qsa_portable"
        assert p["ratios"][f"mlx_dense_sdpa/{ours}"] == pytest.approx(
            t["mlx_dense_sdpa"]["median_us"] / t[ours]["median_us"]
        )
        assert p["ratios"][f"mlx_gather_sdpa_async/{ours}_async"] == pytest.approx(
            t["mlx_gather_sdpa_async"]["median_us"] / t[f"{ours}_async"]["median_us"]
        )
        if not cuda:
            assert "torch" in p["skipped"]["torch_dense_sdpa"]
        elif "torch_dense_sdpa" in t:  # both of torch's modes, each with its like ratio
            assert p["ratios"]["torch_dense_sdpa/qsa_cuda_async"] == pytest.approx(
                t["torch_dense_sdpa"]["median_us"] / t["qsa_cuda_async"]["median_us"]
            )
            assert p["ratios"]["torch_dense_sdpa_sync/qsa_cuda"] == pytest.approx(
                t["torch_dense_sdpa_sync"]["median_us"] / t["qsa_cuda"]["median_us"]
            )
            assert p["ratios"]["torch_dense_sdpa/qsa_cuda_gpu"] == pytest.approx(
                t["torch_dense_sdpa"]["median_us"] / t["qsa_cuda_gpu"]["median_us"]
            )
            assert p["ratios"]["torch_dense_sdpa/mlx_one_kernel_gpu"] == pytest.approx(
                t["torch_dense_sdpa"]["median_us"] / t["mlx_one_kernel_gpu"]["median_us"]
            )
            assert p["ratios"]["torch_dense_sdpa_sync/qsa_cuda_spin"] == pytest.approx(
                t["torch_dense_sdpa_sync"]["median_us"] / t["qsa_cuda_spin"]["median_us"]
            )
        prim = p["primitives"]
        for name in ("qsa_portable", "qsa_portable_layer"):
            assert prim[name]["total"] == sum(prim[name]["by_kind"].values()) > 0
        assert prim["qsa_portable"]["by_kind"]["Matmul"] >= 2  # scores, then attention
        assert prim["qsa_portable_layer"]["total"] > prim["qsa_portable"]["total"]
    assert doc["bandwidth"]["gbps"] > 0


def test_prefill_document(tmp_path, turns) -> None:
    out = tmp_path / "p.json"
    args = _args(
        "prefill", "--contexts", "2048", "--chunk", "64", "--sets", "1", "--repeats", "1",
        "--warmup", "1", "--settle", "0", "--ceiling-n", "256", "--out", str(out),
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    (p,) = doc["points"]
    parts = ("selection", "attention", "selection_attention", "layer")
    impls = ("cuda", "portable") if mx.cuda.is_available() else ("portable",)
    ((entries, rounds, warm, settle),) = turns  # the point's entries in one rotation
    # on CUDA each of its parts also on the GPU's clock (`_gpu`)
    gpu = {"cuda": [f"{k}_gpu" for k in parts[:3]] + ["selection_attention_spin"], "portable": []}
    ours = [
        f"qsa_{i}_{k}" for i in impls for k in [*parts[:3], *gpu[i], "layer"]
        + (["layer_gpu"] if i == "cuda" else [])
    ]  # fmt: skip
    assert entries[: len(ours)] == ours
    assert set(entries[len(ours) :]) <= {"torch_dense_causal_sdpa", "torch_dense_causal_sdpa_sync"}
    assert (rounds, warm, settle) == (1, 1, 0.0)
    assert (p["prefix"], p["rows"]) == (2048, 64)
    t = p["timings"]
    assert t["qsa_portable_layer"]["median_us"] > 0
    assert t["qsa_portable_layer"]["consumers"]
    for part in ("selection", "attention", "selection_attention"):
        assert t[f"qsa_portable_{part}"]["median_us"] > 0
    assert t["qsa_portable_attention"]["consumers"] == ["prefill_gather", "rows_gather"]
    # rows 2048..2111: nb = (p + 1) // 4 blocks scored per row and head, 4 heads x 128
    nb = sum((q + 1) // 4 for q in range(2048, 2112))
    assert p["flops"]["indexer"] == 2 * 4 * 128 * nb
    toks = sum(min((q + 1) // 4, 512) * 4 + (q + 1) % 4 for q in range(2048, 2112))
    assert p["flops"]["sparse_attention"] == 4 * 24 * 256 * toks
    assert doc["matmul_ceiling"]["tflops"] > 0
    r = p["rates"]["qsa_portable_attention"]
    assert r["tflops"] == pytest.approx(
        toks * 4 * 24 * 256 / t["qsa_portable_attention"]["median_us"] / 1e6
    )
    assert r["of_ceiling"] == pytest.approx(r["tflops"] / doc["matmul_ceiling"]["tflops"])
    # K and V of every attended token, both KV heads, bf16; no copy bandwidth off CUDA
    assert p["attention_kv_bytes"] == toks * 2 * 256 * 2 * 2
    assert r["kv_gbps"] == pytest.approx(
        p["attention_kv_bytes"] / t["qsa_portable_attention"]["median_us"] / 1e3
    )
    both = p["rates"]["qsa_portable_selection_attention"]  # the indexer's work and the attention's
    assert both["tflops"] == pytest.approx(
        (p["flops"]["indexer"] + toks * 4 * 24 * 256)
        / t["qsa_portable_selection_attention"]["median_us"]
        / 1e6
    )
    if mx.cuda.is_available():  # the attention's bytes against a plain copy's in the same run
        assert r["kv_of_copy"] == pytest.approx(r["kv_gbps"] / doc["copy_bandwidth"]["gbps"])
    else:
        assert "copy_bandwidth" not in doc and "kv_of_copy" not in r


def test_prefill_large_lane_times_both_routings(tmp_path, turns) -> None:
    """`--large-from`: the layer with the library defaults (below 32K: the oracle's keep-mask
    and `sdpa`) and with the large-prefill lane from that context (the prefill selector and
    `prefill_flash`), in the same rotation; the chunk's attention entry takes the latter's
    consumer instead of the defaults' `prefill_gather` tier."""
    out = tmp_path / "p.json"
    args = _args(
        "prefill", "--contexts", "2048", "--chunk", "64", "--sets", "1", "--repeats", "1",
        "--warmup", "1", "--settle", "0", "--ceiling-n", "256", "--large-from", "2049",
        "--portable-only", "--out", str(out),
    )  # fmt: skip
    assert bench.run(args) == 0
    (p,) = json.loads(out.read_text())["points"]
    ((entries, _, _, _),) = turns
    assert entries[:5] == [
        "qsa_portable_selection",
        "qsa_portable_attention",
        "qsa_portable_selection_attention",
        "qsa_portable_layer",
        "qsa_portable_layer_large",
    ]
    t = p["timings"]
    assert p["large_from"] == 2049
    assert (t["qsa_portable_layer"]["selector"], t["qsa_portable_layer"]["consumers"]) == (
        "oracle",
        ["sdpa"],
    )
    large = t["qsa_portable_layer_large"]
    assert (large["selector"], large["consumers"]) == ("prefill_kernel", ["prefill_flash"])
    assert large["median_us"] > 0
    assert t["qsa_portable_attention"]["consumers"] == ["prefill_flash"]


def test_prefill_layer_options() -> None:
    assert bench.prefill_layer_options(None) == [("", bench.QSAOptions())]
    (_, defaults), (suffix, large) = bench.prefill_layer_options(8192)
    assert defaults == bench.QSAOptions() and suffix == "_large"
    assert large == bench.QSAOptions(prefill_min_context=8192, flash_min=8192)
    # the lane starts at 2049 at the earliest (RUNTIME.md §3)
    assert bench.prefill_layer_options(0)[1][1].effective_prefill_min_context == 2049
    with pytest.raises(SystemExit, match="--large-from must be a context >= 0, got -1"):
        bench.run(_args("prefill", "--large-from", "-1"))
    with pytest.raises(SystemExit, match="--large-from applies to bench prefill and prompt"):
        bench.run(_args("decode", "--large-from", "8192"))
    with pytest.raises(SystemExit, match="--no-portable applies to prefill and prompt"):
        bench.run(_args("decode", "--no-portable"))
    with pytest.raises(SystemExit, match="without --portable-only"):
        bench.run(_args("prompt", "--no-portable", "--portable-only"))
    # on CUDA only the CUDA entries; elsewhere the portable ones remain
    args = _args("prompt", "--no-portable")
    _, impls, _ = bench._layer_bench_setup(args)
    assert impls == (("cuda",) if mx.cuda.is_available() else ("portable",))


def test_prompt_document(tmp_path, turns, monkeypatch) -> None:
    """`bench prompt`: whole prompts fed in chunks from an empty cache, with the library
    defaults and the large-prefill lane; every chunk's route recorded; the last chunk's output
    of each entry against the portable defaults'. A small geometry (budget 16) keeps it quick;
    the large lane still needs a context of 2049."""
    cfg = small_config(mrope=False)
    monkeypatch.setattr(bench, "QSAConfig", lambda: cfg)
    out = tmp_path / "prompt.json"
    for k in [k for k in os.environ if k.startswith("MLX_QSA_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MLX_QSA_COMPILE_DECODE", "0")  # no decode launch here: only recorded
    args = _args(
        "prompt", "--contexts", "2200", "--chunk", "512", "--sets", "1", "--repeats", "1",
        "--warmup", "1", "--settle", "0", "--large-from", "2049", "--portable-only",
        "--out", str(out),
    )  # fmt: skip
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "prompt"
    assert doc["switches"] == {"MLX_QSA_COMPILE_DECODE": "0"}  # the run's switches, recorded
    assert doc["blas"] == {
        "mapped": bench.loaded_blas(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    (p,) = doc["points"]
    assert p["prompt"] == 2200 and p["chunks"] == [512, 512, 512, 512, 152]
    ((entries, _, _, _),) = turns
    assert entries[:2] == ["qsa_portable_prompt", "qsa_portable_prompt_large"]
    t = p["timings"]
    defaults, large = t["qsa_portable_prompt"]["routes"], t["qsa_portable_prompt_large"]["routes"]
    # every chunk past the budget is sparse; below 2049 tokens both take the keep-mask
    assert defaults[:4] == large[:4] == [["oracle", "sdpa"]] * 4
    assert defaults[4] == ["oracle", "sdpa"]  # below 32K the defaults keep it
    # T = 2200: the large lane (the prefill_flash kernel's contract needs the real heads, so
    # this geometry takes the gather tier)
    assert large[4] == ["prefill_kernel", "prefill_gather", "rows_gather"]
    checks = p["checks"]
    assert checks["qsa_portable_prompt"]["last_chunk_rel_diff"] == 0.0
    assert checks["qsa_portable_prompt_large"]["last_chunk_rel_diff"] < 1e-2
    if bench._torch_cuda() is None:
        assert "torch" in p["skipped"]["torch_dense_causal_sdpa"]
    else:  # the GPU machine: both of torch's modes, each with its note
        for k in ("torch_dense_causal_sdpa", "torch_dense_causal_sdpa_sync"):
            assert t[k]["median_us"] > 0 and "whole prompt" in t[k]["note"]
    assert bench.prompt_chunks(4096, 2048) == [2048, 2048]
    with pytest.raises(ValueError, match="n and chunk must be >= 1"):
        bench.prompt_chunks(0, 2048)


@pytest.mark.parametrize("rows", [1, 4])
def test_qsa_step_runs_the_cuda_selector_compiled_with_a_fresh_slot(monkeypatch, rows) -> None:
    """`bench.qsa_step` on CUDA runs the selector as a compiled function (as the layer's core
    does): traced once per shape, a new counter slot as an input on each step, the selector's
    own outputs. Any machine: a stand-in selector (the portable twin, plus the slot's first
    value on the output the step keeps, so it shows which slot it got) replaces the CUDA one;
    the attention then runs portably."""
    from mlx_qsa import consumers, indexer
    from mlx_qsa.config import QSAConfig
    from mlx_qsa.kernels import _launch, selector

    traced = []

    def stand_in(q, pooled, pos, *, block_topk, ratio, mode="blocks", ctr=None):
        traced.append(mode)
        q3 = q[0].transpose(1, 0, 2)  # the layer's [1, H_I, S, d_I] as the twin's [S, H_I, d_I]
        out = list(selector.select_blocks_portable(q3, pooled, pos, block_topk=block_topk,
                                                   ratio=ratio, mode=mode))  # fmt: skip
        kept = 2 if mode == "blocks" else 3  # scores, or the row-token slots
        out[kept] = out[kept] + ctr[0].astype(out[kept].dtype)
        return tuple(out)

    monkeypatch.setattr(selector, "select_blocks_cuda", stand_in)
    monkeypatch.setattr(consumers, "cuda_attention_supports", lambda q, keys: False)
    for module in (indexer, bench):
        monkeypatch.setattr(module, "cuda_selector_supports", lambda q, pooled: True)
    slots = iter([mx.array([1, 0], mx.int32), mx.array([2, 0], mx.int32)])
    monkeypatch.setattr(_launch, "counter_slot", lambda: next(slots))
    bench._cuda_selection.cache_clear()
    try:
        cfg = QSAConfig()
        s = bench.DecodeSet(cfg, 2304, rows, seed=3)  # 576 blocks: past the 512 budget
        sels = [bench.qsa_step(cfg, s, "cuda")[1] for _ in range(2)]
        assert traced == ["blocks" if rows == 1 else "row_tokens"]
        mode = "blocks" if rows == 1 else "row_tokens"
        want = selector.select_blocks_portable(
            s.index_q[0].transpose(1, 0, 2), s.pooled, s.positions, block_topk=512, ratio=4,
            mode=mode,
        )  # fmt: skip
        for sel, slot in zip(sels, (1, 2), strict=True):
            if rows == 1:
                assert sel.kind == "blocks" and sel.tail_start == 2304
                assert mx.array_equal(sel.ids, want[0]).item()
                assert mx.array_equal(sel.scores, want[2] + slot).item()
            else:
                assert sel.kind == "row_tokens"
                assert mx.array_equal(sel.slots, want[3] + slot).item()
                assert mx.array_equal(sel.slot_valid, want[4]).item()
    finally:
        bench._cuda_selection.cache_clear()


def test_tp_needs_a_matching_group() -> None:
    with pytest.raises(SystemExit, match="--tp 2: the distributed group has 1 ranks"):
        bench.run(_args("decode", "--tp", "2", "--contexts", "4096"))


def test_mlx_pass_evaluates_each_step_or_queues_them(monkeypatch) -> None:
    log = []
    monkeypatch.setattr(mx, "async_eval", lambda *a: log.append("async_eval"))
    monkeypatch.setattr(mx, "eval", lambda *a: log.append("eval"))
    monkeypatch.setattr(mx, "synchronize", lambda *a: log.append("sync"))

    def step(i: int):
        log.append(i)
        return mx.zeros((1,))

    assert bench.mlx_pass(step, 3)() >= 0
    assert log == ["sync", 0, "eval", 1, "eval", 2, "eval", "sync"]  # one round trip a step
    log.clear()
    bench.mlx_pass(step, 2, sync_each=False)()
    assert log == ["sync", 0, "async_eval", 1, "async_eval", "sync"]  # queued, one sync
    log.clear()
    bench.mlx_pass(step, 2, spin=True)()  # a step at a time, waited for by synchronize
    assert log == ["sync", 0, "async_eval", "sync", 1, "async_eval", "sync", "sync"]


def test_mlx_gpu_pass_spans_the_queued_steps_between_two_stamps() -> None:
    # Step 0 is built first, then the first stamp and the steps are queued; the last stamp
    # follows the last step's output; µs per step = (last - first) / 1e3 / steps.
    order: list[tuple[str, object]] = []
    outs = {}

    def step(i: int) -> mx.array:
        order.append(("step", i))
        outs[i] = mx.array([float(i)])
        return outs[i]

    def stamp(after: mx.array) -> mx.array:
        n = sum(1 for kind, _ in order if kind == "stamp")
        order.append(("stamp", after))
        return mx.array([1_000_000 + 6_000 * n], dtype=mx.uint64)

    assert bench.mlx_gpu_pass(step, 3, stamp=stamp)() == pytest.approx(2.0)
    kinds = [(k, v if k == "step" else None) for k, v in order]
    assert kinds == [("step", 0), ("stamp", None), ("step", 1), ("step", 2), ("stamp", None)]
    assert order[-1][1] is outs[2]


def test_one_kernel_pass_stamps_each_step_on_its_own_input() -> None:
    # MLX's floor entry: each step is one stamp launch on its own (distinct) input; between
    # the first stamp and the last, 3 steps took 3 * 6 µs of the stand-in timer, 6 µs a step
    seen: list[int] = []

    def stamp(after: mx.array) -> mx.array:
        seen.append(int(after[0].item()))
        return mx.array([1_000_000 + 6_000 * (len(seen) - 1)], dtype=mx.uint64)

    per_step = bench.one_kernel_pass(3, stamp=stamp)()
    # step 0, first stamp (on the anchor), steps 1 and 2, last stamp (on step 2's output)
    assert per_step == pytest.approx(3 * 6.0 / 3)
    assert seen[0] == 0 and seen[2:4] == [1, 2]


def test_torch_pass_enters_its_context_once_a_pass_outside_the_timing(monkeypatch) -> None:
    import contextlib
    import time
    import types

    log: list = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            self.t = 0.0

        def record(self) -> None:
            log.append("record")
            self.t = time.perf_counter()

        def elapsed_time(self, end) -> float:
            return (end.t - self.t) * 1e3

    fake = types.ModuleType("torch")  # this machine has no torch: enough of it for torch_pass
    fake.cuda = types.SimpleNamespace(synchronize=lambda: log.append("sync"), Event=Event)
    monkeypatch.setitem(sys.modules, "torch", fake)

    @contextlib.contextmanager
    def pinned():
        log.append("enter")
        yield
        log.append("exit")

    queued = bench.torch_pass(log.append, 2, around=pinned)
    assert queued() >= 0 and queued() >= 0
    one = ["enter", "sync", "record", 0, 1, "record", "sync", "exit"]
    assert log == one * 2  # the context once a pass, its cost before the first event
    log.clear()
    assert bench.torch_pass(log.append, 2, sync_each=True, around=pinned)() >= 0
    assert log == ["enter", "sync", 0, "sync", 1, "sync", "exit"]
    log.clear()
    bench.torch_pass(log.append, 1)()  # no context
    assert log == ["sync", "record", 0, "record", "sync"]


def test_argument_errors(capsys) -> None:
    for bad in ("-1", "inf", "nan"):  # an endless settle would never time a sample
        with pytest.raises(SystemExit):
            _args("decode", "--settle", bad)
        err = capsys.readouterr().err
        assert "--settle" in err and "seconds >= 0" in err, bad
    with pytest.raises(SystemExit):
        _args("decode", "--contexts", "8k,x")
    with pytest.raises(SystemExit):
        _args("decode", "--rows", "0")
    assert bench._int_list("8k,32768") == (8192, 32768)


@pytest.mark.skipif(not _have_ring(), reason="mlx.launch / the ring backend is not available")
def test_tp_over_the_ring_backend(tmp_path) -> None:
    """`bench decode --tp 2` under mlx.launch: rank 0 writes the document; both ranks checked
    their sharded output against the unsharded layer (the command fails otherwise)."""
    out = tmp_path / "tp.json"
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    cmd = [
        launcher, "--backend", "ring", "-n", "2", "-p", str(_free_base_port(2)), "--",
        sys.executable, "-m", "mlx_qsa", "bench", "decode", "--tp", "2", "--contexts", "2100",
        "--rows", "1,2", "--repeats", "1", "--warmup", "1", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["tp"] == 2 and doc["rank"] == 0
    for p in doc["points"]:
        assert p["rel_err_vs_unsharded"] <= bench.REL_TOL
        assert p["all_sum_bytes"] == p["rows"] * 2560 * 2
        assert p["step"]["median_us"] > 0 and p["all_sum"]["median_us"] > 0


def test_release_device_memory_empties_mlx_buffer_cache() -> None:
    # a freed buffer stays in MLX's cache until released; the prefill bench releases it after
    # each point so that the next allocation (and torch's) finds the memory
    a = mx.ones((1 << 20,), mx.float32)
    mx.eval(a)
    del a
    assert mx.get_cache_memory() > 0
    bench.release_device_memory()
    assert mx.get_cache_memory() == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_loaded_blas_names_the_mapped_blas_libraries() -> None:
    """MLX's CPU matmuls link a BLAS (its wheel's bundled one unless another is preloaded), so
    a process that has run one has a mapped library named *blas*; nothing else is listed."""
    x = mx.ones((8, 8))
    mx.eval(x @ x)
    got = bench.loaded_blas()
    assert got and all("blas" in os.path.basename(p).lower() for p in got), got
    assert all(os.path.exists(p) for p in got)
