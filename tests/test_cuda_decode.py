"""Decode kernels (selector, flash decode, rows gather): portable twins against NumPy references
on any device, CUDA launchers against their twins and float64 references on an NVIDIA GPU."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.kernels.flash_decode import flash_decode_cuda, flash_decode_portable
from mlx_qsa.kernels.rows_gather import rows_gather_cuda, rows_gather_portable
from mlx_qsa.kernels.selector import select_blocks_cuda, select_blocks_portable

HAS_CUDA = mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs MLX on an NVIDIA GPU")
F32 = np.float32
REL_TOL = 1e-2  # bf16 outputs against a float64 reference (‖out - ref‖ / ‖ref‖)


# ---------------------------------------------------------------------------------------------
# inputs and NumPy references


def bf16(a: np.ndarray) -> mx.array:
    return mx.array(np.asarray(a, dtype=F32)).astype(mx.bfloat16)


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def ref_adj(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Adjusted scores [S, cap] (QSA.md §8.2); dot products accumulated in float32 over
    d = 0, 1, ... in order (the order both selector paths use)."""
    dots = np.zeros((q.shape[0], q.shape[1], k.shape[0]), F32)
    for d in range(q.shape[2]):
        dots = (dots + q[:, :, d : d + 1] * k[None, None, :, d]).astype(F32)
    relu = np.where(dots > 0, dots, F32(0))
    tot = relu[:, 0].copy()
    for h in range(1, relu.shape[1]):
        tot = (tot + relu[:, h]).astype(F32)
    score = (tot / F32(math.sqrt(q.shape[2]))).astype(F32)
    b = np.arange(k.shape[0]).astype(F32)
    return (score - (b * F32(1e-12)).astype(F32)).astype(F32)


def ref_select(adj: np.ndarray, pos, K: int, ratio: int):
    """ids / valid / scores / slots / slot_valid in the layouts of RUNTIME.md §7."""
    S, cap = adj.shape
    ids = np.zeros((S, K), np.int32)
    valid = np.zeros((S, K), bool)
    scores = np.full((S, K), -np.inf, F32)
    W = K * ratio + ratio
    slots = np.zeros((S, W), np.int32)
    svalid = np.zeros((S, W), bool)
    for r, p in enumerate(pos):
        nb_raw = (p + 1) // ratio if p >= 0 else 0
        nb = min(nb_raw, cap)
        keff = min(K, nb)
        a = adj[r, :nb]
        order = np.lexsort((np.arange(nb), -a.astype(np.float64)))  # adj desc, id asc
        sel = np.sort(order[:keff])
        ids[r, :keff] = sel
        valid[r, :keff] = True
        scores[r, :keff] = a[sel]
        for i, b in enumerate(sel):
            slots[r, ratio * i : ratio * i + ratio] = ratio * b + np.arange(ratio)
            svalid[r, ratio * i : ratio * i + ratio] = True
        for j in range(ratio):
            t = ratio * nb_raw + j
            if t <= p:
                slots[r, K * ratio + j] = t
                svalid[r, K * ratio + j] = True
    return ids, valid, scores, slots, svalid


