"""RMSNorm on CUDA (kernels/rms_norm.cu) against the portable routines, bit for bit: alone
(`rope.rms_norm`), followed by RoPE (`rope.norm_rope`: query preparation) and preceded by the
4-token mean (`indexer.pool_blocks`: block pooling).

The kernel reproduces MLX's CUDA row sum order, so the comparison is against the portable
routine run by MLX's CUDA backend; it runs on an NVIDIA GPU and skips elsewhere. The dispatcher
`rope.norm(..., impl="cuda")` must fall back to the portable routine without CUDA (tested on any
machine), and the launch's pure pieces are tested everywhere.
"""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.config import QSAConfig
from mlx_qsa.indexer import IndexerGeometry, pool_blocks
from mlx_qsa.kernels.rms_norm import WIDTHS, eps_bits, rms_norm_cuda_supports
from mlx_qsa.rope import apply_rope, norm, norm_rope, rms_norm, text_rope

HAS_CUDA = mx.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend on an NVIDIA GPU")

_BITS = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(_BITS[a.dtype]))


def _x(shape, dtype, seed: int) -> mx.array:
    # Rows of very different scales (and a few zero rows): the sum's order shows in the bits.
    k1, k2 = mx.random.split(mx.random.key(seed))
    scale = mx.exp(mx.random.uniform(-6.0, 6.0, (*shape[:-1], 1), key=k1))
    x = mx.random.normal(shape, key=k2) * scale
    if x.ndim >= 2 and x.shape[-2] > 2:
        x[..., 1, :] = 0.0
    return x.astype(dtype)


# (shape of the array x is made from, how x is made from it, weight dtype)
CASES = [
    ((1, 1, 24, 256), "plain", None),  # decode q rows
    ((1, 1, 24, 2, 256), "split", None),  # q as the layer makes it: half of q_proj's rows
    ((1, 5, 2, 256), "plain", mx.float32),  # k of a 5-row verify, float32 weight
    ((1, 4, 3, 128), "plain", None),  # index queries
    ((1, 9, 128), "plain", None),  # the staging window's block keys
    ((1, 2048, 24, 2, 256), "split", None),  # a prefill chunk's q: past 1024 rows (MLX's M = 2)
    ((3, 7, 512), "transpose", None),  # a dense transposed view
    ((40, 896), "plain", None),  # the widest one-warp row
    ((5, 384), "plain", None),
]


def _make(base: mx.array, how: str) -> mx.array:
    if how == "split":
        return mx.split(base, 2, axis=3)[0].squeeze(3)
    if how == "transpose":
        return base.transpose(1, 0, 2)
    return base


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_rms_norm_cuda_matches_the_portable_routine_bit_for_bit(case, dtype) -> None:
    from mlx_qsa.kernels.rms_norm import rms_norm_cuda

    shape, how, w_dtype = case
    x = _make(_x(shape, dtype, seed=len(shape) * 17 + shape[-1]), how)
    w = (1.0 + 0.3 * mx.random.normal((x.shape[-1],), key=mx.random.key(7))).astype(
        w_dtype or dtype
    )
    for eps in (1e-6, 1e-5):
        want = rms_norm(x, w, eps)
        got = rms_norm_cuda(x, w, eps)
        assert got.shape == x.shape and got.dtype == dtype
        np.testing.assert_array_equal(_bits(got), _bits(want))


@cuda_only
def test_rms_norm_cuda_inside_compile_and_through_the_dispatcher() -> None:
    base = _x((1, 3, 24, 2, 256), mx.bfloat16, seed=4)
    w = (1.0 + 0.1 * mx.random.normal((256,), key=mx.random.key(8))).astype(mx.bfloat16)

    def f(base, w):
        return norm(mx.split(base, 2, axis=3)[0].squeeze(3), w, 1e-6, "cuda")

    want = rms_norm(mx.split(base, 2, axis=3)[0].squeeze(3), w, 1e-6)
    np.testing.assert_array_equal(_bits(mx.compile(f)(base, w)), _bits(want))
    np.testing.assert_array_equal(_bits(f(base, w)), _bits(want))
    # And compiled portable against compiled kernel: the portable routine fused by mx.compile.
    g = mx.compile(lambda base, w: rms_norm(mx.split(base, 2, axis=3)[0].squeeze(3), w, 1e-6))
    np.testing.assert_array_equal(_bits(g(base, w)), _bits(want))


