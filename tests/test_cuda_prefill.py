"""Prefill on CUDA: selection (tensor-core score producer + the top-k kernel) and the
tensor-core `prefill_flash` attention, against their portable twins and float64 references.
The GPU tests skip without MLX's CUDA backend; the argument checks run everywhere."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from test_cuda_decode import bf16, make_selector_inputs, needs_cuda, ref_adj, ref_select, to_np

from mlx_qsa.consumers.prefill import prefill_flash
from mlx_qsa.kernels.prefill_flash import (
    FORMS,
    RT,
    prefill_flash_cuda,
    prefill_flash_form_cuda,
    prefill_flash_unsupported,
    shared_applies,
    shared_unsupported,
    tile_limit,
    tile_union_cuda,
    union_keys,
)
from mlx_qsa.kernels.prefill_score import prefill_scores_cuda, select_prefill_cuda
from mlx_qsa.kernels.selector import select_blocks_portable, topk_shape


def _inputs(rng, S, P, quantized=False, levels=3):
    pos = np.arange(P, P + S)
    nb_max = (pos[-1] + 1) // 4
    cap = nb_max + 37  # not a multiple of the 64-block tile; rows past nb are garbage (NaN)
    q, k, qm, km = make_selector_inputs(rng, S, 4, cap, nb_max, quantized=quantized, levels=levels)
    q4 = qm.transpose(1, 0, 2)[None]  # the layer's [1, H_I, S, d_I]
    return q, k, q4, km, pos, mx.array(pos.astype(np.int32))


@needs_cuda
@pytest.mark.parametrize("S,P", [(100, 1990), (64, 5000), (257, 2047), (130, 40000), (600, 3000)])
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


@needs_cuda
@pytest.mark.parametrize("levels,S,P", [(1, 96, 6000), (3, 96, 6000), (1, 600, 12000)])
def test_exact_dots_give_exact_scores_and_ties_to_low_ids(levels, S, P):
    """Small-integer inputs: every dot product is exact in any order, so scores equal the
    twin's bit for bit and the many ties resolve to the lowest ids exactly as specified. At
    600 rows the top-k runs its many-rows form (`topk_shape`: room for 2048 candidates), over
    ~3000 blocks of few distinct scores (`levels` 1: entries in {-1, 0, 1})."""
    rng = np.random.default_rng([43, levels, S])
    q, k, q4, km, pos, pm = _inputs(rng, S, P, quantized=True, levels=levels)
    got = select_prefill_cuda(q4, km, pm)
    twin = select_blocks_portable(bf16(q), km, pm)
    for a, b in zip(got, twin, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@needs_cuda
def test_chunks_equal_one_plane():
    rng = np.random.default_rng(47)
    _, _, q4, km, _, pm = _inputs(rng, 200, 9000)
    whole = select_prefill_cuda(q4, km, pm)
    for chunk in (48, 64, 199):
        part = select_prefill_cuda(q4, km, pm, chunk=chunk)
        for a, b in zip(whole, part, strict=True):
            assert mx.array_equal(a, b).item()


@needs_cuda
def test_many_rows_top_k_equals_the_few_rows_form():
    # 640 rows in one plane run the top-k's many-rows form (128 threads, 2048 candidates a
    # row), 320-row chunks its few-rows form (512, 4096): the same selections, bit for bit
    assert topk_shape(640) != topk_shape(320)
    rng = np.random.default_rng(53)
    _, _, q4, km, _, pm = _inputs(rng, 640, 20000)
    whole = select_prefill_cuda(q4, km, pm)
    halves = select_prefill_cuda(q4, km, pm, chunk=320)
    for a, b in zip(whole, halves, strict=True):
        assert mx.array_equal(a, b).item()


@needs_cuda
def test_scores_plane_and_summaries():
    rng = np.random.default_rng(53)
    q, k, q4, km, pos, pm = _inputs(rng, 70, 3000)
    adj, summ, nbs = prefill_scores_cuda(q4, km, pm)
    ref = ref_adj(q, k)
    nb = (pos + 1) // 4
    np.testing.assert_array_equal(np.array(nbs), nb)
    a = np.array(adj)
    for r in range(70):
        np.testing.assert_allclose(a[r, : nb[r]], ref[r, : nb[r]], rtol=1e-5, atol=1e-6)
    s = np.array(summ).reshape(70, -1, 8)
    # every row's chunks up to its last block: the 8 largest order keys of the chunk's blocks
    # below nb, descending, 0 past them (the partial last chunk included)
    u = a.view(np.uint32)
    keys = np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)
    keys[np.arange(a.shape[1])[None, :] >= nb[:, None]] = 0
    for r in range(70):
        for c in range(-(-nb[r] // 32)):
            want = np.sort(keys[r, 32 * c : 32 * c + 32])[::-1][:8]
            got = s[r, c].astype(np.uint32)
            np.testing.assert_array_equal(got, want, err_msg=f"row {r} chunk {c}")


# ---------------------------------------------------------------------------------------------
# prefill_flash attention


def _flash_inputs(rng, H, Hkv, d, K, ratio, positions, choose=None, written=False):
    """Random q, K/V backings and per-row selections in a random order; every token no row
    lists is NaN (a kernel that read one would show it), invalid entries hold garbage ids.
    `choose(r, nb, keff)`: row r's keff distinct blocks of its nb visible ones (default: a
    random draw). `written`: the chunk's own tokens (from its first row's block up to its last
    position), which the layer writes before it attends, are never NaN."""
    S = len(positions)
    T = int(positions.max()) + 1
    cap = -(-T // 256) * 256
    q = rng.standard_normal((1, H, S, d)).astype(np.float32)
    keys = rng.standard_normal((1, Hkv, cap, d)).astype(np.float32)
    values = rng.standard_normal((1, Hkv, cap, d)).astype(np.float32)
    ids = rng.integers(-(1 << 20), 1 << 20, (S, K)).astype(np.int32)
    valid = np.zeros((S, K), bool)
    tokens = []
    for r, p in enumerate(positions):
        nb = (p + 1) // ratio
        keff = min(K, nb)
        if choose is not None and nb:
            sel = np.asarray(choose(r, nb, keff), np.int64)
        else:
            sel = rng.permutation(nb)[:keff] if nb else np.zeros(0, np.int64)
        ids[r, :keff], valid[r, :keff] = sel, True
        blk = (sel[:, None] * ratio + np.arange(ratio)).reshape(-1)
        tokens.append(np.concatenate([blk, np.arange(nb * ratio, p + 1)]).astype(np.int64))
    listed = np.zeros(cap, bool)
    listed[np.concatenate(tokens)] = True
    listed[0] = True  # the portable twin reads token 0 for its invalid slots (weight 0)
    if written:
        listed[positions.min() // ratio * ratio : T] = True
    keys[:, :, ~listed], values[:, :, ~listed] = np.nan, np.nan
    arrays = (bf16(q), bf16(keys), bf16(values), mx.array(ids), mx.array(valid))
    return arrays, tokens


def _ref_rows(q, keys, values, tokens, scale, g):
    qn, kn, vn = to_np(q)[0].astype(np.float64), to_np(keys)[0], to_np(values)[0]
    out = np.zeros(qn.shape)
    for r, tok in enumerate(tokens):
        for h in range(qn.shape[0]):
            k, v = kn[h // g, tok].astype(np.float64), vn[h // g, tok].astype(np.float64)
            s = k @ qn[h, r] * scale
            e = np.exp(s - s.max())
            out[h, r] = e @ v / e.sum()
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@needs_cuda
@pytest.mark.parametrize(
    "H,Hkv,d,K,ratio,positions",
    [
        (24, 2, 256, 512, 4, np.arange(0, 90)),  # dense regime: every block, short lists
        (24, 2, 256, 512, 4, np.arange(2030, 2101)),  # across the first sparse token
        (24, 2, 256, 512, 4, np.arange(40000, 40130)),  # sparse, uneven count
        (8, 2, 128, 16, 4, np.arange(50, 117)),
        (4, 1, 64, 8, 2, np.arange(0, 41)),
        (16, 1, 128, 32, 1, np.arange(300, 333)),
    ],
)
def test_prefill_flash_matches_float64_and_the_portable_path(H, Hkv, d, K, ratio, positions):
    rng = np.random.default_rng([59, H, d, K, ratio, int(positions[0])])
    (q, keys, values, ids, valid), tokens = _flash_inputs(rng, H, Hkv, d, K, ratio, positions)
    pos = mx.array(positions.astype(np.int32))
    scale = 1 / math.sqrt(d)
    out = prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=scale, ratio=ratio)
    assert out.shape == q.shape and out.dtype == mx.bfloat16
    got = to_np(out)[0]
    ref = _ref_rows(q, keys, values, tokens, scale, H // Hkv)
    assert np.isfinite(got).all()
    for r in range(len(positions)):
        assert _rel(got[:, r], ref[:, r]) <= 1e-2, f"row {r} (position {positions[r]})"
    twin = to_np(prefill_flash(q, keys, values, ids, valid, pos, ratio, scale))[0]
    assert _rel(got, twin) <= 1e-2
    again = prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=scale, ratio=ratio)
    assert mx.array_equal(out, again).item()  # fixed merge order: the same bits every run


@needs_cuda
def test_prefill_flash_reads_a_transposed_q_in_place():
    """q as the layer makes it: a [1, H, S, d] view of a [1, S, H, d] buffer."""
    rng = np.random.default_rng(61)
    positions = np.arange(2500, 2564)
    (q, keys, values, ids, valid), _ = _flash_inputs(rng, 24, 2, 256, 512, 4, positions)
    qv = mx.contiguous(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    pos = mx.array(positions.astype(np.int32))
    a = prefill_flash_cuda(qv, keys, values, ids, valid, pos, scale=1 / 16)
    b = prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=1 / 16)
    assert mx.array_equal(a, b).item()


def _three_rows():
    """Arguments of three rows at the real geometry, for the argument checks."""
    q = bf16(np.zeros((1, 24, 3, 256)))
    kv = bf16(np.zeros((1, 2, 256, 256)))
    ids, valid = mx.zeros((3, 512), mx.int32), mx.zeros((3, 512), mx.bool_)
    return q, kv, ids, valid, mx.array([5, 6, 7], dtype=mx.int32)


def test_prefill_flash_argument_errors():
    q, kv, ids, valid, pos = _three_rows()
    with pytest.raises(ValueError, match="ids must have 3 rows"):
        prefill_flash_cuda(q, kv, kv, ids[:2], valid[:2], pos, scale=1 / 16)
    with pytest.raises(ValueError, match="valid must have shape"):
        prefill_flash_cuda(q, kv, kv, ids, valid[:, :4], pos, scale=1 / 16)
    with pytest.raises(ValueError, match="positions must be int32"):
        prefill_flash_cuda(q, kv, kv, ids, valid, pos.astype(mx.int64), scale=1 / 16)
    with pytest.raises(ValueError, match="keys head_dim"):
        prefill_flash_cuda(q, kv[..., :128], kv[..., :128], ids, valid, pos, scale=1 / 16)
    assert prefill_flash_unsupported(mx.bfloat16, 24, 2, 256, 4) is None
    assert "16 query heads" in prefill_flash_unsupported(mx.bfloat16, 24, 1, 256, 4)
    assert "bfloat16" in prefill_flash_unsupported(mx.float32, 24, 2, 256, 4)
    assert "shared memory" in prefill_flash_unsupported(mx.bfloat16, 24, 2, 256, 4, 4096)
    if not mx.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            prefill_flash_cuda(q, kv, kv, ids, valid, pos, scale=1 / 16)


@needs_cuda
@pytest.mark.parametrize("form", list(FORMS))
def test_prefill_flash_halves_write_zeros(form):
    """The benchmarks' halves of the kernel (loads alone; math alone over zeroed stages) run
    at the real geometry over unlisted NaN tokens and write an all-zero output."""
    rng = np.random.default_rng(67)
    positions = np.arange(40000, 40130)
    (q, keys, values, ids, valid), _ = _flash_inputs(rng, 24, 2, 256, 512, 4, positions)
    pos = mx.array(positions.astype(np.int32))
    out = prefill_flash_form_cuda(q, keys, values, ids, valid, pos, form=form)
    assert out.shape == q.shape and out.dtype == mx.bfloat16
    assert (to_np(out) == 0).all()


def test_prefill_flash_form_argument_errors():
    q, kv, ids, valid, pos = _three_rows()
    with pytest.raises(ValueError, match="form must be one of"):
        prefill_flash_form_cuda(q, kv, kv, ids, valid, pos, form="both")
    with pytest.raises(ValueError, match="ids must have 3 rows"):
        prefill_flash_form_cuda(q, kv, kv, ids[:2], valid[:2], pos, form="stream")
    with pytest.raises(ValueError, match="positions must be int32"):
        prefill_flash_form_cuda(q, kv, kv, ids, valid, pos[:2], form="math")
    if not mx.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            prefill_flash_form_cuda(q, kv, kv, ids, valid, pos, form="stream")


# ---------------------------------------------------------------------------------------------
# prefill_flash over shared tiles


def _tile_choice(rng, overlap, tiles_shared=None):
    """Selections whose rows share `overlap` of their blocks within each 8-row tile (a tile's
    common blocks drawn from the blocks its first row sees, the rest per row); tiles for which
    `tiles_shared(tile)` is False draw every row at random."""
    common = {}

    def choose(r, nb, keff):
        tile = r // RT
        if tiles_shared is not None and not tiles_shared(tile):
            return rng.permutation(nb)[:keff]
        if tile not in common:
            common[tile] = rng.permutation(nb)[: int(overlap * keff)]
        c = common[tile][common[tile] < nb][:keff]
        rest = np.setdiff1d(np.arange(nb), c)
        own = rng.permutation(rest)[: keff - len(c)]
        return rng.permutation(np.concatenate([c, own]))

    return choose


def _ref_union(ids, valid, positions, cap, ratio):
    """Each 8-row tile's union of valid in-range blocks and tail blocks, ascending, packed as
    the kernel packs it (block | rows << 24)."""
    ids, valid = np.array(ids), np.array(valid)
    S = len(positions)
    out = []
    for t in range(-(-S // RT)):
        rows = {}
        for r in range(t * RT, min(S, t * RT + RT)):
            p = int(positions[r])
            ok = valid[r] & (ids[r] >= 0) & ((ids[r].astype(np.int64) + 1) * ratio <= cap)
            blocks = [int(b) for b in ids[r][ok]]
            if (p + 1) % ratio:
                blocks.append((p + 1) // ratio)
            for b in blocks:
                rows[b] = rows.get(b, 0) | 1 << (r - t * RT)
        out.append([b | m << 24 for b, m in sorted(rows.items())])
    return out


@needs_cuda
@pytest.mark.parametrize(
    "positions,overlap",
    [
        (np.arange(40000, 40130), 0.95),  # uneven rows, every tile shared
        (np.arange(40000, 40130), 0.0),  # no tile shared: the per-row kernel for all
        (np.arange(2030, 2101), 0.9),  # across the first sparse token
        (np.arange(0, 90), 0.0),  # dense regime: each row lists all its blocks
    ],
)
def test_tile_union_lists_each_tiles_blocks_once(positions, overlap):
    """Both forms (a bitonic sort; a table of row bits per block) list the reference union."""
    rng = np.random.default_rng([67, int(positions[0]), int(overlap * 100)])
    choose = _tile_choice(rng, overlap)
    (_, keys, _, ids, valid), _ = _flash_inputs(rng, 4, 2, 64, 512, 4, positions, choose)
    pos = mx.array(positions.astype(np.int32))
    want = _ref_union(ids, valid, positions, keys.shape[2], 4)
    for form in ("sort", "table"):
        lists, counts = tile_union_cuda(ids, valid, pos, keys, ratio=4, form=form)
        got_l, got_c = np.array(lists).view(np.uint32), np.array(counts)
        assert got_c.tolist() == [len(w) for w in want], form
        for t, w in enumerate(want):
            assert got_l[t, : len(w)].tolist() == [x & 0xFFFFFFFF for x in w], (form, t)


@needs_cuda
@pytest.mark.parametrize(
    "positions,overlap,mixed",
    [
        (np.arange(40000, 40130), 0.95, False),  # every tile shared, uneven rows
        (np.arange(40000, 40130), 0.9, True),  # every other tile shared
        (np.arange(40000, 40064), 0.0, False),  # none: the per-row kernel's bits
        (np.arange(2030, 2101), 0.9, False),  # across the first sparse token
        (np.arange(0, 90), 0.0, False),  # dense regime: small unions, all shared
        (np.arange(5001, 5021), 1.0, False),  # identical selections, tails of every length
    ],
)
def test_shared_tiles_match_float64_and_the_per_row_kernel(positions, overlap, mixed):
    rng = np.random.default_rng([71, int(positions[0]), int(overlap * 100), mixed])
    choose = _tile_choice(rng, overlap, (lambda t: t % 2 == 0) if mixed else None)
    (q, keys, values, ids, valid), tokens = _flash_inputs(
        rng, 24, 2, 256, 512, 4, positions, choose, written=True
    )
    pos = mx.array(positions.astype(np.int32))
    scale = 1 / 16
    out = prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=scale, shared=True)
    per_row = prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=scale, shared=False)
    got, rows = to_np(out)[0], to_np(per_row)[0]
    ref = _ref_rows(q, keys, values, tokens, scale, 12)
    assert np.isfinite(got).all()
    for r in range(len(positions)):
        assert _rel(got[:, r], ref[:, r]) <= 1e-2, f"row {r} (position {positions[r]})"
    _, counts = tile_union_cuda(ids, valid, pos, keys, ratio=4)
    tiled = np.repeat(np.array(counts) <= tile_limit(512), RT)[: len(positions)]
    if (overlap >= 0.9 and not mixed) or positions[-1] < 2048:
        assert tiled.all()
    if overlap == 0.0 and positions[0] >= 2048:
        assert not tiled.any()
    if mixed:
        assert tiled.any() and not tiled.all()
    # rows of per-row tiles come from the per-row kernel, bit for bit
    assert np.array_equal(got[:, ~tiled], rows[:, ~tiled])
    again = prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=scale, shared=True)
    assert mx.array_equal(out, again).item()


def test_shared_tile_plan_is_pure_and_refuses_what_it_cannot_take(set_switch):
    from mlx_qsa.kernels import prefill_flash as pf

    # the table holds blocks 0..65535: a backing of 262140 tokens, not one of 262144
    assert pf.union_form((1 << 18) - 4, 4) == ("table" if pf.UNION_TABLE else "sort")
    assert pf.union_form(1 << 18, 4) == "sort"
    with pytest.raises(ValueError, match="form must be 'table' or 'sort'"):
        z = mx.zeros((8, 16), mx.int32)
        tile_union_cuda(z, z > 0, z[:, 0], mx.zeros((1, 1, 64, 8)), ratio=4, form="heap")
    assert shared_applies(2048, 2, 132) and shared_applies(528, 2, 132)
    assert not shared_applies(520, 2, 132)  # 65 tiles x 2 KV heads: short of a wave
    assert tile_limit(512) == 1024 and tile_limit(16) == 32
    assert union_keys(512) == 8192 and union_keys(16) == 256 and union_keys(1) == 16
    assert shared_unsupported(24, 2, 256, 512) is None
    assert "even number" in shared_unsupported(24, 8, 256, 512)  # 3 query heads a KV head
    assert "sort" in shared_unsupported(24, 2, 128, 2048)  # 16K keys: past 48 KB
    set_switch("MLX_QSA_PREFILL_SHARED", "1")
    assert pf.shared_env()
    set_switch("MLX_QSA_PREFILL_SHARED", "0")
    assert not pf.shared_env()
    set_switch("MLX_QSA_PREFILL_SHARED", None)
    assert pf.shared_env() == pf.SHARED_DEFAULT_ON
