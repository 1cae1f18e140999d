"""The decode/prefill kernels compiled offline the way MLX builds them (benchmarks/kernel_ptx.py:
common.cuh + each `.cu` section behind a stand-in of MLX's generated signature), by nvcc and
ptxas for sm_90a. Needs nvcc and ptxas on PATH (no GPU): a machine without them skips.

What it guards: a kernel's static shared memory must stay under ``device.STATIC_SMEM_BOUND``,
or a launch whose dynamic request sits just under MLX's opt-in threshold passes the 48 KiB a
block gets without opting in and fails ("invalid argument", seen on an H100 on 2026-12-06).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mlx_qsa.kernels import device

_TOOLS = shutil.which("nvcc") and shutil.which("ptxas")
pytestmark = pytest.mark.skipif(not _TOOLS, reason="needs nvcc and ptxas on PATH (CUDA toolkit)")

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_ptx.py"
# launched without dynamic shared memory: static alone counts
_NO_DYNAMIC = {"flash_merge", "flash_merge_gate", "tile_union"}


def _kernel_ptx():
    spec = importlib.util.spec_from_file_location("kernel_ptx", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(_kernel_ptx().JOBS))
def test_kernel_compiles_with_static_smem_under_the_bound(name, tmp_path):
    kp = _kernel_ptx()
    cu, ptx = tmp_path / f"{name}.cu", tmp_path / f"{name}.ptx"
    cu.write_text(kp.source(*kp.JOBS[name]))
    r = subprocess.run(
        ["nvcc", "-arch=sm_90a", "-std=c++17", "-ptx", *kp.include_args(), "-o", str(ptx), str(cu)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(
        ["ptxas", "-arch=sm_90a", "-v", "-o", os.devnull, str(ptx)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    use = re.search(kp._PTXAS_USE, r.stderr)
    assert use is not None, r.stderr
    static = int(use.group(2) or 0)
    bound = device.DEFAULT_BLOCK_SMEM if name in _NO_DYNAMIC else device.STATIC_SMEM_BOUND
    assert 0 <= static < bound, (name, static)
    assert "spill" not in r.stderr or "0 bytes spill stores, 0 bytes spill loads" in r.stderr


def _pasted(filename: str) -> str:
    """What `_launch.include` stands for: the file's text itself, as it is."""
    from mlx_qsa.kernels import _launch

    return (_launch._DIR / filename).read_text()


def test_sources_as_mlx_gets_them_compile_to_the_same_ptx(tmp_path, monkeypatch):
    # MLX gets each kernel body without comments or indentation (`_launch.compact`) and
    # common.cuh as an `#include` line (`_launch.include`): less text to copy and hash per
    # call. The compiled code must be the one the commented files, pasted whole, describe.
    from mlx_qsa.kernels import _launch

    kp = _kernel_ptx()
    inc = kp.include_args()

    def ptx_of(tag: str) -> dict[str, list[str]]:
        out = {}
        for name in sorted(kp.JOBS):
            cu, ptx = tmp_path / f"{name}_{tag}.cu", tmp_path / f"{name}_{tag}.ptx"
            cu.write_text(kp.source(*kp.JOBS[name]))
            subprocess.run(
                ["nvcc", "-arch=sm_90a", "-std=c++17", "-ptx", *inc, "-o", str(ptx), str(cu)],
                check=True,
            )
            out[name] = [ln for ln in ptx.read_text().split("\n") if not ln.startswith("//")]
        return out

    as_given = ptx_of("given")
    size_given = len(kp.source(*kp.JOBS["fused"]))
    monkeypatch.setattr(_launch, "compact", lambda text: text)
    monkeypatch.setattr(_launch, "include", _pasted)
    _launch.kernel_sections.cache_clear()
    try:
        size_full = len(kp.source(*kp.JOBS["fused"]))
        full = ptx_of("full")
    finally:
        monkeypatch.undo()
        _launch.kernel_sections.cache_clear()
    assert size_given < 0.3 * size_full, (size_given, size_full)
    assert as_given.keys() == full.keys()
    for name in as_given:
        assert as_given[name] == full[name], name


def test_common_header_only_for_bodies_that_use_it():
    # The RoPE and RMSNorm kernels, which use nothing of common.cuh, go without it; the
    # kernels that do (qsa::) include it.
    from mlx_qsa.kernels import _launch

    line = _launch.include("common.cuh")
    for filename in ("rope.cu", "rms_norm.cu"):
        for name, body in _launch.kernel_sections(filename).items():
            assert _launch.header_for(body) == "", (filename, name)
    for filename in ("selector.cu", "flash_decode.cu", "rows_gather.cu", "split_k_merge.cu"):
        for name, body in _launch.kernel_sections(filename).items():
            if "qsa::" in body:
                assert _launch.header_for(body) == line, (filename, name)
    assert _launch.header_for("x = qsa::neg_inf();") == line
    assert _launch.header_for("x = 1.0f;") == ""
    # MLX's device op headers (gate.cuh) only for a body built with the fused output gate
    gated = line + _launch.include("gate.cuh")
    for filename in ("flash_decode.cu", "rows_gather.cu", "split_k_merge.cu"):
        for name, body in _launch.kernel_sections(filename).items():
            assert _launch.header_for("#define QSA_GATE\n" + body) == gated, (filename, name)


_GEMM_PLANS = [  # one of each kernel family, as (tile, warps, family)
    ((192, 192, 64), 8, "tma_st"),
    ((192, 192, 64), 8, "tma_mc_st"),
    ((128, 256, 64), 8, "tma"),
    ((128, 256, 64), 8, "wgmma"),
    ((128, 128, 64), 4, "mma"),
]


def test_gemm_header_included_compiles_to_the_same_ptx(tmp_path, monkeypatch):
    # The GEMM's device code goes to MLX as `#include "…/gemm.cuh"`: each family's kernel must
    # compile to the same PTX as with gemm.cuh pasted in its place.
    import sys

    from mlx_qsa.kernels import _launch
    from mlx_qsa.kernels.gemm import plan_gemm

    sys.path.insert(0, str(_SCRIPT.parent))
    try:
        from gemm_registers import kernel_source
    finally:
        sys.path.pop(0)

    def ptx(src: str, tag: str) -> list[str]:
        cu, out = tmp_path / f"{tag}.cu", tmp_path / f"{tag}.ptx"
        cu.write_text(src)
        subprocess.run(
            ["nvcc", "-arch=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", "-ptx",
             "-o", str(out), str(cu)],
            check=True,
        )  # fmt: skip
        return [ln for ln in out.read_text().split("\n") if not ln.startswith("//")]

    for tile, warps, family in _GEMM_PLANS:
        plan = plan_gemm(tile, warps, 8, family=family)
        tag = f"{family}_{tile[0]}x{tile[1]}"
        given = kernel_source(plan)
        with monkeypatch.context() as m:
            m.setattr(_launch, "include", _pasted)
            whole = kernel_source(plan)
        assert '#include "' in given and len(given) < 0.1 * len(whole), (tag, len(given))
        assert ptx(given, tag + "_given") == ptx(whole, tag + "_whole"), tag
