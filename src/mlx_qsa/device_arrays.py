"""Small arrays that GPU kernels read on every step, kept in device memory.

MLX 0.32 on CUDA (`mlx/backend/cuda/allocator.cpp`) puts two kinds of buffers in *managed*
memory (`cudaMallocManaged`) rather than device memory:
- every allocation of at most 8 bytes, from a small pool advised `AccessedBy` the device and
  shared with every host-made scalar: a kernel reading one int32 there waits on it (H100, 128K:
  the selector's score pass took 26 µs with its one position in a 4-byte array and 8 µs with the
  same value in a 16-byte one; benchmarks/results/decode_h100_2026-12-06b and -06c);
- every buffer made without a stream, i.e. every array made from host data (`mx.array(...)`),
  whatever its size.
Arrays made by a GPU op and larger than 8 bytes get device memory. So the helpers below make
one or two values as a view of a three-element array, and turn host constants into GPU-made
copies.
"""

from __future__ import annotations

import mlx.core as mx

MIN_ELEMENTS = 3  # 12 bytes of int32 / float32: past the 8-byte pool


def int_arange(start: int, stop: int, step: int = 1) -> mx.array:
    """int32 values start, start+step, ... < stop, never in an allocation of at most 8 bytes."""
    n = len(range(start, stop, step))
    if 0 < n < MIN_ELEMENTS:
        return mx.arange(start, start + MIN_ELEMENTS * step, step, dtype=mx.int32)[:n]
    return mx.arange(start, stop, step, dtype=mx.int32)


def device_constant(host: mx.array) -> mx.array:
    """An evaluated GPU-made copy of `host` (same shape, dtype and bits; a view of a larger
    buffer when `host` has at most 8 bytes). Not for use inside `mx.compile` (it evaluates).

    The copy is `host * 1` (exact, keeps -0.0) evaluated while `host` is still referenced here,
    so MLX cannot donate the host buffer to the result."""
    flat = host.reshape(-1)
    n = flat.size
    if flat.nbytes <= 8:
        pad = max(MIN_ELEMENTS, -(-9 // flat.itemsize)) - n  # past 8 bytes
        flat = mx.concatenate([flat, mx.zeros((pad,), dtype=flat.dtype)])
    one = mx.array(True) if host.dtype == mx.bool_ else mx.array(1, dtype=host.dtype)
    copy = mx.logical_and(flat, one) if host.dtype == mx.bool_ else flat * one
    mx.eval(copy)
    out = copy[:n].reshape(host.shape)
    mx.eval(out)
    return out
