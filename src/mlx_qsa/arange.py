"""Small int32 index arrays that GPU kernels read, kept out of MLX's managed-memory pool.

MLX 0.32 on CUDA (`mlx/backend/cuda/allocator.cpp`) serves every array of at most 8 bytes from a
small pool of managed memory (`cudaMallocManaged`, advised `AccessedBy` the device). A kernel
that reads such an array (one or two int32 positions or row indices) then waits on a read that
may cross PCIe: on an H100 at 128K the selector's score pass took 26 us with its one position in
a 4-byte array and 8 us with the same value in a 16-byte one (benchmarks/results/
decode_h100_2026-12-06b, `step_device.sh posab`). One or two values are therefore made as a
view of a three-element array (12 bytes, rounded up to 16 by the allocator): the same values,
one primitive more only when n < 3.
"""

from __future__ import annotations

import mlx.core as mx

MIN_ELEMENTS = 3  # 12 bytes of int32: past the 8-byte pool


def int_arange(start: int, stop: int, step: int = 1) -> mx.array:
    """int32 values start, start+step, ... < stop, never in an allocation of at most 8 bytes."""
    n = len(range(start, stop, step))
    if 0 < n < MIN_ELEMENTS:
        return mx.arange(start, start + MIN_ELEMENTS * step, step, dtype=mx.int32)[:n]
    return mx.arange(start, stop, step, dtype=mx.int32)
