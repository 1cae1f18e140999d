"""RoPE on CUDA (kernels/rope.cu) against the portable `rope.apply_rope`, bit for bit.

The kernel runs on an NVIDIA GPU with MLX's CUDA backend; elsewhere those tests skip, and the
dispatcher `rope.rope(..., impl="cuda")` must fall back to the portable routine (tested here on
any machine).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.rope import apply_rope, rope

HAS_CUDA = mx.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend on an NVIDIA GPU")

_BITS = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}


def _tables(n: int, half: int, seed: int) -> tuple[mx.array, mx.array]:
    phi = mx.random.uniform(-40.0, 40.0, (n, half), key=mx.random.key(seed))
    return mx.cos(phi), mx.sin(phi)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(_BITS[a.dtype]))


# (shape of the array x is a view of, transpose making x, rotary_dim)
CASES = [
    ((1, 24, 1, 256), None, 64),  # decode q
    ((1, 2, 5, 256), None, 64),  # k of a 5-row verify
    ((1, 7, 24, 256), (0, 2, 1, 3), 64),  # q as the layer makes it: a transposed view
    ((1, 4, 3, 128), None, 64),  # index queries
    ((1, 9, 128), None, 64),  # the staging window's block keys
    ((1, 3, 2, 128), None, 128),  # full rotary
    ((37, 64), None, 16),  # 2-D
]


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-rd{c[2]}")
def test_rope_cuda_matches_apply_rope_bit_for_bit(case, dtype) -> None:
    from mlx_qsa.kernels.rope import rope_cuda

    shape, perm, rd = case
    base = (mx.random.normal(shape, key=mx.random.key(len(shape) * 31 + rd)) * 3).astype(dtype)
    x = base if perm is None else base.transpose(*perm)
    cos, sin = _tables(x.shape[-2], rd // 2, seed=rd)
    want = apply_rope(x, cos, sin, rd)
    got = rope_cuda(x, cos, sin, rd)
    assert got.shape == x.shape and got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))


@cuda_only
def test_rope_cuda_inside_compile_and_through_the_dispatcher() -> None:
    x = mx.random.normal((1, 6, 2, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    cos, sin = _tables(6, 32, seed=5)  # x.transpose(0, 2, 1, 3) has 6 rows

    def f(x, cos, sin):
        return rope(x.transpose(0, 2, 1, 3), cos, sin, 64, "cuda")

    want = apply_rope(x.transpose(0, 2, 1, 3), cos, sin, 64)
    np.testing.assert_array_equal(_bits(mx.compile(f)(x, cos, sin)), _bits(want))
    np.testing.assert_array_equal(_bits(f(x, cos, sin)), _bits(want))


@cuda_only
def test_rope_cuda_argument_errors() -> None:
    from mlx_qsa.kernels.rope import rope_cuda

    x = mx.zeros((1, 2, 3, 128), dtype=mx.bfloat16)
    cos, sin = _tables(3, 32, seed=1)
    with pytest.raises(ValueError, match="cos must be"):
        rope_cuda(x, cos[:2], sin, 64)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_cuda(x, cos, sin, 63)
    with pytest.raises(ValueError, match="x must have dtype"):
        rope_cuda(x.astype(mx.int32), cos, sin, 64)
    with pytest.raises(ValueError, match="sin must have dtype"):
        rope_cuda(x, cos, sin.astype(mx.bfloat16), 64)


@pytest.mark.skipif(HAS_CUDA, reason="checks the fallback of a machine without CUDA")
def test_dispatcher_falls_back_to_the_portable_routine_without_cuda() -> None:
    x = mx.random.normal((1, 3, 4, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    cos, sin = _tables(4, 32, seed=9)
    want = apply_rope(x, cos, sin, 64)
    np.testing.assert_array_equal(_bits(rope(x, cos, sin, 64, "cuda")), _bits(want))
    np.testing.assert_array_equal(_bits(rope(x, cos, sin, 64, "portable")), _bits(want))
