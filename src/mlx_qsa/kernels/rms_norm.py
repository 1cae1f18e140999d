"""Plain-weight RMSNorm on CUDA (rms_norm.cu): `rope.rms_norm`'s result in one launch and one
MLX primitive instead of four (issue 5: query preparation as kernels where the portable ops cost
more host time than they are worth). Same bits as the portable routine on MLX's CUDA backend:
the same correctly rounded operations, the row sum in the order of MLX's row reduction.
"""

from __future__ import annotations

import functools
import math
import struct

import mlx.core as mx

from . import _launch, device

_NT = 256  # 8 rows (warps) per CTA
_MAX_CTAS = 1024
_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# Row widths MLX 0.32 sums on one warp with four reads per lane (row_reduce_simple): the order
# the kernel reproduces.
WIDTHS = tuple(range(128, 897, 128))


def rms_norm_cuda_supports(x: mx.array, weight: mx.array) -> bool:
    """Whether the kernel covers this call on MLX's GPU (sm_80 or newer): x of 1-8 dims in
    bfloat16, float16 or float32 with its last axis in WIDTHS, a weight vector of that length
    (decided once per shape)."""
    return _supports(x.ndim, x.dtype, weight.ndim, weight.dtype, x.shape[-1], weight.shape[0])


@functools.lru_cache(maxsize=256)
def _supports(ndim: int, dtype, w_ndim: int, w_dtype, width: int, w_len: int) -> bool:
    limits = device.current()
    return (
        limits is not None
        and device.kernels_unsupported(limits) is None
        and 1 <= ndim <= 8
        and dtype in _DTYPES
        and w_ndim == 1
        and w_dtype in _DTYPES
        and width in WIDTHS
        and w_len == width
    )


def eps_bits(eps: float) -> int:
    """eps as the int32 bits of its float32 value (a template value; MLX rounds the Python
    float to float32 when it adds it to a float32 array)."""
    return struct.unpack("<i", struct.pack("<f", eps))[0]


def rms_norm_cuda(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`rms_norm(x, weight, eps)` on CUDA: x `[..., D]` (any strides), weight `[D]` → x's
    shape and dtype, row-contiguous."""
    fn = "rms_norm_cuda"
    sig = _launch.signature((x, weight), eps)
    run = _PLANS.get(sig, lambda: _plan(fn, x, weight, eps))
    return run(x, weight)


_PLANS = _launch.Plans()


def _plan(fn: str, x: mx.array, weight: mx.array, eps: float) -> _launch.Run:
    """Checks a call's arguments and plans its launch (once per signature)."""
    _launch.require_cuda(fn)
    if not 1 <= x.ndim <= 8:
        raise ValueError(f"{fn}: x must be [..., D] with 1-8 dims, got {list(x.shape)}")
    _launch.check_dtype(fn, "x", x, _DTYPES)
    _launch.check_dtype(fn, "weight", weight, _DTYPES)
    width = x.shape[-1]
    if width not in WIDTHS:
        raise ValueError(f"{fn}: x's last axis must be one of {list(WIDTHS)}, got {width}")
    if weight.shape != (width,):
        raise ValueError(f"{fn}: weight must be [{width}], got {list(weight.shape)}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{fn}: eps must be positive and finite, got {eps}")
    kernel = _launch.build("rms_norm.cu", "rms_norm", ("x", "weight"), ("out",), ())
    shape, dtype = x.shape, x.dtype
    rows = math.prod(shape[:-1])
    n_cta = max(1, min(_MAX_CTAS, -(-rows // (_NT // 32))))
    template = [("T", dtype), ("D", width), ("EPS_BITS", eps_bits(eps))]

    def run(x: mx.array, weight: mx.array) -> mx.array:
        return kernel(
            inputs=[x, weight],
            template=template,
            grid=(n_cta * _NT, 1, 1),
            threadgroup=(_NT, 1, 1),
            output_shapes=[shape],
            output_dtypes=[dtype],
        )[0]

    return run
