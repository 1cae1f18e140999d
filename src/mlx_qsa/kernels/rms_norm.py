"""Plain-weight RMSNorm on CUDA (rms_norm.cu), alone, followed by the rotate-half RoPE, or (the
indexer's block keys) preceded by the 4-token mean: `rope.rms_norm`, `rope(rms_norm(...))` and
`indexer.pool_blocks` in one launch and one MLX primitive each instead of four, ~6 and ~10
(issue 5: query preparation and block pooling as kernels where the portable ops cost more host
time than they are worth). The same bits as the portable routines on MLX's CUDA backend: the
same correctly rounded operations, the row sum in the order of MLX's row reduction.
"""

from __future__ import annotations

import functools
import math
import struct

import mlx.core as mx

from . import _launch, device, impl_for

_NT = 256  # 8 rows (warps) per CTA
_MAX_CTAS = 1024
_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# Row widths MLX 0.32 sums on one warp with four reads per lane (row_reduce_simple): the order
# the kernels reproduce.
WIDTHS = tuple(range(128, 897, 128))
_MAX_RD = 128  # RoPE partners within the row's first 128 channels


def rms_norm_cuda_supports(x: mx.array, weight: mx.array) -> bool:
    """Whether the kernel covers `rms_norm(x, weight, eps)` on MLX's GPU (sm_80 or newer): x of
    2-8 dims in bfloat16, float16 or float32 with its last axis in WIDTHS, a weight vector of
    that length (decided once per shape). A 1-D x is left to MLX: its sum reduces every axis,
    which MLX does in another order (all_reduce)."""
    return _supports(x.ndim, x.dtype, weight.ndim, weight.dtype, x.shape[-1], weight.shape[0], 0)


def norm_rope_cuda_supports(x: mx.array, weight: mx.array, rotary_dim: int) -> bool:
    """The same for `rope(rms_norm(x, ...), cos, sin, rotary_dim)`: also rotary_dim a multiple
    of 8, at most 128."""
    return _supports(
        x.ndim, x.dtype, weight.ndim, weight.dtype, x.shape[-1], weight.shape[0], rotary_dim
    )


@functools.lru_cache(maxsize=256)
def _supports(ndim, dtype, w_ndim, w_dtype, width, w_len, rotary_dim) -> bool:
    return (
        impl_for("auto", device.current()) == "cuda"
        and 2 <= ndim <= 8
        and dtype in _DTYPES
        and w_ndim == 1
        and w_dtype in _DTYPES
        and width in WIDTHS
        and w_len == width
        and (rotary_dim == 0 or (rotary_dim % 8 == 0 and 0 < rotary_dim <= min(_MAX_RD, width)))
    )


def eps_bits(eps: float) -> int:
    """eps as the int32 bits of its float32 value (a template value; MLX rounds the Python
    float to float32 when it adds it to a float32 array)."""
    return struct.unpack("<i", struct.pack("<f", eps))[0]


