"""Indexer scoring (`indexer.score_blocks`): per-head accumulation, bits and values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.indexer import SQRT_128_F32, block_penalty, score_blocks


def _inputs(H: int, S: int, N: int, d: int, dtype: mx.Dtype, seed: int) -> tuple:
    rng = np.random.default_rng([31, seed])
    q = mx.array(rng.standard_normal((1, H, S, d), np.float32)).astype(dtype)
    keys_t = mx.array(rng.standard_normal((d, N), np.float32))
    return q, keys_t, block_penalty(N)


def _batched_reference(q: mx.array, keys_t: mx.array, penalty: mx.array) -> mx.array:
    """The straightforward form: all heads' logits in one matmul, then ReLU and the head sum
    in order 0..H_I-1 (what score_blocks computed before its per-head accumulation)."""
    logits = mx.matmul(q[0].astype(mx.float32), keys_t)  # [H_I, S, N]
    acc = mx.maximum(logits[0], 0.0)
    for h in range(1, logits.shape[0]):
        acc = acc + mx.maximum(logits[h], 0.0)
    return acc / mx.array(SQRT_128_F32, dtype=mx.float32) - penalty


CASES = [
    # (H_I, S, N, d_I, dtype): decode, prefill chunks, the real head width, one head
    (4, 1, 37, 128, mx.bfloat16),
    (4, 64, 300, 128, mx.bfloat16),
    (4, 257, 1024, 128, mx.float32),
    (2, 33, 20, 16, mx.bfloat16),
    (1, 8, 9, 16, mx.float32),
]


@pytest.mark.parametrize("H,S,N,d,dtype", CASES)
def test_score_blocks_equals_batched_reference_bit_for_bit(H, S, N, d, dtype):
    q, keys_t, pen = _inputs(H, S, N, d, dtype, seed=S + N)
    got = score_blocks(q, keys_t, pen)
    want = _batched_reference(q, keys_t, pen)
    assert got.shape == (S, N) and got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    # Inside mx.compile (as in the compiled core) the bits are the same too.
    compiled = mx.compile(score_blocks)(q, keys_t, pen)
    np.testing.assert_array_equal(np.array(compiled).view(np.uint32), np.array(got).view(np.uint32))


def test_score_blocks_values_against_float64():
    """Values: sum_h relu(<q_h, k_b>) / sqrt(128) - b·1e-12, here against float64 NumPy."""
    q, keys_t, pen = _inputs(4, 50, 70, 128, mx.bfloat16, seed=5)
    qn = np.array(q.astype(mx.float32), np.float64)[0]
    kn = np.array(keys_t, np.float64)
    want = np.maximum(qn @ kn, 0.0).sum(axis=0) / np.sqrt(128.0) - np.arange(70) * 1e-12
    got = np.array(score_blocks(q, keys_t, pen), np.float64)
    assert (want > 0).any() and (np.maximum(qn @ kn, 0.0) == 0).any()  # ReLU is exercised
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-5)


def test_block_penalty_is_made_once_per_size():
    a, b = block_penalty(1000), block_penalty(1000)
    assert a is b  # kept: no new array, no evaluation per call
    want = np.arange(1000, dtype=np.float32) * np.float32(1e-12)
    np.testing.assert_array_equal(np.array(a).view(np.uint32), want.view(np.uint32))
    assert block_penalty(1001).shape == (1001,)
