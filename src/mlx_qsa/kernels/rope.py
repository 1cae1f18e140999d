"""Rotate-half RoPE on CUDA (rope.cu): `rope.apply_rope`'s result in one launch and one MLX
primitive instead of ~11 (issue 5: query preparation as a kernel where the portable ops cost
more host time than they are worth). Same bits as the portable routine by construction: the
same float32 products and one rounded add or subtract per channel, then the same cast.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from . import _launch, device, impl_for

_NT = 256
_MAX_CTAS = 1024  # grid-stride beyond this (a decode call has a few thousand elements)
_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def rope_cuda_supports(x: mx.array, cos: mx.array, rotary_dim: int) -> bool:
    """Whether the kernel covers this call on MLX's GPU (sm_80 or newer): x of 2-8 dims in
    bfloat16, float16 or float32 and float32 tables (decided once per shape)."""
    return _supports(x.ndim, x.dtype, cos.dtype, x.shape[-1], rotary_dim)


@functools.lru_cache(maxsize=256)
def _supports(ndim: int, dtype, table_dtype, width: int, rotary_dim: int) -> bool:
    return (
        impl_for("auto", device.current()) == "cuda"
        and 2 <= ndim <= 8
        and dtype in _DTYPES
        and table_dtype == mx.float32
        and 0 < rotary_dim <= width
        and rotary_dim % 2 == 0
    )


def rope_cuda(x: mx.array, cos: mx.array, sin: mx.array, rotary_dim: int) -> mx.array:
    """`apply_rope(x, cos, sin, rotary_dim)` on CUDA: x `[..., n, width]` (any strides; the row
    axis second to last), cos/sin `[n, rotary_dim / 2]` float32 → x's shape and dtype,
    row-contiguous."""
    fn = "rope_cuda"
    sig = _launch.signature((x, cos, sin), rotary_dim)
    run = _PLANS.get(sig, lambda: _plan(fn, x, cos, sin, rotary_dim))
    return run(x, cos, sin)


_PLANS = _launch.Plans()


def _plan(fn: str, x: mx.array, cos: mx.array, sin: mx.array, rotary_dim: int) -> _launch.Run:
    """Checks a call's arguments and plans its launch (once per signature)."""
    _launch.require_cuda(fn)
    if not 2 <= x.ndim <= 8:
        raise ValueError(f"{fn}: x must be [..., n, width] with 2-8 dims, got {list(x.shape)}")
    _launch.check_dtype(fn, "x", x, _DTYPES)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(
            f"{fn}: rotary_dim must be even, positive and at most x's width {x.shape[-1]}, "
            f"got {rotary_dim}"
        )
    table = (x.shape[-2], rotary_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != table:
            raise ValueError(f"{fn}: {name} must be {list(table)}, got {list(t.shape)}")
        _launch.check_dtype(fn, name, t, (mx.float32,))
    shape, dtype = x.shape, x.dtype
    kernel = _launch.build(
        "rope.cu",
        "rope",
        ("x", "cos_t", "sin_t"),
        ("out",),
        (),
        template=(("T", dtype), ("RD", rotary_dim)),
    )
    n_cta = max(1, min(_MAX_CTAS, -(-math.prod(shape) // _NT)))
    return _launch.single_output(kernel, shape, dtype, n_cta, _NT)
