"""The GPU timer stamp (kernels/stamp.cu) the benchmarks time queued MLX work with.

The kernel runs on an NVIDIA GPU with MLX's CUDA backend; there the stamps must be the device's
nanosecond clock in stream order. Elsewhere the launcher refuses with its reason (tested on any
machine)."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from mlx_qsa.kernels.stamp import gpu_stamp

HAS_CUDA = mx.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX's CUDA backend on an NVIDIA GPU")


@cuda_only
def test_stamps_follow_the_stream_and_count_nanoseconds() -> None:
    x = mx.random.normal((4096, 4096))
    mx.eval(x)
    first = gpu_stamp(x)
    mx.eval(first)
    t0 = time.perf_counter()
    y = x
    for _ in range(8):  # ~1 TFLOP: milliseconds on any of these GPUs
        y = y @ x * 1e-3
    last = gpu_stamp(y)
    mx.eval(last)
    host_ns = (time.perf_counter() - t0) * 1e9
    a, b = int(first.item()), int(last.item())
    assert a > 0 and b > a  # ordered after the products, which it waited for
    # the products' GPU time lies within the host's wait for them (clock rates agree to 1e-3)
    assert 1e5 < b - a < host_ns * 1.001


def test_stamp_needs_cuda() -> None:
    if HAS_CUDA:
        pytest.skip("MLX's CUDA backend is present: the refusal applies elsewhere")
    with pytest.raises(RuntimeError, match="gpu_stamp: needs MLX with its CUDA backend"):
        gpu_stamp(mx.zeros((1,)))
