"""Prefill selection on CUDA (tensor-core score producer + the top-k kernel) against the
portable twin (sequential float32 accumulation) and float64; skips without MLX's CUDA backend."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_decode import bf16, make_selector_inputs, ref_adj, ref_select

from mlx_qsa.kernels.prefill_score import prefill_scores_cuda, select_prefill_cuda
from mlx_qsa.kernels.selector import select_blocks_portable

pytestmark = pytest.mark.skipif(
    not mx.cuda.is_available(), reason="needs MLX's CUDA backend on an NVIDIA GPU"
)


def _inputs(rng, S, P, quantized=False):
    pos = np.arange(P, P + S)
    nb_max = (pos[-1] + 1) // 4
    cap = nb_max + 37  # not a multiple of the 64-block tile; rows past nb are garbage (NaN)
    q, k, qm, km = make_selector_inputs(rng, S, 4, cap, nb_max, quantized=quantized)
    q4 = qm.transpose(1, 0, 2)[None]  # the layer's [1, H_I, S, d_I]
    return q, k, q4, km, pos, mx.array(pos.astype(np.int32))


@pytest.mark.parametrize("S,P", [(100, 1990), (64, 5000), (257, 2047), (130, 40000)])
def test_select_prefill_matches_references(S, P):
    rng = np.random.default_rng([41, S, P])
    q, k, q4, km, pos, pm = _inputs(rng, S, P)
    ids, valid, scores = select_prefill_cuda(q4, km, pm)
    adj = ref_adj(q, k)
    ref = ref_select(adj, pos, 512, 4)
    np.testing.assert_array_equal(np.array(valid), ref[1])
    np.testing.assert_array_equal(np.array(ids), ref[0])
    got = np.array(scores)
    fin = ref[1]
    np.testing.assert_allclose(got[fin], ref[2][fin], rtol=1e-5, atol=1e-6)
    assert (got[~fin] == -np.inf).all()
    twin = select_blocks_portable(bf16(q), km, pm)
    np.testing.assert_array_equal(np.array(twin[0]), np.array(ids))


@pytest.mark.parametrize("levels", [1, 3])
def test_exact_dots_give_exact_scores_and_ties_to_low_ids(levels):
    """Small-integer inputs: every dot product is exact in any order, so scores equal the
    twin's bit for bit and the many ties resolve to the lowest ids exactly as specified."""
    rng = np.random.default_rng([43, levels])
    q, k, q4, km, pos, pm = _inputs(rng, 96, 6000, quantized=True)
    got = select_prefill_cuda(q4, km, pm)
    twin = select_blocks_portable(bf16(q), km, pm)
    for a, b in zip(got, twin, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_chunks_equal_one_plane():
    rng = np.random.default_rng(47)
    _, _, q4, km, _, pm = _inputs(rng, 200, 9000)
    whole = select_prefill_cuda(q4, km, pm)
    for chunk in (48, 64, 199):
        part = select_prefill_cuda(q4, km, pm, chunk=chunk)
        for a, b in zip(whole, part, strict=True):
            assert mx.array_equal(a, b).item()


def test_scores_plane_and_summaries():
    rng = np.random.default_rng(53)
    q, k, q4, km, pos, pm = _inputs(rng, 70, 3000)
    adj, summ, nbs = prefill_scores_cuda(q4, km, pm)
    ref = ref_adj(q, k)
    nb = (pos + 1) // 4
    np.testing.assert_array_equal(np.array(nbs), nb)
    a = np.array(adj)
    for r in (0, 33, 69):
        np.testing.assert_allclose(a[r, : nb[r]], ref[r, : nb[r]], rtol=1e-5, atol=1e-6)
    s = np.array(summ).reshape(70, -1, 8)
    # each complete chunk's summaries are its 8 largest keys (order-preserving uint32), descending
    for r in (0, 69):
        for c in range(nb[r] // 32):
            vals = np.sort(a[r, 32 * c : 32 * c + 32])[::-1][:8]
            top = s[r, c].astype(np.uint32)
            assert (top > 0).all()
            f = (
                np.where(top & 0x80000000, top & 0x7FFFFFFF, ~top)
                .astype(np.uint32)
                .view(np.float32)
            )
            np.testing.assert_array_equal(f, vals.astype(np.float32))