def ref_attention(q, keys, values, tokens, scale: float) -> np.ndarray:
    """Float64 attention of q [H, d] over the token rows; keys/values [Hkv, cap, d]."""
    n_heads, d = q.shape
    g = n_heads // keys.shape[0]
    out = np.zeros((n_heads, d))
    if len(tokens) == 0:
        return out
    tok = np.asarray(tokens)
    for h in range(n_heads):
        kk = keys[h // g, tok].astype(np.float64)
        vv = values[h // g, tok].astype(np.float64)
        s = kk @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ vv / p.sum()
    return out


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def make_selector_inputs(rng, S, n_heads, cap, nb_max, *, quantized=False, levels=3):
    """index_q [S, H_I, 128], pooled [1, cap, 128] with NaN garbage past nb_max (never read)."""
    if quantized:  # small integers: every dot product is exact, ties are frequent
        q = rng.integers(-levels, levels + 1, (S, n_heads, 128)).astype(F32)
        k = rng.integers(-levels, levels + 1, (cap, 128)).astype(F32)
    else:
        q = rng.standard_normal((S, n_heads, 128), dtype=F32)
        k = rng.standard_normal((cap, 128), dtype=F32)
    q, k = to_np(bf16(q)), to_np(bf16(k))
    garbage = k.copy()
    garbage[nb_max:] = np.nan
    return q, k, bf16(q), bf16(garbage[None])


def check_selection(out, ref, *, exact_scores: bool):
    ids, valid, scores = (np.array(o) for o in out[:3])
    np.testing.assert_array_equal(valid, ref[1])
    np.testing.assert_array_equal(ids, ref[0])
    if exact_scores:
        np.testing.assert_array_equal(scores, ref[2])
    else:
        np.testing.assert_allclose(scores, ref[2], rtol=1e-5, atol=1e-6)
    if len(out) == 5:
        np.testing.assert_array_equal(np.array(out[4]), ref[4])
        np.testing.assert_array_equal(np.array(out[3]), ref[3])


# ---------------------------------------------------------------------------------------------
# portable twins (CPU in CI)

SELECT_CASES = [
    # S, H_I, cap, K, positions
    (1, 2, 40, 8, [2]),  # nb 0: nothing selected
    (1, 2, 40, 8, [31]),  # nb 8 == K: dense
    (1, 2, 40, 8, [35]),  # nb 9: first sparse
    (3, 2, 300, 8, [4, 101, 1199]),
    (4, 4, 515, 16, [2050, 2051, 2054, 2058]),
    (2, 4, 257, 32, [1027, 600]),
]


@pytest.mark.parametrize("quantized", [True, False], ids=["int", "normal"])
@pytest.mark.parametrize("mode", ["blocks", "row_tokens"])
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"S{c[0]}-HI{c[1]}-cap{c[2]}-K{c[3]}")
def test_select_portable(case, mode, quantized):
    S, n_heads, cap, K, pos = case
    rng = np.random.default_rng([5, S, cap, K, quantized])
    nb_max = min(cap, max((p + 1) // 4 for p in pos))
    q, k, qm, km = make_selector_inputs(rng, S, n_heads, cap, nb_max, quantized=quantized)
    out = select_blocks_portable(qm, km, mx.array(pos, dtype=mx.int32), block_topk=K, mode=mode)
    assert len(out) == (5 if mode == "row_tokens" else 3)
    check_selection(out, ref_select(ref_adj(q, k), pos, K, 4), exact_scores=True)


def test_select_portable_ties_lower_id():
    # Identical block keys: every adj ties, the lowest ids win; zero query: scores 0, adj decides.
    rng = np.random.default_rng(11)
    k = np.repeat(to_np(bf16(rng.standard_normal((1, 128), dtype=F32))), 64, axis=0)
    q = np.abs(to_np(bf16(rng.standard_normal((2, 2, 128), dtype=F32))))
    q[1] = 0.0
    k = np.abs(k)
    pos = [255, 255]
    out = select_blocks_portable(
        bf16(q), bf16(k[None]), mx.array(pos, dtype=mx.int32), block_topk=8
    )
    np.testing.assert_array_equal(np.array(out[0]), np.tile(np.arange(8), (2, 1)))
    check_selection(out, ref_select(ref_adj(q, k), pos, 8, 4), exact_scores=True)


def small_attention_inputs(rng, n_heads, n_kv, d, cap, T):
    q = to_np(bf16(rng.standard_normal((n_heads, d), dtype=F32)))
    keys = to_np(bf16(rng.standard_normal((n_kv, cap, d), dtype=F32)))
    values = to_np(bf16(rng.standard_normal((n_kv, cap, d), dtype=F32)))
    kg, vg = keys.copy(), values.copy()
    kg[:, T:] = np.nan  # rows >= T are garbage and must never be read
    vg[:, T:] = np.nan
    return q, keys, values, bf16(kg[None]), bf16(vg[None])


def block_list(rng, K, nb, n_valid):
    """Selector-style list: n_valid distinct ids ascending first, then (0, False)."""
    ids = np.zeros(K, np.int32)
    ids[:n_valid] = np.sort(rng.choice(nb, n_valid, replace=False))
    valid = np.arange(K) < n_valid
    return ids, valid


def flash_tokens(ids, valid, T, ratio):
    toks = [ratio * int(b) + j for b, v in zip(ids, valid, strict=True) if v for j in range(ratio)]
    return toks + list(range(ratio * (T // ratio), T))


@pytest.mark.parametrize(
    "H,Hkv,d,K,T,n_valid",
    [(4, 2, 64, 8, 37, 8), (4, 2, 64, 8, 37, 3), (6, 2, 128, 8, 32, 5), (2, 2, 64, 4, 3, 0)],
)
def test_flash_portable(H, Hkv, d, K, T, n_valid):
    rng = np.random.default_rng([7, H, d, K, T, n_valid])
    cap = 64
    q, keys, values, km, vm = small_attention_inputs(rng, H, Hkv, d, cap, T)
    ids, valid = block_list(rng, K, T // 4, n_valid)
    scale = d**-0.5
    out = flash_decode_portable(
        bf16(q[None, :, None]),
        km,
        vm,
        mx.array(ids),
        mx.array(valid),
        mx.array([T], dtype=mx.int32),
        scale=scale,
    )
    assert out.shape == (1, H, 1, d) and out.dtype == mx.bfloat16
    ref = ref_attention(q, keys, values, flash_tokens(ids, valid, T, 4), scale)
    got = to_np(out)[0, :, 0]
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < REL_TOL


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "switch_off"])
def test_decode_launch_runs_the_launcher_with_a_fresh_counter_slot(
    monkeypatch, set_switch, compiled
):
    """`consumers.decode_launch`: the decode consumer's launcher as an `mx.compile`d function of
    the call's arrays and a counter slot, traced once per shape; each call hands it a new slot
    as an input (a constant of the trace would be shared by queued replays), and the result is
    the launcher's own; the launcher's switch MLX_QSA_ONE_LAUNCH keys the trace. With
    MLX_QSA_COMPILE_DECODE=0 every call runs the launcher. Any machine:
    a stand-in launcher (the portable twin, plus the slot's first value so that the output
    shows which slot it got) replaces the CUDA one."""
    from mlx_qsa import consumers
    from mlx_qsa.kernels import _launch
    from mlx_qsa.kernels import flash_decode as fd

    traced = []

    def launcher(q, keys, values, ids, valid, *, scale, ratio, pos, one_launch, gate, ctr):
        traced.append(one_launch)
        o = fd.flash_decode_portable(q, keys, values, ids, valid, pos + 1, scale=scale, ratio=ratio)
        return o + ctr[0].astype(o.dtype)

    slots = iter([mx.array([v, 0], mx.int32) for v in (1, 2, 3)])
    monkeypatch.setattr(fd, "flash_decode_cuda", launcher)
    monkeypatch.setattr(_launch, "counter_slot", lambda: next(slots))
    set_switch("MLX_QSA_COMPILE_DECODE", None if compiled else "0")
    consumers._decode_fn.cache_clear()  # the stand-in, not a launcher another test compiled
    try:
        rng = np.random.default_rng(71)
        T = 50
        q, _, _, km, vm = small_attention_inputs(rng, 4, 2, 64, 64, T)
        ids, valid = block_list(rng, 8, T // 4, 6)
        args = (bf16(q[None, :, None]), km, vm, mx.array(ids), mx.array(valid))
        pos = mx.array([T - 1], mx.int32)
        outs = [consumers.decode_launch("flash", 0.125, 4, (*args, pos), None) for _ in range(2)]
        # MLX_QSA_ONE_LAUNCH=0 (the merge's form) is part of the key: a new trace takes it
        set_switch("MLX_QSA_ONE_LAUNCH", "0")
        outs.append(consumers.decode_launch("flash", 0.125, 4, (*args, pos), None))
        assert traced == ([None, False] if compiled else [None, None, False])
        want = fd.flash_decode_portable(*args, pos + 1, scale=0.125, ratio=4)
        for o, slot in zip(outs, (1, 2, 3), strict=True):
            np.testing.assert_array_equal(to_np(o), to_np(want + slot))
        with pytest.raises(ValueError, match="kind must be 'flash' or 'rows_gather'"):
            consumers.decode_launch("sdpa", 0.125, 4, (*args, pos), None)
    finally:
        consumers._decode_fn.cache_clear()


def test_rows_gather_portable():
    rng = np.random.default_rng(13)
    H, Hkv, d, cap, T, K = 4, 2, 64, 128, 97, 8
    q, keys, values, km, vm = small_attention_inputs(rng, H, Hkv, d, cap, T)
    S = 3
    qs = to_np(bf16(rng.standard_normal((H, S, d), dtype=F32)))
    pos = [T - 3, T - 2, T - 1]
    adj = rng.standard_normal((S, cap // 4)).astype(F32)
    ref_sel = ref_select(adj, pos, K, 4)
    slots, svalid = ref_sel[3], ref_sel[4]
    out = rows_gather_portable(
        bf16(qs[None]), km, vm, mx.array(slots), mx.array(svalid), scale=0.125
    )
    got = to_np(out)[0]
    for r in range(S):
        ref = ref_attention(qs[:, r], keys, values, slots[r][svalid[r]], 0.125)
        assert rel_err(got[:, r], ref) < REL_TOL


def test_validation_errors():
    q = bf16(np.zeros((1, 4, 128)))
    k = bf16(np.zeros((1, 16, 128)))
    with pytest.raises(ValueError, match="pos"):
        select_blocks_portable(q, k, mx.array([3, 4], dtype=mx.int32))
    with pytest.raises(ValueError, match="mode"):
        select_blocks_portable(q, k, mx.array([3], dtype=mx.int32), mode="dense")
    with pytest.raises(ValueError, match="pooled"):
        select_blocks_portable(q, bf16(np.zeros((1, 16, 64))), mx.array([3], dtype=mx.int32))
    kv = bf16(np.zeros((1, 2, 16, 64)))
    ids, ok, T = mx.zeros((4,), mx.int32), mx.zeros((4,), mx.bool_), mx.array([5], mx.int32)
    with pytest.raises(ValueError, match="multiple"):
        flash_decode_portable(bf16(np.zeros((1, 3, 1, 64))), kv, kv, ids, ok, T, scale=0.1)
    with pytest.raises(ValueError, match="one decode row"):
        flash_decode_portable(bf16(np.zeros((1, 4, 2, 64))), kv, kv, ids, ok, T, scale=0.1)
    with pytest.raises(ValueError, match="slot_valid"):
        rows_gather_portable(
            bf16(np.zeros((1, 4, 2, 64))),
            kv,
            kv,
            mx.zeros((2, 8), mx.int32),
            mx.zeros((2, 4), mx.bool_),
            scale=0.1,
        )


def test_gate_argument_errors_name_the_gate():
    """A fused gate of the wrong shape or dtype is refused before anything else (on any device),
    naming the argument and what was expected."""
    kv = bf16(np.zeros((1, 2, 64, 64)))
    ids, ok = mx.zeros((4,), mx.int32), mx.zeros((4,), mx.bool_)
    pos = mx.array([20], mx.int32)
    q1 = bf16(np.zeros((1, 4, 1, 64)))
    with pytest.raises(ValueError, match=r"gate must be \[1, S, H, d\] = \[1, 1, 4, 64\]"):
        flash_decode_cuda(
            q1, kv, kv, ids, ok, pos=pos, scale=0.1, gate=bf16(np.zeros((1, 4, 1, 64)))
        )
    with pytest.raises(ValueError, match="gate must have q's dtype"):
        flash_decode_cuda(
            q1, kv, kv, ids, ok, pos=pos, scale=0.1, gate=mx.zeros((1, 1, 4, 64), mx.float32)
        )
    q3 = bf16(np.zeros((1, 4, 3, 64)))
    slots, sv = mx.zeros((3, 8), mx.int32), mx.zeros((3, 8), mx.bool_)
    with pytest.raises(ValueError, match=r"gate must be \[1, S, H, d\] = \[1, 3, 4, 64\]"):
        rows_gather_cuda(q3, kv, kv, slots, sv, scale=0.1, gate=bf16(np.zeros((1, 4, 3, 64))))


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only error")
def test_cuda_launchers_need_cuda():
    q = bf16(np.zeros((1, 4, 128)))
    with pytest.raises(RuntimeError, match="CUDA"):
        select_blocks_cuda(q, bf16(np.zeros((1, 16, 128))), mx.array([3], dtype=mx.int32))


# ---------------------------------------------------------------------------------------------
# CUDA kernels (NVIDIA GPU only)


def poison(*shapes_dtypes):
    """Leave NaN/garbage-filled buffers of these sizes in MLX's allocator cache, so that fresh
    (uninitialised) kernel outputs are likely to start from garbage, not zeros."""
    junk = [mx.full(s, float("nan"), dtype=mx.float32) for s, _ in shapes_dtypes]
    mx.eval(junk)
    del junk


def bucket(n: int) -> int:
    return max(256, 1 << max(0, (n - 1).bit_length()))


REAL_CTX = [2051, 2052, 2055, 8192, 32768, 131072]


@needs_cuda
@pytest.mark.parametrize("one_launch", [True, False], ids=["one", "two"])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("ctx", REAL_CTX)
def test_select_cuda_real_geometry(ctx, rows, one_launch):
    rng = np.random.default_rng([17, ctx, rows])
    pos = [ctx - rows + i for i in range(rows)]
    nb_max = (pos[-1] + 1) // 4
    cap = bucket(nb_max)
    q, k, qm, km = make_selector_inputs(rng, rows, 4, cap, nb_max)
    pm = mx.array(pos, dtype=mx.int32)
    mode = "blocks" if rows == 1 else "row_tokens"
    poison(((rows, 512 * 4 + 4), None), ((rows, 512), None), ((rows, cap), None))
    out = select_blocks_cuda(qm, km, pm, mode=mode, one_launch=one_launch)
    twin = select_blocks_portable(qm, km, pm, mode=mode)
    mx.eval(out, twin)
    np.testing.assert_array_equal(np.array(out[1]), np.array(twin[1]))
    np.testing.assert_array_equal(np.array(out[0]), np.array(twin[0]))
    if mode == "row_tokens":
        np.testing.assert_array_equal(np.array(out[3]), np.array(twin[3]))
        np.testing.assert_array_equal(np.array(out[4]), np.array(twin[4]))
    sc = np.array(out[2])
    assert not np.isnan(sc).any()
    np.testing.assert_allclose(sc, np.array(twin[2]), rtol=1e-5, atol=1e-6)
    # and against NumPy: same float32 scores, bit for bit, and the same order
    check_selection(out, ref_select(ref_adj(q, k), pos, 512, 4), exact_scores=True)


@needs_cuda
@pytest.mark.parametrize(
    "kind,ctx,rows",
    [
        ("int3", 32768, 1),
        ("int1", 32768, 2),
        ("int1", 131072, 1),
        ("same", 32768, 1),
        ("zero_q", 8192, 2),
        ("int1", 8192, 4),
    ],
)
@pytest.mark.parametrize("one_launch", [True, False], ids=["one", "two"])
def test_select_cuda_ties(kind, ctx, rows, one_launch):
    """Exact ties: small-integer inputs (exact dots, many equal scores), identical block keys
    (all candidates tie: the streaming fallback), and a zero query (scores 0, adj decides)."""
    rng = np.random.default_rng([19, ctx, rows, len(kind)])
    pos = [ctx - rows + i for i in range(rows)]
    nb_max = (pos[-1] + 1) // 4
    cap = bucket(nb_max)
    levels = 3 if kind == "int3" else 1
    q, k, qm, km = make_selector_inputs(rng, rows, 4, cap, nb_max, quantized=True, levels=levels)
    if kind == "same":
        k[:] = np.abs(k[0])
        q = np.abs(q)
        garbage = k.copy()
        garbage[nb_max:] = np.nan
        qm, km = bf16(q), bf16(garbage[None])
    if kind == "zero_q":
        q[:] = 0.0
        qm = bf16(q)
    pm = mx.array(pos, dtype=mx.int32)
    out = select_blocks_cuda(qm, km, pm, mode="row_tokens", one_launch=one_launch)
    mx.eval(out)
    check_selection(out, ref_select(ref_adj(q, k), pos, 512, 4), exact_scores=True)
    twin = select_blocks_portable(qm, km, pm, mode="row_tokens")
    np.testing.assert_array_equal(np.array(out[0]), np.array(twin[0]))


def real_attention_inputs(rng, T, H=24, Hkv=2, d=256):
    cap = -(-T // 256) * 256 + 256
    q = to_np(bf16(rng.standard_normal((H, d), dtype=F32)))
    keys = rng.standard_normal((Hkv, cap, d), dtype=F32)
    values = rng.standard_normal((Hkv, cap, d), dtype=F32)
    keys[:, T:] = np.nan
    values[:, T:] = np.nan
    km, vm = bf16(keys[None]), bf16(values[None])
    return q, to_np(km)[0], to_np(vm)[0], km, vm


@needs_cuda
@pytest.mark.parametrize("T", [2051, 2052, 8192, 32771, 131072])
def test_flash_cuda_real_geometry(T):
    rng = np.random.default_rng([23, T])
    q, keys, values, km, vm = real_attention_inputs(rng, T)
    nb = T // 4
    n_valid = min(512, nb)
    ids, valid = block_list(rng, 512, nb, n_valid)
    if nb <= 512:
        ids[:n_valid] = np.arange(n_valid)
    args = (
        bf16(q[None, :, None]),
        km,
        vm,
        mx.array(ids),
        mx.array(valid),
        mx.array([T], dtype=mx.int32),
    )
    poison(((24, 65, 256), None), ((1, 24, 1, 256), None))
    out = flash_decode_cuda(*args, scale=1 / 16)
    twin = flash_decode_portable(*args, scale=1 / 16)
    got, tw = to_np(out)[0, :, 0], to_np(twin)[0, :, 0]
    assert np.isfinite(got).all()
    ref = ref_attention(q, keys, values, flash_tokens(ids, valid, T, 4), 1 / 16)
    assert rel_err(got, ref) < REL_TOL
    assert rel_err(got, tw) < REL_TOL


@needs_cuda
@pytest.mark.parametrize(
    "H,Hkv,d,K,T,n_valid",
    [
        (4, 2, 64, 8, 37, 8),
        (4, 2, 64, 8, 37, 3),
        (6, 2, 128, 16, 70, 16),
        (2, 2, 64, 4, 3, 0),
        (8, 1, 256, 40, 1001, 17),
        (32, 1, 128, 512, 4100, 512),
    ],
)
def test_flash_cuda_small(H, Hkv, d, K, T, n_valid):
    rng = np.random.default_rng([29, H, d, K, T, n_valid])
    cap = -(-T // 64) * 64 + 64
    q, keys, values, km, vm = small_attention_inputs(rng, H, Hkv, d, cap, T)
    ids, valid = block_list(rng, K, T // 4, n_valid)
    ids[n_valid:] = rng.integers(T // 4, cap // 4, K - n_valid)  # invalid ids point at garbage
    scale = d**-0.5
    out = flash_decode_cuda(
        bf16(q[None, :, None]),
        km,
        vm,
        mx.array(ids),
        mx.array(valid),
        mx.array([T], dtype=mx.int32),
        scale=scale,
    )
    got = to_np(out)[0, :, 0]
    assert np.isfinite(got).all()
    ref = ref_attention(q, keys, values, flash_tokens(ids, valid, T, 4), scale)
    if n_valid == 0 and T % 4 == 0:
        np.testing.assert_array_equal(got, 0.0)
    else:
        assert rel_err(got, ref) < REL_TOL


@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("ctx", [2056, 8192, 32768])
def test_rows_gather_cuda_real_geometry(ctx, rows):
    rng = np.random.default_rng([31, ctx, rows])
    T = ctx
    q, keys, values, km, vm = real_attention_inputs(rng, T)
    qs = to_np(bf16(rng.standard_normal((24, rows, 256), dtype=F32)))
    pos = [T - rows + i for i in range(rows)]
    nb_max = (pos[-1] + 1) // 4
    cap = bucket(nb_max)
    _, _, iq, pk = make_selector_inputs(rng, rows, 4, cap, nb_max)
    sel = select_blocks_cuda(iq, pk, mx.array(pos, dtype=mx.int32), mode="row_tokens")
    slots, svalid = sel[3], sel[4]
    poison(((24 * rows, 33, 256), None))
    out = rows_gather_cuda(bf16(qs[None]), km, vm, slots, svalid, scale=1 / 16)
    twin = rows_gather_portable(bf16(qs[None]), km, vm, slots, svalid, scale=1 / 16)
    got, tw = to_np(out)[0], to_np(twin)[0]
    assert np.isfinite(got).all()
    sl, sv = np.array(slots), np.array(svalid)
    for r in range(rows):
        ref = ref_attention(qs[:, r], keys, values, sl[r][sv[r]], 1 / 16)
        assert rel_err(got[:, r], ref) < REL_TOL, r
        assert rel_err(got[:, r], tw[:, r]) < REL_TOL, r


@needs_cuda
def test_rows_gather_cuda_small_and_empty_row():
    rng = np.random.default_rng(37)
    H, Hkv, d, cap, T = 4, 2, 64, 128, 97
    q, keys, values, km, vm = small_attention_inputs(rng, H, Hkv, d, cap, T)
    S, W = 3, 70
    qs = to_np(bf16(rng.standard_normal((H, S, d), dtype=F32)))
    slots = rng.integers(0, T, (S, W)).astype(np.int32)
    svalid = rng.random((S, W)) < 0.6
    svalid[2] = False
    slots[~svalid] = rng.integers(T, cap, int((~svalid).sum()))  # invalid slots point at garbage
    out = rows_gather_cuda(bf16(qs[None]), km, vm, mx.array(slots), mx.array(svalid), scale=0.125)
    got = to_np(out)[0]
    assert np.isfinite(got).all()
    for r in range(2):
        ref = ref_attention(qs[:, r], keys, values, slots[r][svalid[r]], 0.125)
        assert rel_err(got[:, r], ref) < REL_TOL
    np.testing.assert_array_equal(got[:, 2], 0.0)


@needs_cuda
def test_cuda_deterministic():
    rng = np.random.default_rng(41)
    T = 32771
    q, keys, values, km, vm = real_attention_inputs(rng, T)
    ids, valid = block_list(rng, 512, T // 4, 512)
    args = (
        bf16(q[None, :, None]),
        km,
        vm,
        mx.array(ids),
        mx.array(valid),
        mx.array([T], dtype=mx.int32),
    )
    a = flash_decode_cuda(*args, scale=1 / 16)
    b = flash_decode_cuda(*args, scale=1 / 16)
    assert mx.array_equal(a, b).item()


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_call_forms_read_in_place(rows):
    """The forms the layer uses (index queries [1, H_I, S, d_I]; a selection row [1, K] and the
    row's position instead of T) give bit-identical results to the documented ones, also on
    repeated launches (the hand-off counters start from zero every call)."""
    rng = np.random.default_rng([31, rows])
    T = 40000
    pos = [T - rows + i for i in range(rows)]
    nb = (pos[-1] + 1) // 4
    q, k, qm, km = make_selector_inputs(rng, rows, 4, bucket(nb), nb)
    pm = mx.array(pos, dtype=mx.int32)
    base = select_blocks_cuda(qm, km, pm)
    for _ in range(3):
        layer_form = select_blocks_cuda(qm.transpose(1, 0, 2)[None], km, pm)
        for a, b in zip(base, layer_form, strict=True):
            assert mx.array_equal(a, b).item()
    if rows != 1:
        return
    qa, keys, values, kv_k, kv_v = real_attention_inputs(rng, T)
    ids, valid = base[0], base[1]
    q4 = bf16(qa[None, :, None])
    ref = flash_decode_cuda(q4, kv_k, kv_v, ids[0], valid[0], mx.array([T], mx.int32), scale=0.0625)
    for _ in range(3):
        got = flash_decode_cuda(q4, kv_k, kv_v, ids, valid, scale=0.0625, pos=pm)
        assert mx.array_equal(got, ref).item()
    with pytest.raises(ValueError, match="exactly one of T and pos"):
        flash_decode_cuda(q4, kv_k, kv_v, ids, valid, scale=0.0625)


@needs_cuda
@pytest.mark.parametrize("T", [37, 2052, 32771, 131072])
def test_flash_one_launch_matches_two_launches(T):
    """The in-launch merge (last CTAs, counter hand-off) gives the separate merge kernel's bits,
    launch after launch (the counter is left zeroed), also for many launches in one graph."""
    rng = np.random.default_rng([43, T])
    q, keys, values, km, vm = real_attention_inputs(rng, T)
    nb = T // 4
    ids, valid = block_list(rng, 512, max(nb, 1), min(512, nb))
    args = (bf16(q[None, :, None]), km, vm, mx.array(ids), mx.array(valid))
    Tm = mx.array([T], dtype=mx.int32)
    poison(((24, 65, 256), None), ((1, 24, 1, 256), None))
    two = flash_decode_cuda(*args, Tm, scale=1 / 16, one_launch=False)
    for _ in range(3):
        one = flash_decode_cuda(*args, Tm, scale=1 / 16, one_launch=True)
        np.testing.assert_array_equal(to_np(one), to_np(two))
    # independent launches in one evaluation (MLX may run them as concurrent graph nodes)
    qs = [bf16(rng.standard_normal((1, 24, 1, 256), dtype=F32)) for _ in range(6)]
    outs = [flash_decode_cuda(qi, *args[1:], Tm, scale=1 / 16, one_launch=True) for qi in qs]
    refs = [flash_decode_cuda(qi, *args[1:], Tm, scale=1 / 16, one_launch=False) for qi in qs]
    mx.eval(outs, refs)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(to_np(o), to_np(r))
    from mlx_qsa.kernels import _launch

    assert not any(np.array(c).any() for c in _launch._counters["slots"])  # every slot zeroed


@needs_cuda
@pytest.mark.parametrize("mode", ["blocks", "row_tokens"])
@pytest.mark.parametrize("ctx,rows", [(37, 1), (2052, 8), (8192, 3), (32771, 1), (131072, 2)])
def test_select_one_launch_matches_two_launches(ctx, rows, mode):
    """The one-launch selector (the last S scoring CTAs run the top-k) gives the two kernels'
    bits, launch after launch, also for independent launches in one evaluation (concurrent
    graph nodes), and leaves every counter slot zeroed."""
    rng = np.random.default_rng([53, ctx, rows])
    pos = [ctx - rows + i for i in range(rows)]
    nb_max = (pos[-1] + 1) // 4
    cap = bucket(max(nb_max, 1))
    _, _, qm, km = make_selector_inputs(rng, rows, 4, cap, nb_max)
    pm = mx.array(pos, dtype=mx.int32)
    poison(((rows, cap), None), ((rows, 512 * 4 + 4), None))
    two = select_blocks_cuda(qm, km, pm, mode=mode, one_launch=False)
    mx.eval(two)
    for _ in range(3):
        one = select_blocks_cuda(qm, km, pm, mode=mode, one_launch=True)
        mx.eval(one)
        for a, b in zip(one, two, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    qs = [bf16(rng.standard_normal(qm.shape, dtype=F32)) for _ in range(6)]
    ones = [select_blocks_cuda(qi, km, pm, mode=mode, one_launch=True) for qi in qs]
    twos = [select_blocks_cuda(qi, km, pm, mode=mode, one_launch=False) for qi in qs]
    mx.eval(ones, twos)
    for o, t in zip(ones, twos, strict=True):
        for a, b in zip(o, t, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    from mlx_qsa.kernels import _launch

    assert not any(np.array(c).any() for c in _launch._counters["slots"])  # every slot zeroed


@needs_cuda
@pytest.mark.parametrize("mode", ["blocks", "row_tokens"])
@pytest.mark.parametrize(
    "ctx,rows,n_heads",
    [(37, 1, 4), (2052, 8, 4), (8192, 3, 8), (32771, 1, 4), (131072, 2, 2), (131072, 1, 4)],
)
def test_select_split_heads_matches_two_launches(ctx, rows, n_heads, mode, set_switch):
    """The one-launch selector with one thread per indexer head (MLX_QSA_SELECT_SPLIT_HEADS=1)
    gives the two kernels' bits: scores, ids, validity, row tokens."""
    rng = np.random.default_rng([59, ctx, rows, n_heads])
    pos = [ctx - rows + i for i in range(rows)]
    nb_max = (pos[-1] + 1) // 4
    cap = bucket(max(nb_max, 1))
    _, _, qm, km = make_selector_inputs(rng, rows, n_heads, cap, nb_max)
    pm = mx.array(pos, dtype=mx.int32)
    two = select_blocks_cuda(qm, km, pm, mode=mode, one_launch=False)
    mx.eval(two)
    set_switch("MLX_QSA_SELECT_SPLIT_HEADS", "1")
    for _ in range(2):
        one = select_blocks_cuda(qm, km, pm, mode=mode, one_launch=True)
        mx.eval(one)
        for a, b in zip(one, two, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))


@needs_cuda
@pytest.mark.parametrize("one_launch,split", [(True, "0"), (True, "1"), (False, "0")])
def test_select_stamps_build_keeps_the_selection(one_launch, split, set_switch):
    """The diagnostic build (QSA_STAMPS, benchmarks/select_phases.py) selects the same bits as
    the library's selector, and its stamps are the top-k CTA's clocks in order and its
    candidate count."""
    from mlx_qsa.kernels import selector

    rng = np.random.default_rng(83)
    rows, ctx = 2, 131072
    pos = [ctx - rows + i for i in range(rows)]
    nb_max = (pos[-1] + 1) // 4
    _, _, qm, km = make_selector_inputs(rng, rows, 4, bucket(nb_max), nb_max)
    pm = mx.array(pos, dtype=mx.int32)
    set_switch("MLX_QSA_SELECT_SPLIT_HEADS", split)
    want = select_blocks_cuda(qm, km, pm, one_launch=one_launch)
    run = selector._plan("t", qm, km, pm, 512, 4, "blocks", one_launch, stamps=True)
    got = run(qm, km, pm, None)
    mx.eval(want, got)
    for a, b in zip(got[:-1], want, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    stamps = np.array(got[-1])
    assert stamps.shape == (rows, 16)
    for row in stamps:
        assert (np.diff(row[:10]) >= 0).all() and row[9] > row[2]
        assert 512 <= row[10] <= 4096  # candidates: at least the selection, within the room


def test_select_stamps_plumbing(monkeypatch):
    """Any machine: `stamps=True` builds the kernel with QSA_STAMPS and an int64 [S, 16] output
    after the selection's, in both forms; without it the library's kernels are untouched."""
    from mlx_qsa.kernels import _launch, device, selector

    built = []

    class Kernel:
        def __init__(self, **kw):
            built.append(kw)

        def __call__(self, *, inputs, grid, threadgroup, output_shapes, output_dtypes, **kw):
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "current", lambda: device.HOPPER)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: Kernel(**kw))
    _launch.build.cache_clear()  # kernels built here are stand-ins: none outlives the test
    selector._plan_top_k.cache_clear()
    try:
        q = mx.zeros((1, 4, 3, 128), mx.bfloat16)
        pooled = mx.zeros((1, 8192, 128), mx.bfloat16)
        pos = mx.array([32765, 32766, 32767], mx.int32)
        for one_launch in (True, False):
            for stamps in (True, False):
                built.clear()
                run = selector._plan("t", q, pooled, pos, 512, 4, "blocks", one_launch, stamps)
                out = run(q, pooled, pos, mx.zeros((2,), mx.int32))
                last = built[-1]  # the kernel that runs the select
                assert ("#define QSA_STAMPS" in last["source"]) == stamps
                assert (last["output_names"][-1] == "stamps") == stamps
                assert len(out) == 3 + stamps
                if stamps:
                    assert out[-1].shape == (3, 16) and out[-1].dtype == mx.int64
    finally:
        _launch.build.cache_clear()
        selector._plan_top_k.cache_clear()


def rows_gather_inputs(rng, rows: int, T: int = 20000):
    """q [1, 24, rows, 256], K/V backings at context T and per-row slots of the real width
    (512 blocks x 4 + a 4-token tail), 90% valid; the last row has no valid slot at all."""
    _, _, _, km, vm = real_attention_inputs(rng, T)
    qs = bf16(rng.standard_normal((1, 24, rows, 256), dtype=F32))
    W = 512 * 4 + 4
    slots = rng.integers(0, T, (rows, W)).astype(np.int32)
    svalid = rng.random((rows, W)) < 0.9
    svalid[-1] = False
    return qs, km, vm, mx.array(slots), mx.array(svalid)


@needs_cuda
@pytest.mark.parametrize("rows", [2, 5, 8])
def test_rows_gather_one_launch_matches_two_launches(rows):
    # the last row has no token: it gives 0 in both forms
    qs, km, vm, sl, sv = rows_gather_inputs(np.random.default_rng([47, rows]), rows)
    two = rows_gather_cuda(qs, km, vm, sl, sv, scale=1 / 16, one_launch=False)
    for _ in range(3):
        one = rows_gather_cuda(qs, km, vm, sl, sv, scale=1 / 16, one_launch=True)
        np.testing.assert_array_equal(to_np(one), to_np(two))
    assert not to_np(two)[0, :, -1].any()


def gate_logits(rng, rows: int, H: int = 24, d: int = 256, strided: bool = True) -> mx.array:
    """Output-gate logits [1, S, H, d] bf16: as the layer makes them (a strided view of q_proj's
    rows, query and gate halves interleaved per head) or contiguous. Wide values, with zeros,
    saturating magnitudes and both signs, so every branch of the sigmoid is exercised."""
    g = rng.standard_normal((1, rows, H, d), dtype=F32) * 4
    g.reshape(-1)[::97] = 0.0
    g.reshape(-1)[1::89] = 40.0
    g.reshape(-1)[2::83] = -40.0
    if not strided:
        return bf16(g)
    lin = np.concatenate([rng.standard_normal((1, rows, H, 1, d), dtype=F32), g[:, :, :, None]], 3)
    return mx.split(bf16(lin), 2, axis=3)[1].squeeze(3)


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


@needs_cuda
@pytest.mark.parametrize("strided", [True, False], ids=["view", "contiguous"])
@pytest.mark.parametrize("one_launch", [True, False], ids=["one", "two"])
@pytest.mark.parametrize("T", [37, 2052, 131072])
def test_flash_gate_fused_is_mlx_sigmoid_times_output(T, one_launch, strided):
    """The gate fused into the merge gives, bit for bit, MLX's own `o.transpose * sigmoid(g)` of
    the ungated output (QSA.md §9's order), in the layout [1, 1, H, d], for both merge forms."""
    from mlx_qsa.consumers import output_gate

    rng = np.random.default_rng([53, T])
    q, _, _, km, vm = real_attention_inputs(rng, T)
    nb = T // 4
    ids, valid = block_list(rng, 512, max(nb, 1), min(512, nb))
    args = (bf16(q[None, :, None]), km, vm, mx.array(ids), mx.array(valid))
    pos = mx.array([T - 1], dtype=mx.int32)
    g = gate_logits(rng, 1, strided=strided)
    plain = flash_decode_cuda(*args, pos=pos, scale=1 / 16, one_launch=one_launch)
    want = output_gate(plain, g)
    for _ in range(2):
        got = flash_decode_cuda(*args, pos=pos, scale=1 / 16, one_launch=one_launch, gate=g)
        assert got.shape == (1, 1, 24, 256) and got.dtype == mx.bfloat16
        np.testing.assert_array_equal(bits(got), bits(want))
    assert np.abs(to_np(want)).max() > 0  # a real output, not an all-zero pair


@needs_cuda
@pytest.mark.parametrize("one_launch", [True, False], ids=["one", "two"])
@pytest.mark.parametrize("rows", [2, 5, 8])
def test_rows_gather_gate_fused_is_mlx_sigmoid_times_output(rows, one_launch):
    from mlx_qsa.consumers import output_gate

    rng = np.random.default_rng([59, rows])
    # the last row has no token: 0 * sigmoid(g) in both
    qs, km, vm, sl, sv = rows_gather_inputs(rng, rows)
    g = gate_logits(rng, rows)
    plain = rows_gather_cuda(qs, km, vm, sl, sv, scale=1 / 16, one_launch=one_launch)
    want = output_gate(plain, g)
    got = rows_gather_cuda(qs, km, vm, sl, sv, scale=1 / 16, one_launch=one_launch, gate=g)
    assert got.shape == (1, rows, 24, 256)
    np.testing.assert_array_equal(bits(got), bits(want))
    assert np.abs(to_np(want)[0, :-1]).max() > 0
