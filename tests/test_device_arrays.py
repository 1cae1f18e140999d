"""device_arrays: index arrays and constants that kernels read, made in device memory."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.cache import row_index
from mlx_qsa.device_arrays import device_constant, int_arange
from mlx_qsa.rope import text_positions


@pytest.mark.parametrize(
    "start,stop,step",
    [
        (0, 0, 1),
        (5, 6, 1),
        (5, 7, 1),
        (5, 8, 1),
        (131071, 131072, 1),
        (8, 16, 4),
        (8, 12, 4),
        (3, 9, 4),
        (7, 7, 4),
        (10, 4, -3),
    ],
)
def test_values_and_dtype_match_arange(start: int, stop: int, step: int) -> None:
    got = int_arange(start, stop, step)
    want = np.arange(start, stop, step, dtype=np.int32)
    assert got.dtype == mx.int32
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.array(got), want)


def test_short_ranges_are_views_of_three_elements_and_usable_as_indices() -> None:
    # One or two values come from a three-element arange; the view must behave as a plain
    # array everywhere the library uses it (reshape, broadcast, scatter indices).
    pos = int_arange(41, 42)
    backing = mx.zeros((1, 1, 64, 2))
    rows = mx.ones((1, 1, 1, 2))
    index = mx.broadcast_to(pos.reshape(1, 1, 1, 1), rows.shape)
    out = mx.put_along_axis(backing, index, rows, axis=2)
    assert np.array(out)[0, 0, 41].tolist() == [1.0, 1.0]
    assert float(np.array(out).sum()) == 2.0


def test_layer_helpers_use_it() -> None:
    np.testing.assert_array_equal(np.array(text_positions(9, 11)), [9, 10])
    np.testing.assert_array_equal(np.array(text_positions(0, 12, 4)), [0, 4, 8])
    np.testing.assert_array_equal(np.array(row_index(100, 1)), [100])
    np.testing.assert_array_equal(np.array(row_index(100, 5)), np.arange(100, 105))


@pytest.mark.parametrize(
    "values,dtype",
    [
        ([[-1.0], [1.0]], mx.float32),
        ([[-0.0, 1e-30, -3.5e38, float("inf")]], mx.float32),
        ([7], mx.int32),
        ([-2, 3], mx.int32),
        ([1.5, -0.0, 2.25], mx.bfloat16),
        ([True, False, True], mx.bool_),
        ([[0.5] * 40], mx.float32),
    ],
)
def test_device_constant_keeps_shape_dtype_and_bits(values, dtype) -> None:
    host = mx.array(values, dtype=dtype)
    got = device_constant(host)
    assert got.shape == host.shape and got.dtype == host.dtype
    if dtype == mx.bfloat16:
        np.testing.assert_array_equal(np.array(got.view(mx.uint16)), np.array(host.view(mx.uint16)))
    elif dtype == mx.float32:
        np.testing.assert_array_equal(np.array(got.view(mx.uint32)), np.array(host.view(mx.uint32)))
    else:
        np.testing.assert_array_equal(np.array(got), np.array(host))


def test_device_constant_broadcasts_like_the_original_after_the_host_array_is_gone() -> None:
    # The copy of a [2, 1] constant is a reshaped view of a padded buffer: later ops must
    # broadcast it exactly as they broadcast the original.
    host = mx.array([[-1.0], [1.0]])
    got = device_constant(host)
    del host
    x = mx.array([[2.0, 3.0], [4.0, 5.0]])
    np.testing.assert_array_equal(np.array(got * x), [[-2.0, -3.0], [4.0, 5.0]])


def test_rope_constants_are_made_when_a_layer_is_built_not_at_import() -> None:
    # Evaluating at import would start the GPU in every process that imports the package (a
    # forked worker could then not use CUDA); a layer's construction makes them instead.
    import subprocess
    import sys

    code = (
        "import mlx_qsa.rope as r; assert not r._signs, 'made at import'\n"
        "from mlx_qsa import QSAAttention, QSAConfig\n"
        "QSAAttention(QSAConfig(), fused=4)\n"
        "assert r._signs['signs'].tolist() == [[-1.0], [1.0]]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
