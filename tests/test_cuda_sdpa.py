"""The `sdpa` consumer's masked-attention kernel (kernels/sdpa.cu) against float64 and against
MLX's own SDPA (the portable path): causal rows, boolean keep-masks (strided, sparse, empty
rows, stretches no row sees, a mask past the causal bound), query-head groups of 2 to 16.
The GPU tests skip without MLX's CUDA backend; the argument checks run everywhere."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_decode import bf16, needs_cuda, to_np

from mlx_qsa.consumers import masked_sdpa_form
from mlx_qsa.consumers.sdpa import sdpa
from mlx_qsa.kernels.sdpa import (
    MAX_SPLIT,
    MIN_ROWS,
    TILING,
    TILINGS,
    Tiling,
    sdpa_cuda,
    sdpa_unsupported,
    smem_bytes,
    split_count,
)


def _inputs(rng, H, Hkv, d, S, P):
    """q and K/V backings with room past T = P + S; the rows past T are NaN (a kernel that
    read one would show it)."""
    T = P + S
    cap = -(-(T + 5) // 256) * 256
    q = rng.standard_normal((1, H, S, d)).astype(np.float32)
    keys = rng.standard_normal((1, Hkv, cap, d)).astype(np.float32)
    values = rng.standard_normal((1, Hkv, cap, d)).astype(np.float32)
    keys[:, :, T:], values[:, :, T:] = np.nan, np.nan
    pos = mx.array(np.arange(P, T, dtype=np.int32))
    return bf16(q), bf16(keys), bf16(values), pos


def _reference(q, keys, values, seen: np.ndarray, scale: float) -> np.ndarray:
    """float64 attention of every row over the tokens `seen[r]` ([S, T] bool); 0 where none."""
    qn = to_np(q)[0].astype(np.float64)
    T = seen.shape[1]
    kn = to_np(keys)[0, :, :T].astype(np.float64)
    vn = to_np(values)[0, :, :T].astype(np.float64)
    g = qn.shape[0] // kn.shape[0]
    out = np.zeros(qn.shape)
    for h in range(qn.shape[0]):
        s = qn[h] @ kn[h // g].T * scale
        s = np.where(seen, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        e = np.where(seen, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
        den = e.sum(axis=1, keepdims=True)
        out[h] = np.where(den > 0, (e @ vn[h // g]) / np.where(den > 0, den, 1.0), 0.0)
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check_rows(got: np.ndarray, ref: np.ndarray, seen: np.ndarray) -> None:
    assert np.isfinite(got).all()
    for r in range(seen.shape[0]):
        if seen[r].any():
            assert _rel(got[:, r], ref[:, r]) <= 1e-2, f"row {r}"
        else:
            assert (got[:, r] == 0).all(), f"row {r} sees nothing: 0"


CASES = [
    (24, 2, 256, 37, 0),  # the first chunk: causal from token 0, S not a multiple of 8
    (24, 2, 256, 100, 1990),  # across the first sparse token of the real budget
    (24, 2, 256, 130, 5000),
    (8, 2, 128, 67, 50),
    (4, 1, 64, 41, 0),
    (16, 1, 256, 20, 300),  # 16 heads a KV head: eight warps
    (4, 2, 256, 24, 70),  # 2 heads a KV head: one warp
    (24, 2, 256, 2, 9000),  # verify rows: one row tile, split 32 ways
    (24, 2, 256, 5, 700),
]


@needs_cuda
@pytest.mark.parametrize("H,Hkv,d,S,P", CASES)
def test_causal_rows_match_float64_and_mlx_sdpa(H, Hkv, d, S, P):
    rng = np.random.default_rng([71, H, d, S, P])
    q, keys, values, pos = _inputs(rng, H, Hkv, d, S, P)
    T, scale = P + S, 1 / math.sqrt(d)
    out = sdpa_cuda(q, keys, values, pos, scale=scale)
    assert out.shape == q.shape and out.dtype == mx.bfloat16
    seen = np.arange(T)[None, :] <= np.arange(P, T)[:, None]
    got = to_np(out)[0]
    _check_rows(got, _reference(q, keys, values, seen, scale), seen)
    twin = to_np(sdpa(q, keys, values, T, scale, mask="causal"))[0]
    assert _rel(got, twin) <= 1e-2
    again = sdpa_cuda(q, keys, values, pos, scale=scale)
    assert mx.array_equal(out, again).item()  # fixed order: the same bits every run


def _keep_mask(rng, S, P, width, density, causal=True):
    """A QSA-like keep-mask [S, width] (4-token blocks at `density`, plus the row's own tail),
    with row 3 empty and a 130-token stretch no row keeps; `causal=False` also keeps random
    tokens past each row's position."""
    T = P + S
    nb = -(-width // 4)
    blocks = rng.random((S, nb)) < density
    keep = np.repeat(blocks, 4, axis=1)[:, :width]
    t = np.arange(width)[None, :]
    p = np.arange(P, T)[:, None]
    keep |= (t >= (p + 1) // 4 * 4) & (t <= p)
    if causal:
        keep &= t <= p
    else:
        keep |= (rng.random((S, width)) < 0.05) & (t < T)
    keep[:, 64:194] = False
    keep[min(3, S - 1)] = False
    return keep


@needs_cuda
@pytest.mark.parametrize(
    "H,Hkv,d,S,P,density,causal",
    [
        (24, 2, 256, 33, 2051, 0.2, True),
        (24, 2, 256, 200, 3000, 0.05, True),
        (24, 2, 256, 19, 800, 0.6, False),
        (8, 2, 128, 70, 400, 0.3, True),
        (16, 1, 256, 16, 1000, 0.1, False),
        (24, 2, 256, 4, 6000, 0.1, True),
    ],
)
def test_keep_masks_match_float64_and_mlx_sdpa(H, Hkv, d, S, P, density, causal):
    rng = np.random.default_rng([73, H, d, S, P])
    q, keys, values, pos = _inputs(rng, H, Hkv, d, S, P)
    T, scale = P + S, 1 / math.sqrt(d)
    keep = _keep_mask(rng, S, P, T + 40, density, causal)
    wide = mx.array(keep)[None, None]
    mask = wide[..., :T]  # a strided view, as the layer slices its mask to T
    out = sdpa_cuda(q, keys, values, pos, scale=scale, mask=mask)
    got = to_np(out)[0]
    seen = keep[:, :T]
    if causal:  # the bound the layer passes for its masks: the same tokens (split-K shares
        # the shorter range, so the sums may run in another order)
        bounded = sdpa_cuda(q, keys, values, pos, scale=scale, mask=mask, within_causal=True)
        _check_rows(to_np(bounded)[0], _reference(q, keys, values, seen, scale), seen)
    _check_rows(got, _reference(q, keys, values, seen, scale), seen)
    twin = to_np(sdpa(q, keys, values, T, scale, mask=mask))[0]
    rows = seen.any(axis=1)  # MLX's softmax of a row with no token is NaN
    assert _rel(got[:, rows], twin[:, rows]) <= 1e-2
    dense = sdpa_cuda(q, keys, values, pos, scale=scale, mask=mx.contiguous(mask))
    assert mx.array_equal(out, dense).item()


@needs_cuda
@pytest.mark.parametrize("masked", [False, True])
def test_every_split_count_agrees(masked):
    """One launch and split-K with 2 to 64 splits (most of them empty at 64: their partials
    carry no weight) give the same attention; each form gives the same bits every run."""
    rng = np.random.default_rng([89, masked])
    S, P = 24, 1500
    q, keys, values, pos = _inputs(rng, 24, 2, 256, S, P)
    T, scale = P + S, 1 / 16
    keep = _keep_mask(rng, S, P, T, 0.3) if masked else None
    mask = mx.array(keep)[None, None] if masked else None
    seen = keep if masked else np.arange(T)[None, :] <= np.arange(P, T)[:, None]
    ref = _reference(q, keys, values, seen, scale)
    outs = {}
    for n in (1, 2, 8, MAX_SPLIT):
        outs[n] = sdpa_cuda(q, keys, values, pos, scale=scale, mask=mask, nsplit=n)
        _check_rows(to_np(outs[n])[0], ref, seen)
        again = sdpa_cuda(q, keys, values, pos, scale=scale, mask=mask, nsplit=n)
        assert mx.array_equal(outs[n], again).item()
    for n in (2, 8, MAX_SPLIT):
        assert _rel(to_np(outs[n])[0], to_np(outs[1])[0]) <= 1e-2


@needs_cuda
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: t.label)
def test_every_tiling_matches_float64(tiling):
    """Each K/V streaming form (32 or 64 tokens a stage, 2 to 4 slots, K and V in one cp.async
    group or two): causal rows, a keep-mask within the causal bound read as words and a strided
    one read byte by byte, one launch and split-K, all against float64."""
    rng = np.random.default_rng([97, tiling.step, tiling.nstage, tiling.kv_split])
    S, P = 45, 2100  # tokens not a multiple of either step; the row tiles' last one partial
    q, keys, values, pos = _inputs(rng, 24, 2, 256, S, P)
    T, scale = P + S, 1 / 16
    causal = np.arange(T)[None, :] <= np.arange(P, T)[:, None]
    keep = _keep_mask(rng, S, P, T + 3, 0.15)
    ref_c = _reference(q, keys, values, causal, scale)
    ref_m = _reference(q, keys, values, keep[:, :T], scale)
    words = mx.array(np.pad(keep[:, :T], ((0, 0), (0, -T % 4))))[None, None, :, :T]
    strided = mx.array(keep)[None, None, :, :T]  # rows T + 3 bytes apart: byte by byte
    for nsplit in (1, 4):
        out = sdpa_cuda(q, keys, values, pos, scale=scale, nsplit=nsplit, tiling=tiling)
        _check_rows(to_np(out)[0], ref_c, causal)
        for mask in (words, strided):
            out = sdpa_cuda(
                q, keys, values, pos, scale=scale, mask=mask, nsplit=nsplit, within_causal=True,
                tiling=tiling,
            )  # fmt: skip
            _check_rows(to_np(out)[0], ref_m, keep[:, :T])
    if tiling == TILING:
        assert mx.array_equal(out, sdpa_cuda(q, keys, values, pos, scale=scale, mask=strided,
                                              nsplit=4, within_causal=True)).item()  # fmt: skip


@pytest.mark.parametrize(
    "rows,n_kv,context,sms,want",
    [
        (2048, 2, 10240, 132, 1),  # 512 row tiles: a wave already
        (4, 2, 8192, 132, 32),  # 128 stages: 32 splits keep 4 each (64 would keep 2)
        (100, 2, 2090, 132, 8),  # 33 stages, 26 row tiles
        (16, 2, 300, 132, 1),  # 5 stages: too few to split
        (2, 2, 1 << 20, 132, MAX_SPLIT),  # capped
        (264, 2, 65536, 132, 2),  # 66 tiles: two splits make the wave
    ],
)
def test_split_count(rows, n_kv, context, sms, want):
    assert split_count(rows, n_kv, context, sms) == want
    # 32-token stages: twice the stages, so a split keeps enough of them at half the context
    assert split_count(rows, n_kv, context // 2, sms, step=32) == want


def test_tilings_fit_and_are_refused_when_malformed():
    """Every form timed side by side fits an H100's shared memory at the QSA geometry; a tiling
    the kernel has no form for is refused by name before anything runs."""
    for t in TILINGS:
        assert sdpa_unsupported(mx.bfloat16, 24, 2, 256, tiling=t) is None, t
    assert len(set(TILINGS)) == len(TILINGS) and TILINGS[0] == TILING
    assert smem_bytes(256, 12, Tiling(32, 3)) == (3 * 2 * 32 + 6 * 16) * 264 * 2
    assert "shared memory" in sdpa_unsupported(mx.bfloat16, 24, 2, 256, tiling=Tiling(64, 4))
    q = bf16(np.zeros((1, 24, 3, 256)))
    kv = bf16(np.zeros((1, 2, 256, 256)))
    pos = mx.array([5, 6, 7], dtype=mx.int32)
    for bad in (Tiling(48, 2), Tiling(64, 1), Tiling(32, 5)):
        with pytest.raises(ValueError, match="tiling must have step 32 or 64 and nstage 2..4"):
            sdpa_cuda(q, kv, kv, pos, scale=1 / 16, tiling=bad)


@needs_cuda
def test_reads_a_transposed_q_in_place():
    """q as the layer makes it: a [1, H, S, d] view of a [1, S, H, d] buffer."""
    rng = np.random.default_rng(79)
    q, keys, values, pos = _inputs(rng, 24, 2, 256, 40, 900)
    qv = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    a = sdpa_cuda(qv, keys, values, pos, scale=1 / 16)
    b = sdpa_cuda(q, keys, values, pos, scale=1 / 16)
    assert mx.array_equal(a, b).item()


def test_argument_errors_and_unsupported_shapes():
    q = bf16(np.zeros((1, 24, 3, 256)))
    kv = bf16(np.zeros((1, 2, 256, 256)))
    pos = mx.array([5, 6, 7], dtype=mx.int32)
    mask = mx.ones((1, 1, 3, 8), dtype=mx.bool_)
    with pytest.raises(ValueError, match="positions must be int32"):
        sdpa_cuda(q, kv, kv, pos.astype(mx.int64), scale=1 / 16)
    with pytest.raises(ValueError, match="positions must be int32 \\[3\\]"):
        sdpa_cuda(q, kv, kv, pos[:2], scale=1 / 16)
    with pytest.raises(ValueError, match="mask must be \\[1, 1, 3, T\\]"):
        sdpa_cuda(q, kv, kv, pos, scale=1 / 16, mask=mask[0, 0])
    with pytest.raises(ValueError, match="with T <= cap"):
        sdpa_cuda(q, kv, kv, pos, scale=1 / 16, mask=mx.ones((1, 1, 3, 300), dtype=mx.bool_))
    with pytest.raises(ValueError, match="mask must have dtype"):
        sdpa_cuda(q, kv, kv, pos, scale=1 / 16, mask=mask.astype(mx.int32))
    with pytest.raises(ValueError, match="at least one query row"):
        sdpa_cuda(q[:, :, :0], kv, kv, pos[:0], scale=1 / 16)
    with pytest.raises(ValueError, match="nsplit must be a power of two up to 64"):
        sdpa_cuda(q, kv, kv, pos, scale=1 / 16, nsplit=3)
    with pytest.raises(ValueError, match="scale must be a positive float"):
        sdpa_cuda(q, kv, kv, pos, scale=0.0)
    with pytest.raises(ValueError, match="keys head_dim"):
        sdpa_cuda(q, kv[..., :128], kv[..., :128], pos, scale=1 / 16)
    assert sdpa_unsupported(mx.bfloat16, 24, 2, 256) is None
    assert "bfloat16" in sdpa_unsupported(mx.float16, 24, 2, 256)
    assert "even number" in sdpa_unsupported(mx.bfloat16, 24, 8, 256)  # 3 heads a KV head
    assert "even number" in sdpa_unsupported(mx.bfloat16, 36, 1, 256)  # 36 > 16
    assert "multiple of 16" in sdpa_unsupported(mx.bfloat16, 24, 2, 72)
    # the K/V stages and 6 query tiles: 185,856 bytes for the QSA geometry, within an H100's
    assert smem_bytes(256, 12) == (2 * 2 * 64 + 6 * 16) * 264 * 2
    assert MIN_ROWS >= 1


@pytest.mark.parametrize(
    "first,sdpa_mask,rows,form",
    [
        ("sdpa", "causal", 2048, "causal"),
        ("sdpa", "dense_mask", 33, "mask"),
        ("dense_mask", "dense_mask", 100, "dense_mask"),
        ("sdpa", "dense_mask", 4, "mask"),  # a verify of 4 rows below the gather lane's context
        ("sdpa", "dense_mask", MIN_ROWS - 1, None),  # one row: MLX's SDPA
        ("sdpa", "causal", MIN_ROWS, "causal"),
        ("sdpa", "none", 2048, None),  # S = 1 decode has no mask
        ("sdpa", "token_list", 64, None),
        ("rows_gather", "", 64, None),
        ("prefill_flash", "", 2048, None),
    ],
)
def test_which_calls_the_kernel_takes(first, sdpa_mask, rows, form):
    assert masked_sdpa_form(first, sdpa_mask, rows) == form


@pytest.mark.parametrize("form", ["causal", "mask", "dense_mask", "short", "switched_off"])
def test_dispatch_hands_the_kernel_the_routed_mask(monkeypatch, set_switch, form):
    """The CUDA branch of `consumers.dispatch`, on any machine: the kernel's launcher is replaced
    by MLX's SDPA over the mask it is handed, so the CUDA route must give the portable route's
    bits exactly when it hands over the routed mask (and leaves short calls alone)."""
    from mlx_qsa import plan
    from mlx_qsa.consumers import dispatch
    from mlx_qsa.indexer import Selection
    from mlx_qsa.kernels import sdpa as sdpa_kernel

    rng = np.random.default_rng([83, len(form)])
    S = MIN_ROWS - 1 if form == "short" else 40
    P, scale = 3000, 1 / 16
    T = P + S
    q, keys, values, pos = _inputs(rng, 24, 2, 256, S, P)
    keys, values = keys[:, :, :T], values[:, :, :T]  # MLX's SDPA reads every row it is given
    handed = []

    def launcher(q, keys, values, positions, *, scale, mask=None, context=None, **kw):
        assert context == T and kw == {"within_causal": True}
        handed.append(mask)
        return sdpa(q, keys, values, T, scale, mask="causal" if mask is None else mask)

    monkeypatch.setattr(sdpa_kernel, "sdpa_cuda", launcher)
    set_switch("MLX_QSA_SDPA_KERNEL", "0" if form == "switched_off" else "1")
    keep = mx.array(_keep_mask(rng, S, P, T, 0.2))[None, None]
    ids = mx.array(rng.integers(0, T // 4, (S, 512)).astype(np.int32))
    valid = mx.array(rng.random((S, 512)) < 0.5)
    if form in ("causal", "switched_off"):
        cplan, sel = plan.ConsumerPlan(("sdpa",), "causal", ()), Selection("none")
    elif form == "dense_mask":
        cplan = plan.ConsumerPlan(("dense_mask", "sdpa"), "dense_mask", ("dense_fallback",))
        sel = Selection("prefill_blocks", ids=ids, valid=valid)
    else:
        cplan, sel = (
            plan.ConsumerPlan(("sdpa",), "dense_mask", ()),
            Selection("dense_mask", mask=keep),
        )
    args = (cplan, q, keys, values, sel, pos, T, 4, scale)
    got, want = dispatch(*args, impl="cuda"), dispatch(*args, impl="portable")
    assert len(handed) == (0 if form in ("short", "switched_off") else 1)
    assert mx.array_equal(got, want, equal_nan=True).item()
    if form == "mask":
        assert handed[0] is keep


def test_the_switch_overrides_the_default(set_switch):
    from mlx_qsa.kernels.sdpa import DEFAULT_ON, kernel_env

    set_switch("MLX_QSA_SDPA_KERNEL", None)
    assert kernel_env() is DEFAULT_ON
    set_switch("MLX_QSA_SDPA_KERNEL", "1")
    assert kernel_env()
    set_switch("MLX_QSA_SDPA_KERNEL", "0")
    assert not kernel_env()
