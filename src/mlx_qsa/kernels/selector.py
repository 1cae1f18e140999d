"""Decode / short-row block selector (QSA.md §8, RUNTIME.md §7): CUDA launcher and portable twin.

Both return, per query row, the exact top-``k_eff`` blocks (``k_eff = min(block_topk, nb)``,
``nb = (p + 1) // ratio``) in the order (adjusted score descending, block id ascending), written
as ids ascending among the valid slots, then empty slots (id 0, invalid, score -inf).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from ..device_arrays import MIN_ELEMENTS
from . import _launch, device
from .device import DeviceLimits

_MODES = ("blocks", "row_tokens")
_L = 8  # summaries kept per 32-block chunk by the score pass
_CAP = 4096  # candidates the top-k pass keeps in shared memory
_NT_TOPK = 512  # threads of a top-k CTA (one row) when few rows run at once
# ... and from _MANY_ROWS rows on, 128 threads and room for 2048 candidates (24 KB of shared
# memory; 55 registers a thread): 8 rows in flight an SM instead of 2. More rows at once beat
# more threads a row (H100, benchmarks/select_sweep.py, threads / candidates: 2048 rows after
# 32K 98.0 µs at 128 / 2048, 108.7 at 256 / 2048, 143.2 at 512 / 4096; 992-row pieces after
# 128K 192.0, 193.0, 222.3; the same selections). A row with more candidates than its room
# takes the exact global-memory path (slower, same result).
_NT_TOPK_MANY, _CAP_MANY, _MANY_ROWS = 128, 2048, 512
_NT_SCORE = 128  # threads (= block keys) of a score CTA in the two-launch form
_NT_FUSED = 256  # threads of a CTA of the one-launch form (its top-k runs on one of them)
_NT_SPLIT = 512  # threads of a one-launch CTA whose block keys take one thread per head


def _nbs_len(S: int) -> int:
    """Length of the score pass's nbs output (the rows' block counts, read by the top-k): at
    least `device_arrays.MIN_ELEMENTS` int32, so that MLX does not place it in its small
    managed-memory pool (arrays of at most 8 bytes, MLX 0.32 on CUDA); only the first S are
    written and read."""
    return max(S, MIN_ELEMENTS)


def score_smem_bytes(nt: int = _NT_SCORE, split_heads: int = 0) -> int:
    """Score pass: float queries for S * H_I <= 64 rows, then the staged key rows padded to
    136 bf16: `nt` of them, or `nt / split_heads` with one thread per head (query rows then
    padded to 132 floats)."""
    if split_heads:
        return 64 * 132 * 4 + nt // split_heads * 136 * 2
    return 64 * 128 * 4 + nt * 136 * 2


SCORE_SMEM_BYTES = score_smem_bytes()


# The one-launch form scores with fewer, wider CTAs and runs its top-k on 256 threads instead
# of 512, so its kernel is slower at long contexts (H100, 2026-12-06, warm caches: 54.5 against
# 17.8 + 23.3 us at 128K), but it saves a primitive (~18 us of graph build, plus evaluation). The
# whole step measured faster with it up to 128K tokens and slower at 256K (BENCHMARKS.md,
# "Decode step: plans, ..."): it is the default up to this many padded blocks.
FUSED_MAX_BLOCKS = 32768


def one_launch_default(npad: int, limits: DeviceLimits | None) -> bool:
    """Whether the selector over `npad` padded blocks runs as one launch unless told."""
    if npad > FUSED_MAX_BLOCKS:
        return False
    return (
        limits is None
        or device.shared_memory_unsupported(limits, fused_smem_bytes(npad), "") is None
    )


def select_one_launch_env() -> bool | None:
    """``MLX_QSA_SELECT_ONE_LAUNCH=0|1`` forces the selector's form (for side-by-side timing);
    None (unset) leaves the choice to the launcher."""
    v = _launch.env_switch("MLX_QSA_SELECT_ONE_LAUNCH")
    return None if v is None else v != "0"


def fused_smem_bytes(npad: int, split_heads: int = 0) -> int:
    """The one-launch selector: its CTAs score, then the last S run the top-k in the same
    shared memory."""
    if split_heads:
        return max(score_smem_bytes(_NT_SPLIT, split_heads), topk_smem_bytes(npad))
    return max(score_smem_bytes(_NT_FUSED), topk_smem_bytes(npad))


def split_heads_env() -> bool:
    """``MLX_QSA_SELECT_SPLIT_HEADS=1``: the one-launch selector scores with one thread per
    indexer head and runs its top-k on 512 threads (same bits, GPU-tested). Opt-in: on an H100
    (2026-12-06) it was a few µs faster at 128K and slower at 256K (BENCHMARKS.md)."""
    return _launch.env_switch("MLX_QSA_SELECT_SPLIT_HEADS") == "1"


def _check(fn: str, index_q, pooled, pos, block_topk: int, ratio: int, mode: str) -> None:
    _launch.check_ndim(fn, "index_q", index_q, 3, "[S, H_I, d_I]")
    _launch.check_ndim(fn, "pooled", pooled, 3, "[1, cap_pool, d_I]")
    S, _, d_i = index_q.shape
    if pooled.shape[0] != 1 or pooled.shape[2] != d_i:
        raise ValueError(
            f"{fn}: pooled must be [1, cap_pool, {d_i}], got shape {list(pooled.shape)}"
        )
    if pos.shape != (S,):
        raise ValueError(f"{fn}: pos must have shape [{S}], got {list(pos.shape)}")
    _launch.check_dtype(fn, "pos", pos, (mx.int32,))
    if index_q.dtype != pooled.dtype:
        raise ValueError(
            f"{fn}: index_q and pooled must share a dtype, got {index_q.dtype} and {pooled.dtype}"
        )
    if block_topk < 1:
        raise ValueError(f"{fn}: block_topk must be >= 1, got {block_topk}")
    if ratio < 1:
        raise ValueError(f"{fn}: ratio must be >= 1, got {ratio}")
    if mode not in _MODES:
        raise ValueError(f"{fn}: mode must be one of {_MODES}, got {mode!r}")


def _row_tokens(ids, valid, nb_raw, pos, block_topk: int, ratio: int):
    S = ids.shape[0]
    r = mx.arange(ratio, dtype=mx.int32)
    blk = (ids[:, :, None] * ratio + r).reshape(S, block_topk * ratio)
    blk_ok = mx.broadcast_to(valid[:, :, None], (S, block_topk, ratio)).reshape(S, -1)
    tail = nb_raw[:, None] * ratio + r
    tail_ok = tail <= pos[:, None]
    slots = mx.concatenate([mx.where(blk_ok, blk, 0), mx.where(tail_ok, tail, 0)], axis=1)
    return slots, mx.concatenate([blk_ok, tail_ok], axis=1)


def select_blocks_portable(
    index_q: mx.array,
    pooled: mx.array,
    pos: mx.array,
    *,
    block_topk: int = 512,
    ratio: int = 4,
    mode: str = "blocks",
):
    """Portable MLX twin of :func:`select_blocks_cuda` (same signature, same selections).

    index_q [S, H_I, d_I], pooled [1, cap_pool, d_I], pos int32 [S] ->
    (ids int32 [S, K], valid bool [S, K], scores float32 [S, K]) and, for ``mode="row_tokens"``,
    (slots int32 [S, K*ratio + ratio], slot_valid bool [S, K*ratio + ratio]).
    """
    fn = "select_blocks_portable"
    _check(fn, index_q, pooled, pos, block_topk, ratio, mode)
    S, n_heads, d_i = index_q.shape
    cap = pooled.shape[1]
    K = block_topk
    # Dot products accumulated in float32 over d = 0, 1, ... in order, as the CUDA kernel does
    # (bf16 x bf16 products are exact in float32, so FMA and multiply-then-add agree): the
    # scores, not just the selections, are bit-identical across the two paths.
    qd = mx.split(index_q.astype(mx.float32), d_i, axis=2)  # d_I x [S, H_I, 1]
    kd = mx.split(pooled[0].astype(mx.float32).T, d_i, axis=0)  # d_I x [1, cap]
    dots = qd[0] * kd[0]
    for d in range(1, d_i):
        dots = dots + qd[d] * kd[d]  # [S, H_I, cap]
    relu = mx.where(dots > 0, dots, 0.0)
    tot = relu[:, 0]
    for h in range(1, n_heads):  # head sum in order h = 0, 1, ...
        tot = tot + relu[:, h]
    score = tot / mx.array(math.sqrt(d_i), dtype=mx.float32)
    bid = mx.arange(cap, dtype=mx.int32)
    adj = score - bid.astype(mx.float32) * mx.array(1e-12, dtype=mx.float32)

    nb_raw = mx.where(pos >= 0, (pos + 1) // ratio, 0)
    nb = mx.minimum(nb_raw, cap)
    visible = bid[None, :] < nb[:, None]
    # Composite ascending key (~order(adj), id): all keys distinct, so any sort is exact.
    bits = mx.view(adj, mx.uint32)
    okey = mx.where((bits >> 31) == 1, ~bits, bits | 0x80000000)
    hi = mx.where(visible, ~okey, mx.array(0xFFFFFFFF, dtype=mx.uint32))
    comp = (hi.astype(mx.uint64) << 32) | bid.astype(mx.uint64)[None, :]
    order = mx.argsort(comp, axis=-1).astype(mx.int32)

    kw = min(K, cap)
    top = order[:, :kw]
    if kw < K:
        top = mx.concatenate([top, mx.zeros((S, K - kw), dtype=mx.int32)], axis=1)
    keff = mx.minimum(nb, K)
    valid = mx.arange(K, dtype=mx.int32)[None, :] < keff[:, None]
    big = mx.array(2**31 - 1, dtype=mx.int32)
    ids = mx.sort(mx.where(valid, top, big), axis=-1)
    ids = mx.where(valid, ids, 0)
    picked = mx.take_along_axis(adj, ids, axis=1)
    scores = mx.where(valid, picked, mx.array(-math.inf, dtype=mx.float32))
    if mode == "blocks":
        return ids, valid, scores
    return (ids, valid, scores) + _row_tokens(ids, valid, nb_raw, pos, K, ratio)


def selector_unsupported(
    dtype,
    rows: int,
    n_heads: int,
    d_i: int,
    n_blocks: int = 0,
    limits: DeviceLimits | None = None,
) -> str | None:
    """Why the CUDA selector cannot take these shapes (`n_blocks` pooled rows) on this GPU
    (`limits`, by default MLX's; unchecked without one), or None if it can."""
    if dtype != mx.bfloat16:
        return f"only bfloat16 inputs, got {dtype}"
    if d_i != 128:
        return f"only d_I = 128, got {d_i}"
    if n_heads > 8 or rows * n_heads > 64:
        return f"needs H_I <= 8 and S * H_I <= 64, got H_I={n_heads}, S={rows}"
    limits = device.resolve(limits)
    if limits is not None:
        npad = -(-max(n_blocks, 1) // 128) * 128
        return device.shared_memory_unsupported(
            limits, SCORE_SMEM_BYTES, "the score pass"
        ) or device.shared_memory_unsupported(limits, topk_smem_bytes(npad), "the top-k pass")
    return None


def topk_smem_bytes(npad: int, cap: int = _CAP) -> int:
    """Dynamic shared memory of the top-k kernel over `npad` padded blocks: the candidate
    buffer (`cap` candidates) and one bitmap bound per 32 blocks (one size class per bound, see
    top_k_from_plane)."""
    return cap * 8 + 4 * max(2048, npad // 32)


def select_blocks_cuda(
    index_q: mx.array,
    pooled: mx.array,
    pos: mx.array,
    *,
    block_topk: int = 512,
    ratio: int = 4,
    mode: str = "blocks",
    one_launch: bool | None = None,
    ctr: mx.array | None = None,
):
    """Fused block scoring + exact top-k on CUDA; see :func:`select_blocks_portable`.

    ``index_q`` is ``[S, H_I, d_I]`` as for the twin, or the layer's ``[1, H_I, S, d_I]`` (read
    in place).

    Pass 1 scores every block key once for all rows (one thread per block, many CTAs, the keys
    staged in shared memory) and keeps per-chunk summaries; pass 2 (one CTA per row) bounds the
    K-th score from the summaries, gathers the few candidates above it into shared memory and
    radix-selects them exactly. With ``one_launch`` (the default up to ``FUSED_MAX_BLOCKS``
    padded blocks) both passes are one kernel: the last S CTAs to finish scoring take a row each
    (a counter hand-off, no grid-wide wait), one MLX primitive instead of two with the same bits.
    Its counter is ``ctr`` (int32 [2] of `_launch.counter_slot`), or a fresh slot per call;
    inside ``mx.compile`` pass it as an input of the compiled function, so that replays of the
    graph running concurrently never share one.
    """
    fn = "select_blocks_cuda"
    if one_launch is None:
        one_launch = select_one_launch_env()
    launch = _launch.one_launch_env() if one_launch is None else one_launch
    split = split_heads_env()
    sig = _launch.signature((index_q, pooled, pos), block_topk, ratio, mode, launch, split)
    run = _PLANS.get(
        sig, lambda: _plan(fn, index_q, pooled, pos, block_topk, ratio, mode, one_launch)
    )
    return run(index_q, pooled, pos, ctr)


_PLANS = _launch.Plans()


def _plan(
    fn: str,
    index_q,
    pooled,
    pos,
    block_topk: int,
    ratio: int,
    mode: str,
    one_launch: bool | None,
    stamps: bool = False,
):
    """Checks a call's arguments and plans its launches (once per signature). ``stamps``: the
    diagnostic build (selector.cu QSA_STAMPS; the top-k's last output is its phase clocks)."""
    layer_layout = index_q.ndim == 4
    if layer_layout:  # the layer's layout, read in place (no transpose, no copy)
        if index_q.shape[0] != 1:
            raise ValueError(f"{fn}: index_q must be [1, H_I, S, d_I], got {list(index_q.shape)}")
        index_q = index_q[0].transpose(1, 0, 2)  # the view serves the checks
    _check(fn, index_q, pooled, pos, block_topk, ratio, mode)
    _launch.require_cuda(fn)
    S, n_heads, d_i = index_q.shape
    why = selector_unsupported(index_q.dtype, S, n_heads, d_i, pooled.shape[1])
    if why is not None:
        raise NotImplementedError(f"{fn}: {why}")
    cap = pooled.shape[1]
    if cap < 1:
        raise ValueError(f"{fn}: pooled must hold at least one block row, got {list(pooled.shape)}")
    npad = -(-cap // 128) * 128
    if one_launch is None:
        one_launch = _launch.one_launch_env() is not False and one_launch_default(
            npad, device.current()
        )
    if one_launch:
        split = n_heads if split_heads_env() and n_heads in (2, 4, 8) else 0
        return _plan_fused(layer_layout, S, n_heads, npad, block_topk, ratio, mode, split, stamps)
    score = _launch.build(
        "selector.cu",
        "score",
        ("index_q", "pooled", "pos"),
        ("adj", "summ", "nbs"),
        (),
        shared_memory=SCORE_SMEM_BYTES,
        ensure_row_contiguous=True,
        template=(("HI", n_heads), ("RATIO", ratio), ("L", _L), ("NT", _NT_SCORE)),
    )
    shapes = [(S, npad), (S, npad // 32 * _L), (_nbs_len(S),)]
    dtypes = [mx.float32, mx.uint32, mx.int32]
    top_k = _plan_top_k(S, block_topk, ratio, npad, mode, stamps)

    def run(q, pooled, pos, ctr=None):
        q4 = q if layer_layout else q.transpose(1, 0, 2)[None]
        adj, summ, nbs = score(
            inputs=[q4, pooled, pos],
            grid=(npad, 1, 1),
            threadgroup=(_NT_SCORE, 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
        return top_k(adj, summ, nbs, pos)

    return run


def _plan_fused(
    layer_layout: bool,
    S: int,
    n_heads: int,
    npad: int,
    K: int,
    ratio: int,
    mode: str,
    split: int = 0,
    stamps: bool = False,
):
    """The one-launch selector: score CTAs of ``_NT_FUSED`` threads (or ``_NT_SPLIT`` with
    ``split`` = H_I threads per block key), the top-k by the last S. ``stamps``: a diagnostic
    build whose last output is the rows' phase clocks (selector.cu QSA_STAMPS)."""
    nt = _NT_SPLIT if split else _NT_FUSED
    keys_per_cta = nt // split if split else nt
    rows = mode == "row_tokens"
    names, shapes, dtypes = _top_k_outputs(S, K, ratio, rows, stamps)
    kernel = _launch.build(
        "selector.cu",
        "score+select",
        ("index_q", "pooled", "pos", "ctr"),
        ("adj", "summ", "nbs") + names,
        ("fused", mode) + (("split",) if split else ()) + (("stamps",) if stamps else ()),
        shared_memory=fused_smem_bytes(npad, split),
        ensure_row_contiguous=True,
        prefix="#define QSA_FUSED\n"
        + ("#define QSA_ROW_TOKENS\n" if rows else "")
        + ("#define QSA_SPLIT_HEADS\n" if split else "")
        + ("#define QSA_STAMPS\n" if stamps else ""),
        template=(("HI", n_heads), ("RATIO", ratio), ("L", _L), ("NT", nt))
        + (("K", K), ("CAP", _CAP)),
    )
    shapes = [(S, npad), (S, npad // 32 * _L), (_nbs_len(S),)] + shapes
    dtypes = [mx.float32, mx.uint32, mx.int32] + dtypes
    n_cta = max(-(-npad // keys_per_cta), S)  # every row needs a CTA of its own at the end

    def run(q, pooled, pos, ctr=None):
        q4 = q if layer_layout else q.transpose(1, 0, 2)[None]
        out = kernel(
            inputs=[q4, pooled, pos, ctr if ctr is not None else _launch.counter_slot()],
            grid=(n_cta * nt, 1, 1),
            threadgroup=(nt, 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
        return tuple(out[3:])

    return run


def top_k_from_plane(
    adj: mx.array,
    summ: mx.array,
    nbs: mx.array,
    pos: mx.array,
    *,
    block_topk: int,
    ratio: int,
    npad: int,
    mode: str = "blocks",
) -> tuple[mx.array, ...]:
    """The top-k kernel over a score plane `adj [S, npad]` and its chunk summaries (from the
    decode score kernel or the prefill producer): (ids, valid, scores) per row, plus
    (slots, slot_valid) in `row_tokens` mode."""
    return _plan_top_k(adj.shape[0], block_topk, ratio, npad, mode)(adj, summ, nbs, pos)


def _top_k_outputs(
    S: int, K: int, ratio: int, rows: bool, stamps: bool = False
) -> tuple[tuple, list, list]:
    """Names, shapes and dtypes of the `select` section's outputs (either kernel that runs it):
    ids, valid, scores, in `row_tokens` mode (`rows`) slots and slot_valid, and with `stamps`
    the diagnostic phase clocks."""
    names = ("ids", "valid", "scores")
    shapes = [(S, K), (S, K), (S, K)]
    dtypes = [mx.int32, mx.bool_, mx.float32]
    if rows:
        names += ("slots", "slot_valid")
        shapes += [(S, K * ratio + ratio)] * 2
        dtypes += [mx.int32, mx.bool_]
    if stamps:
        names += ("stamps",)
        shapes.append((S, 16))
        dtypes.append(mx.int64)
    return names, shapes, dtypes


def topk_shape(rows: int) -> tuple[int, int]:
    """(threads, candidate capacity) of each row's top-k CTA for a launch over `rows` rows."""
    return (_NT_TOPK_MANY, _CAP_MANY) if rows >= _MANY_ROWS else (_NT_TOPK, _CAP)


@functools.lru_cache(maxsize=256)
def _plan_top_k(S: int, K: int, ratio: int, npad: int, mode: str, stamps: bool = False):
    rows = mode == "row_tokens"
    nt, cap = topk_shape(S)
    outputs, shapes, dtypes = _top_k_outputs(S, K, ratio, rows, stamps)
    # One size class per bitmap bound, so the dynamic shared memory never changes under a name.
    smem = topk_smem_bytes(npad, cap)
    topk = _launch.build(
        "selector.cu",
        "topk+select",
        ("adj", "summ", "nbs", "pos"),
        outputs,
        (mode,) + (("stamps",) if stamps else ()),
        shared_memory=smem,
        ensure_row_contiguous=True,
        prefix=("#define QSA_ROW_TOKENS\n" if rows else "")
        + ("#define QSA_STAMPS\n" if stamps else ""),
        template=(("K", K), ("RATIO", ratio), ("L", _L), ("CAP", cap), ("NT", nt)),
    )

    def run(adj, summ, nbs, pos):
        return tuple(
            topk(
                inputs=[adj, summ, nbs, pos],
                grid=(S * nt, 1, 1),
                threadgroup=(nt, 1, 1),
                output_shapes=shapes,
                output_dtypes=dtypes,
            )
        )

    return run