def rms_norm_cuda(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`rms_norm(x, weight, eps)` on CUDA: x `[..., D]` (any strides), weight `[D]` → x's
    shape and dtype, row-contiguous."""
    sig = _launch.signature((x, weight), eps)
    make = lambda: _plan_rows("rms_norm_cuda", x, weight, eps, None, None, 0)  # noqa: E731
    return _PLANS.get(sig, make)(x, weight)


def norm_rope_cuda(
    x: mx.array, weight: mx.array, eps: float, cos: mx.array, sin: mx.array, rotary_dim: int
) -> mx.array:
    """`rope(rms_norm(x, weight, eps), cos, sin, rotary_dim)` on CUDA: x `[..., n, D]` (any
    strides; the table row is the index on the second-to-last axis), cos/sin
    `[n, rotary_dim / 2]` float32 → x's shape and dtype, row-contiguous."""
    sig = _launch.signature((x, weight, cos, sin), eps, rotary_dim)
    make = lambda: _plan_rows("norm_rope_cuda", x, weight, eps, cos, sin, rotary_dim)  # noqa: E731
    return _PLANS.get(sig, make)(x, weight, cos, sin)


def pool_norm_rope_cuda(
    raw: mx.array,
    start: mx.array,
    ratio: int,
    weight: mx.array,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    rotary_dim: int,
) -> mx.array:
    """`indexer.pool_blocks` on CUDA: block keys `[1, n, D]` of blocks start .. start + n - 1
    (n = cos.shape[0]) from the raw-key backing `[1, cap, D]`; start: int32 `[1]`."""
    sig = _launch.signature((raw, start, weight, cos, sin), ratio, eps, rotary_dim)
    make = lambda: _plan_pool(raw, start, ratio, weight, eps, cos, sin, rotary_dim)  # noqa: E731
    return _PLANS.get(sig, make)(raw, start, weight, cos, sin)


_PLANS = _launch.Plans()


def _check(fn: str, width: int, weight: mx.array, eps: float) -> None:
    _launch.check_dtype(fn, "weight", weight, _DTYPES)
    if width not in WIDTHS:
        raise ValueError(f"{fn}: the rows' last axis must be one of {list(WIDTHS)}, got {width}")
    if weight.shape != (width,):
        raise ValueError(f"{fn}: weight must be [{width}], got {list(weight.shape)}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{fn}: eps must be positive and finite, got {eps}")


def _check_tables(fn: str, n: int, cos: mx.array, sin: mx.array, rotary_dim: int, width: int):
    if rotary_dim % 8 or not 0 < rotary_dim <= min(_MAX_RD, width):
        raise ValueError(
            f"{fn}: rotary_dim must be a multiple of 8 in 8..{min(_MAX_RD, width)}, "
            f"got {rotary_dim}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, rotary_dim // 2):
            raise ValueError(f"{fn}: {name} must be {[n, rotary_dim // 2]}, got {list(t.shape)}")
        _launch.check_dtype(fn, name, t, (mx.float32,))


def _runner(kernel, shape: tuple, dtype, rows: int) -> _launch.Run:
    """A planned launch: one warp per row (of `rows`), grid-stride past _MAX_CTAS CTAs."""
    n_cta = max(1, min(_MAX_CTAS, -(-rows // (_NT // 32))))
    return _launch.single_output(kernel, shape, dtype, n_cta, _NT)


def _plan_rows(
    fn: str,
    x: mx.array,
    weight: mx.array,
    eps: float,
    cos: mx.array | None,
    sin: mx.array | None,
    rotary_dim: int,
) -> _launch.Run:
    """Checks a call's arguments and plans its launch (once per signature)."""
    _launch.require_cuda(fn)
    if not 2 <= x.ndim <= 8:
        raise ValueError(f"{fn}: x must be [..., D] with 2-8 dims, got {list(x.shape)}")
    _launch.check_dtype(fn, "x", x, _DTYPES)
    width = x.shape[-1]
    _check(fn, width, weight, eps)
    template = [("T", x.dtype), ("D", width), ("EPS_BITS", eps_bits(eps))]
    if cos is None:
        inputs, section = ("x", "weight"), "norm_core+rows_in+rms_norm"
    else:
        _check_tables(fn, x.shape[-2], cos, sin, rotary_dim, width)
        inputs, section = ("x", "weight", "cos_t", "sin_t"), "norm_core+rope_core+rows_in+norm_rope"
        template.append(("RD", rotary_dim))
    kernel = _launch.build("rms_norm.cu", section, inputs, ("out",), (), template=tuple(template))
    return _runner(kernel, x.shape, x.dtype, math.prod(x.shape[:-1]))


def _plan_pool(
    raw: mx.array,
    start: mx.array,
    ratio: int,
    weight: mx.array,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    rotary_dim: int,
) -> _launch.Run:
    fn = "pool_norm_rope_cuda"
    _launch.require_cuda(fn)
    _launch.check_ndim(fn, "raw", raw, 3, "[1, cap, D]")
    _launch.check_dtype(fn, "raw", raw, _DTYPES)
    _launch.check_dtype(fn, "start", start, (mx.int32,))
    if start.shape != (1,):
        raise ValueError(f"{fn}: start must be [1], got {list(start.shape)}")
    if ratio < 1:
        raise ValueError(f"{fn}: ratio must be at least 1, got {ratio}")
    width = raw.shape[-1]
    _check(fn, width, weight, eps)
    n = cos.shape[0]
    _check_tables(fn, n, cos, sin, rotary_dim, width)
    template = (
        ("T", raw.dtype),
        ("D", width),
        ("EPS_BITS", eps_bits(eps)),
        ("RD", rotary_dim),
        ("R", ratio),
    )
    kernel = _launch.build(
        "rms_norm.cu",
        "norm_core+rope_core+pool_norm_rope",
        ("raw", "start", "weight", "cos_t", "sin_t"),
        ("out",),
        (),
        template=template,
    )
    return _runner(kernel, (1, n, width), raw.dtype, n)
