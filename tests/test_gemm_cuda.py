"""The custom CUDA GEMM (`kernels/gemm.py`) against its portable twin `mx.addmm`.

Runs only on MLX with CUDA. Every configuration of the sweep grid (plus the extra tiles the GPU
benchmark uses) runs on shapes that straddle tiles: one row, M not a multiple of TM, N not a
multiple of TN, K not a multiple of TK. Outputs are poisoned with NaN first, so an element the
kernel never writes fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.kernels.gemm import cluster_launch_unsupported, gemm_bias, gemm_bias_reference
from mlx_qsa.sweep import DEFAULT_GRID, DEFAULT_WALKS, agreement

needs_cuda = pytest.mark.skipif(
    not mx.cuda.is_available(),
    reason="the custom GEMM is an mx.fast.cuda_kernel: needs MLX with CUDA",
)

# bf16 outputs of two fp32-accumulating GEMMs that differ in summation order agree to about
# one bf16 ulp per element (SWEEP.md §6: relative_rmse <= 4e-3 at bf16 ulp level).
RMSE_TOL = 4e-3
MAX_ABS_REL = 2.0**-6  # of max |reference|: a few ulps at the largest magnitude

EXTRA_TILES = (
    ((128, 256, 64), 8),
    ((128, 128, 64), 4),
    ((128, 128, 64), 8),
    ((256, 128, 64), 8),
    ((128, 256, 128), 8),
    ((64, 256, 64), 4),
)
CONFIGS = [(t, w, g, "auto") for t, w in DEFAULT_GRID for g in DEFAULT_WALKS]
CONFIGS += [(t, w, 8, "auto") for t, w in EXTRA_TILES]
CONFIGS += [((128, 128, 128), 8, 8, "mma"), ((64, 64, 128), 4, 3, "mma")]
# Plus warpgroup N extents only the TMA family has: 64x192 and 128x192 (64x192 per warpgroup,
# m64n192) and 192x192 (two 192x96 warpgroups, m64n96, a producer warpgroup with setmaxnreg).
# And 192x192 as three 64x192 warpgroups (12 consumer warps, m64n192).
TMA_TILES = EXTRA_TILES + (
    ((128, 192, 64), 8),
    ((192, 192, 64), 8),
    ((64, 192, 64), 4),
    ((192, 192, 64), 12),
)
CONFIGS += [(t, w, g, "tma") for t, w in TMA_TILES for g in (0, 8)]
# Clusters of two blocks sharing W tiles by multicast; M = 37, 131 and 333 leave the last pair of
# tile rows half below M.
MC_TILES = (((128, 256, 64), 8), ((256, 128, 64), 8), ((192, 192, 64), 8), ((128, 128, 64), 4))
# They run only without MLX's CUDA graphs (`cluster_launch_unsupported`), so in a subprocess of
# their own: `test_cluster_families_without_cuda_graphs`.
CLUSTER_CONFIGS = [(t, w, g, "tma_mc") for t, w in MC_TILES for g in (0, 8)]
# The TMA-store epilogue (64-column boxes, so TN a multiple of 64): M = 37, 131 and 333 and
# N = 136, 264 and 520 leave boxes partly outside y, which the TMA unit must clip.
ST_TILES = (
    ((128, 256, 64), 8),
    ((192, 192, 64), 8),
    ((192, 192, 64), 12),
    ((128, 128, 64), 4),
    ((64, 256, 64), 4),
)
CONFIGS += [(t, w, g, "tma_st") for t, w in ST_TILES for g in (0, 8)]
CLUSTER_CONFIGS += [(t, w, g, "tma_mc_st") for t, w in ST_TILES[:3] for g in (0, 8)]
GRAPHS_OFF = cluster_launch_unsupported(os.environ.get("MLX_USE_CUDA_GRAPHS")) is None
# The cluster cases: on a GPU, in the subprocess only.
in_cluster_process = pytest.mark.skipif(
    not (mx.cuda.is_available() and GRAPHS_OFF),
    reason="runs in test_cluster_families_without_cuda_graphs (MLX_USE_CUDA_GRAPHS=0)"
    if mx.cuda.is_available()
    else "the custom GEMM is an mx.fast.cuda_kernel: needs MLX with CUDA",
)

# (M, N, K): one row; M, N and K off every tile; a partial walk_m group; K = D of the model.
SHAPES = [(1, 64, 64), (37, 136, 200), (333, 520, 576), (131, 264, 2560)]
# More tiles than SMs, so each persistent TMA block walks several tiles (and ring phases).
PERSISTENT_SHAPE = (2100, 3000, 320)


def _id(cfg) -> str:
    (tm, tn, tk), warps, walk, family = cfg
    return f"{tm}x{tn}x{tk}-w{warps}-g{walk}-{family}"


def _inputs(m: int, n: int, k: int, seed: int):
    kx, kw, kb = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((m, k), key=kx).astype(mx.bfloat16)
    w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(mx.bfloat16)
    b = (mx.random.normal((n,), key=kb) * 0.1).astype(mx.bfloat16)
    return x, w, b


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CONFIGS, ids=_id)
def test_gemm_matches_addmm(cfg):
    _check_against_addmm(cfg)


def _check_against_addmm(cfg) -> None:
    tile, warps, walk, family = cfg
    shapes = SHAPES + [PERSISTENT_SHAPE] if family.startswith("tma") else SHAPES
    for i, (m, n, k) in enumerate(shapes):
        x, w, b = _inputs(m, n, k, seed=1000 + i)
        y = gemm_bias(
            x, w, b, tile=tile, warps=warps, walk_m=walk, family=family, init_value=math.nan
        )
        ref = gemm_bias_reference(x, w, b)
        assert y.shape == (m, n) and y.dtype == mx.bfloat16
        c = np.array(y.astype(mx.float32))
        r = np.array(ref.astype(mx.float32))
        assert np.isfinite(c).all(), f"{m}x{n}x{k}: {np.count_nonzero(~np.isfinite(c))} unwritten"
        max_abs, rmse, _ = agreement(r, c)
        assert rmse <= RMSE_TOL, f"{m}x{n}x{k}: relative_rmse {rmse}"
        assert max_abs <= MAX_ABS_REL * float(np.abs(r).max()), f"{m}x{n}x{k}: max_abs {max_abs}"
        # Both against float64 on the same bf16 inputs, so a shared error would show too.
        exact = np.array(x.astype(mx.float32), dtype=np.float64) @ np.array(
            w.astype(mx.float32), dtype=np.float64
        ).T + np.array(b.astype(mx.float32), dtype=np.float64)
        assert agreement(exact, c)[1] <= RMSE_TOL


@needs_cuda
@pytest.mark.cuda
def test_gemm_is_deterministic_and_independent_of_walk():
    # Rasterisation changes only which block computes a tile, never the arithmetic.
    x, w, b = _inputs(333, 520, 576, seed=7)
    ys = [gemm_bias(x, w, b, tile=(64, 128, 128), warps=4, walk_m=g) for g in (0, 3, 8, 8)]
    for y in ys[1:]:
        assert mx.array_equal(y, ys[0]).item()


@needs_cuda
@pytest.mark.cuda
def test_tma_gemm_is_deterministic_and_independent_of_walk():
    # Persistent blocks pick up different tiles for each walk; the arithmetic stays the same.
    x, w, b = _inputs(*PERSISTENT_SHAPE, seed=8)
    ys = [
        gemm_bias(x, w, b, tile=(128, 256, 64), warps=8, walk_m=g, family="tma")
        for g in (0, 3, 8, 8)
    ]
    for y in ys[1:]:
        assert mx.array_equal(y, ys[0]).item()
    # The TMA and cp.async wgmma kernels sum each element in the same k order.
    ref = gemm_bias(x, w, b, tile=(128, 256, 64), warps=8, walk_m=8, family="wgmma")
    print("tma vs wgmma bit-equal:", mx.array_equal(ref, ys[0]).item())
    # The TMA store moves the same bf16 values; only the path to y differs.
    for g in (0, 8):
        st = gemm_bias(x, w, b, tile=(128, 256, 64), warps=8, walk_m=g, family="tma_st")
        assert mx.array_equal(st, ys[0]).item()
    wide = gemm_bias(x, w, b, tile=(192, 192, 64), warps=8, walk_m=8, family="tma")
    wide_st = gemm_bias(x, w, b, tile=(192, 192, 64), warps=8, walk_m=8, family="tma_st")
    assert mx.array_equal(wide_st, wide).item()
    # Three 64x192 warpgroups (m64n192) sum each element in the same k order as two 192x96
    # ones (m64n96).
    for family in ("tma", "tma_st"):
        three = gemm_bias(x, w, b, tile=(192, 192, 64), warps=12, walk_m=8, family=family)
        assert mx.array_equal(three, wide).item(), family
    # The clusters' bit-equality with these runs in their own process (below).


@needs_cuda
@pytest.mark.cuda
@pytest.mark.skipif(GRAPHS_OFF, reason="this process runs without MLX's CUDA graphs")
def test_cluster_family_refused_with_cuda_graphs():
    x, w, b = _inputs(37, 136, 200, seed=9)
    for family in ("tma_mc", "tma_mc_st"):
        with pytest.raises(NotImplementedError, match="MLX_USE_CUDA_GRAPHS=0"):
            gemm_bias(x, w, b, tile=(128, 256, 64), warps=8, family=family)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.skipif(GRAPHS_OFF, reason="this process is already the subprocess")
def test_cluster_families_without_cuda_graphs():
    # MLX reads MLX_USE_CUDA_GRAPHS once per process, so the cluster cases run in a child.
    env = {**os.environ, "MLX_USE_CUDA_GRAPHS": "0"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            __file__,
            "-k",
            "cluster_gemm",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{len(CLUSTER_CONFIGS) + 1} passed" in summary, summary
    assert "skipped" not in summary, summary


@in_cluster_process
@pytest.mark.cuda
@pytest.mark.parametrize("cfg", CLUSTER_CONFIGS, ids=_id)
def test_cluster_gemm_matches_addmm(cfg):
    _check_against_addmm(cfg)


@in_cluster_process
@pytest.mark.cuda
def test_cluster_gemm_is_bit_equal_to_one_cta():
    # Multicast changes where W's rows come from, not the arithmetic.
    x, w, b = _inputs(*PERSISTENT_SHAPE, seed=8)
    for tile, warps in (((128, 256, 64), 8), ((192, 192, 64), 8), ((192, 192, 64), 12)):
        one = gemm_bias(x, w, b, tile=tile, warps=warps, walk_m=8, family="tma")
        for family in ("tma_mc", "tma_mc_st"):
            mc = gemm_bias(x, w, b, tile=tile, warps=warps, walk_m=8, family=family)
            assert mx.array_equal(mc, one).item(), (tile, warps, family)


@needs_cuda
def test_gemm_input_checks():
    x, w, b = _inputs(8, 64, 64, seed=3)
    with pytest.raises(ValueError, match="bfloat16"):
        gemm_bias(x.astype(mx.float16), w, b)
    with pytest.raises(ValueError, match=r"expected \[N, K=64\]"):
        gemm_bias(x, w[:, :32], b)
    with pytest.raises(ValueError, match=r"expected \[N=64\]"):
        gemm_bias(x, w, b[:32])
    with pytest.raises(ValueError, match="multiples of 8"):
        gemm_bias(x[:, :60], w[:, :60], b)
    with pytest.raises(ValueError, match="TK must be a multiple of 64"):
        gemm_bias(x, w, b, tile=(64, 64, 32))


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the error raised without CUDA")
def test_gemm_without_cuda_raises():
    x, w, b = _inputs(8, 64, 64, seed=3)
    with pytest.raises(RuntimeError, match="CUDA"):
        gemm_bias(x, w, b)
    # The portable twin runs anywhere.
    assert gemm_bias_reference(x, w, b).shape == (8, 64)
