"""The score division's fast form (`qsa::div_sqrt128`, common.cuh) against `__fdiv_rn`, over
float32 bit patterns on the GPU (exact_div.cu): the check that lets the score kernels use it."""

from __future__ import annotations

import functools

import mlx.core as mx

from . import _launch

_PER, _THREADS = 64, 256
_LAUNCH = 1 << 30  # patterns a launch


@functools.cache
def _kernel():
    return _launch.build(
        "exact_div.cu", "check", ("lo",), ("bad", "first"), (), template=(("PER", _PER),)
    )


def div_sqrt128_mismatches(lo: int = 0, count: int = 1 << 32) -> tuple[int, int | None]:
    """(how many float32 bit patterns in [lo, lo + count) give other bits through
    `qsa::div_sqrt128` than through `__fdiv_rn(x, sqrt(128))`, the smallest such pattern or
    None); `lo` and `count` multiples of 2^30 (whole launches)."""
    fn = "div_sqrt128_mismatches"
    if lo % _LAUNCH or count % _LAUNCH or not 0 <= lo < lo + count <= 1 << 32:
        raise ValueError(
            f"{fn}: lo and count must be multiples of 2^30 with 0 <= lo < lo + count <= 2^32, "
            f"got lo={lo}, count={count}"
        )
    _launch.require_cuda(fn)
    n_bad, first = 0, None
    for start in range(lo, lo + count, _LAUNCH):
        bad, comp = _kernel()(
            inputs=[mx.array([start], dtype=mx.uint32)],
            grid=(_LAUNCH // _PER, 1, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[(1,), (1,)],
            output_dtypes=[mx.uint32, mx.uint32],
            init_value=0,
        )
        n = int(bad.item())
        if n:
            n_bad += n
            u = ~int(comp.item()) & 0xFFFFFFFF
            first = u if first is None else min(first, u)
    return n_bad, first
