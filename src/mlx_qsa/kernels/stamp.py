"""The GPU timer as an MLX array (stamp.cu): the device-side span of queued work, for the
benchmarks' counterpart of torch's CUDA events."""

from __future__ import annotations

import functools

import mlx.core as mx

from . import _launch


@functools.cache
def _kernel():
    return _launch.build("stamp.cu", "stamp", ("after",), ("stamp",), ())


def gpu_stamp(after: mx.array) -> mx.array:
    """uint64 `[1]`: the GPU's global timer (ns) when the stream runs this launch, which MLX
    orders after `after`'s producer (and, on its one stream, after everything queued before)."""
    _launch.require_cuda("gpu_stamp")
    return _kernel()(
        inputs=[after],
        grid=(1, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
    )[0]
