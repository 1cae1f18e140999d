"""Host side of the TMA GEMM: tensor-map templates, encoded through the CUDA driver.

`mx.fast.cuda_kernel` passes arrays only, and an MLX array's device address is not known before
the kernel runs, so the host encodes each operand's tensor map at a placeholder address with
`cuTensorMapEncodeTiled`; the kernel copies it, points it at the operand (`tensormap.replace`)
and publishes it for its TMA loads (gemm.cuh). The driver library is loaded on first use only.
"""

from __future__ import annotations

import ctypes

from .device import check_cu, driver

TENSOR_MAP_BYTES = 128
PLACEHOLDER_ADDRESS = 1 << 20  # 16-byte aligned; replaced on the device before any load

# cuda.h enumerations (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...OOBfill)
_BFLOAT16 = 9
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0


def encode_bf16_rows(rows: int, cols: int, box_rows: int) -> bytes:
    """Tensor map of a row-major bf16 matrix `[rows, cols]`, box = 64 columns x `box_rows` rows.

    The box's 128-byte rows land in shared memory with the 128-byte swizzle, the layout the
    kernel's wgmma descriptors read; elements outside the matrix arrive as zeros.
    """
    if rows < 1 or cols < 1 or cols % 8:
        raise ValueError(
            f"encode_bf16_rows: expected rows >= 1 and cols a multiple of 8, got [{rows}, {cols}]"
        )
    if not 1 <= box_rows <= 256:
        raise ValueError(f"encode_bf16_rows(box_rows): expected 1..256, got {box_rows}")
    lib = driver()
    buf = (ctypes.c_uint8 * (2 * TENSOR_MAP_BYTES))()
    base = ctypes.addressof(buf)
    aligned = (base + 63) & ~63  # CUtensorMap is 64-byte aligned
    u64 = ctypes.c_uint64
    dims = (u64 * 2)(cols, rows)  # innermost first
    strides = (u64 * 1)(cols * 2)  # bytes between rows
    box = (ctypes.c_uint32 * 2)(64, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    code = fn(
        ctypes.c_void_p(aligned),
        ctypes.c_int(_BFLOAT16),
        ctypes.c_uint32(2),
        ctypes.c_void_p(PLACEHOLDER_ADDRESS),
        dims,
        strides,
        box,
        elem,
        ctypes.c_int(_INTERLEAVE_NONE),
        ctypes.c_int(_SWIZZLE_128B),
        ctypes.c_int(_L2_PROMOTION_256B),
        ctypes.c_int(_OOB_FILL_ZERO),
    )
    check_cu(code, f"cuTensorMapEncodeTiled([{rows}, {cols}] bf16, box [{box_rows}, 64])")
    return ctypes.string_at(aligned, TENSOR_MAP_BYTES)