@cuda_only
def test_rms_norm_cuda_argument_errors() -> None:
    from mlx_qsa.kernels.rms_norm import rms_norm_cuda

    x = mx.zeros((2, 256), dtype=mx.bfloat16)
    w = mx.ones((256,), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="last axis must be one of"):
        rms_norm_cuda(mx.zeros((2, 200), dtype=mx.bfloat16), w[:200], 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[256\]"):
        rms_norm_cuda(x, w[:128], 1e-6)
    with pytest.raises(ValueError, match="x must have dtype"):
        rms_norm_cuda(x.astype(mx.int32), w, 1e-6)
    with pytest.raises(ValueError, match="eps must be positive"):
        rms_norm_cuda(x, w, 0.0)
    with pytest.raises(ValueError, match="2-8 dims"):
        rms_norm_cuda(w, w, 1e-6)  # 1-D: MLX sums it with all_reduce, in another order
    assert not rms_norm_cuda_supports(w, w)


def test_eps_bits_and_widths() -> None:
    assert eps_bits(1e-6) == struct.unpack("<i", struct.pack("<f", 1e-6))[0] == 897988541
    assert struct.unpack("<f", struct.pack("<i", eps_bits(1e-5)))[0] == np.float32(1e-5)
    # MLX 0.32 sums rows of 128 K floats (K < 8) on one warp, four reads per lane.
    assert WIDTHS == (128, 256, 384, 512, 640, 768, 896)


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback of a machine without CUDA")
def test_dispatcher_falls_back_to_the_portable_routine_without_cuda() -> None:
    x = _x((1, 3, 4, 128), mx.bfloat16, seed=2)
    w = mx.ones((128,), dtype=mx.bfloat16) * 1.5
    assert not rms_norm_cuda_supports(x, w)
    want = rms_norm(x, w, 1e-6)
    np.testing.assert_array_equal(_bits(norm(x, w, 1e-6, "cuda")), _bits(want))
    np.testing.assert_array_equal(_bits(norm(x, w, 1e-6, "portable")), _bits(want))


def _tables(n: int, half: int, seed: int) -> tuple[mx.array, mx.array]:
    phi = mx.random.uniform(-40.0, 40.0, (n, half), key=mx.random.key(seed))
    return mx.cos(phi), mx.sin(phi)


# (shape x is made from, how, transpose to the rope layout, rotary_dim)
ROPE_CASES = [
    ((1, 1, 24, 2, 256), "split", (0, 2, 1, 3), 64),  # decode q
    ((1, 3, 24, 2, 256), "split", (0, 2, 1, 3), 64),  # a 3-row verify's q
    ((1, 5, 2, 256), "plain", (0, 2, 1, 3), 64),  # k
    ((1, 7, 4, 128), "plain", (0, 2, 1, 3), 64),  # index queries (heads first)
    ((1, 6, 2, 128), "plain", (0, 2, 1, 3), 128),  # full rotary
    ((1, 6, 2, 256), "plain", (0, 2, 1, 3), 32),
    ((9, 384), "plain", None, 48),  # 2-D, partners 6 lanes apart
]


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-rd{c[3]}")
def test_norm_rope_cuda_matches_norm_then_rope_bit_for_bit(case, dtype) -> None:
    from mlx_qsa.kernels.rms_norm import norm_rope_cuda

    shape, how, perm, rd = case
    x = _make(_x(shape, dtype, seed=len(shape) * 13 + rd), how)
    w = (1.0 + 0.3 * mx.random.normal((x.shape[-1],), key=mx.random.key(5))).astype(dtype)
    view = x if perm is None else x.transpose(perm)
    cos, sin = _tables(view.shape[-2], rd // 2, seed=rd)
    normed = rms_norm(x, w, 1e-6)
    want = apply_rope(normed if perm is None else normed.transpose(perm), cos, sin, rd)
    got = norm_rope_cuda(view, w, 1e-6, cos, sin, rd)
    assert got.shape == view.shape and got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # the dispatcher, eager and compiled
    f = lambda x, w, c, s: norm_rope(x, w, 1e-6, c, s, rd, "cuda", perm)  # noqa: E731
    np.testing.assert_array_equal(_bits(f(x, w, cos, sin)), _bits(want))
    np.testing.assert_array_equal(_bits(mx.compile(f)(x, w, cos, sin)), _bits(want))


def _geometry() -> IndexerGeometry:
    return IndexerGeometry.of(QSAConfig())


@cuda_only
@pytest.mark.parametrize("n_blocks", [1, 2, 9, 300])
def test_pool_norm_rope_cuda_matches_pool_blocks_bit_for_bit(n_blocks) -> None:
    g = _geometry()
    cap = 4 * (n_blocks + 40)
    raw = _x((1, cap, g.head_dim), mx.bfloat16, seed=n_blocks)
    w = (1.0 + 0.2 * mx.random.normal((g.head_dim,), key=mx.random.key(3))).astype(mx.bfloat16)
    for first in (0, 13):
        _, cos, sin = text_rope(QSAConfig(), first * g.ratio, (first + n_blocks) * g.ratio, g.ratio)
        want = pool_blocks(raw, first, n_blocks, w, cos, sin, g, "portable")
        got = pool_blocks(raw, first, n_blocks, w, cos, sin, g, "cuda")
        assert got.shape == want.shape == (1, n_blocks, g.head_dim)
        np.testing.assert_array_equal(_bits(got), _bits(want))
        # the compiled core's form: the first block as an int32 array, inside mx.compile
        start = mx.array([first], dtype=mx.int32)

        def f(raw, start, w, cos, sin, impl):
            return pool_blocks(raw, start, n_blocks, w, cos, sin, g, impl)

        want_c = mx.compile(lambda *a: f(*a, "portable"))(raw, start, w, cos, sin)
        got_c = mx.compile(lambda *a: f(*a, "cuda"))(raw, start, w, cos, sin)
        np.testing.assert_array_equal(_bits(want_c), _bits(want))
        np.testing.assert_array_equal(_bits(got_c), _bits(want))


@cuda_only
def test_pool_and_norm_rope_argument_errors() -> None:
    from mlx_qsa.kernels.rms_norm import norm_rope_cuda, pool_norm_rope_cuda

    x = mx.zeros((1, 2, 3, 128), dtype=mx.bfloat16)
    w = mx.ones((128,), dtype=mx.bfloat16)
    cos, sin = _tables(3, 32, seed=1)
    with pytest.raises(ValueError, match="rotary_dim must be a multiple of 8"):
        norm_rope_cuda(x, w, 1e-6, cos, sin, 60)
    with pytest.raises(ValueError, match="sin must be"):
        norm_rope_cuda(x, w, 1e-6, cos, sin[:2], 64)
    raw = mx.zeros((1, 64, 128), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match=r"start must be \[1\]"):
        pool_norm_rope_cuda(raw, mx.zeros((2,), mx.int32), 4, w, 1e-6, cos, sin, 64)
    with pytest.raises(ValueError, match="start must have dtype"):
        pool_norm_rope_cuda(raw, mx.zeros((1,), mx.float32), 4, w, 1e-6, cos, sin, 64)


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback of a machine without CUDA")
def test_norm_rope_and_pooling_fall_back_without_cuda() -> None:
    x = _x((1, 3, 24, 2, 256), mx.bfloat16, seed=6)
    q = mx.split(x, 2, axis=3)[0].squeeze(3)
    w = mx.ones((256,), dtype=mx.bfloat16) * 0.75
    cos, sin = _tables(3, 32, seed=2)
    want = apply_rope(rms_norm(q, w, 1e-6).transpose(0, 2, 1, 3), cos, sin, 64)
    got = norm_rope(q, w, 1e-6, cos, sin, 64, "cuda", (0, 2, 1, 3))
    np.testing.assert_array_equal(_bits(got), _bits(want))
    g = _geometry()
    raw = _x((1, 64, g.head_dim), mx.bfloat16, seed=1)
    wk = mx.ones((g.head_dim,), dtype=mx.bfloat16)
    _, cos, sin = text_rope(QSAConfig(), 8, 20, g.ratio)
    np.testing.assert_array_equal(
        _bits(pool_blocks(raw, 2, 3, wk, cos, sin, g, "cuda")),
        _bits(pool_blocks(raw, 2, 3, wk, cos, sin, g, "portable")),
    )
