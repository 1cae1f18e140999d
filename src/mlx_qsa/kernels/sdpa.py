"""Dense masked attention on CUDA tensor cores: the `sdpa` consumer (RUNTIME.md §8) for many rows.

MLX's own `scaled_dot_product_attention` has no fused CUDA path at head_dim 256 with a mask
(PERFORMANCE.md §4): it writes the `[H, S, T]` scores to memory between two matmuls. This
kernel keeps them on chip. Rows see the tokens `t <= positions[r]` (causal), or with `mask` the
tokens `t < T` where `mask[r, t]`; query head h reads KV head `h // (H / Hkv)`. Its portable
twin is `consumers.sdpa.sdpa` (MLX's SDPA), with the same token sets.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx

from . import _launch, device
from .device import DeviceLimits

_RT = 8  # query rows per CTA (sdpa.cu)


class Tiling(NamedTuple):
    """How the kernel streams K/V: `step` tokens a stage (32 or 64), `nstage` shared-memory
    slots (2..4), `kv_split`: K and V as separate cp.async groups (Q K^T waits for K only)."""

    step: int = 64
    nstage: int = 2
    kv_split: bool = False

    @property
    def label(self) -> str:
        """ "64x2", "32x3_kv": how benchmarks name the form (`from_label` reads it back)."""
        return f"{self.step}x{self.nstage}" + ("_kv" if self.kv_split else "")

    @classmethod
    def from_label(cls, label: str) -> Tiling:
        dims, _, kv = label.partition("_")
        step, nstage = (int(x) for x in dims.split("x"))
        return cls(step, nstage, kv == "kv")


TILING = Tiling()  # what calls get unless told (`tiling=`)
# The forms timed side by side on a GPU (benchmarks/sdpa_ab.py --tilings).
TILINGS = (TILING, Tiling(64, 2, True), Tiling(32, 3), Tiling(32, 4), Tiling(32, 3, True))

MAX_SPLIT = 64  # split-K CTAs of one row tile
MIN_SPLIT_STAGES = 4  # stages a split keeps at least

# Fewest query rows the kernel takes (`consumers.dispatch`); shorter calls keep MLX's SDPA.
MIN_ROWS = 2


def split_count(rows: int, n_kv: int, context: int, sm_count: int, step: int = TILING.step) -> int:
    """Split-K CTAs per row tile (pure): 1 where the row tiles alone make a wave (the kernel's
    shared memory holds one CTA an SM), else the power of two, at most ``MAX_SPLIT``, that
    brings the CTAs up to a wave while every split keeps ``MIN_SPLIT_STAGES`` stages of
    ``step`` of the ``context`` tokens."""
    ctas = -(-rows // _RT) * n_kv
    stages = -(-context // step)
    n = 1
    while n < MAX_SPLIT and ctas * n < sm_count and stages >= 2 * n * MIN_SPLIT_STAGES:
        n *= 2
    return n


# Whether dispatch uses the kernel unless told (its GPU tests passed on an H100, 2026-12-07).
DEFAULT_ON = True


def kernel_env() -> bool:
    """Whether `consumers.dispatch` runs the calls `masked_sdpa_form` picks on this kernel:
    ``MLX_QSA_SDPA_KERNEL=1`` / ``=0`` (side-by-side timing), else ``DEFAULT_ON``."""
    v = _launch.env_switch("MLX_QSA_SDPA_KERNEL")
    return DEFAULT_ON if v is None else v != "0"


def smem_bytes(d: int, g: int, tiling: Tiling = TILING) -> int:
    """Dynamic shared memory: the K/V stages, then the G / 2 warps' query tiles."""
    return (tiling.nstage * 2 * tiling.step + g // 2 * 16) * (d + 8) * 2


def sdpa_unsupported(
    dtype,
    n_heads: int,
    n_kv: int,
    d: int,
    limits: DeviceLimits | None = None,
    tiling: Tiling = TILING,
) -> str | None:
    """Why the kernel cannot take these shapes on this GPU (`limits`, by default MLX's, else
    an H100's), or None if it can."""
    if dtype != mx.bfloat16:
        return f"only bfloat16 inputs, got {dtype}"
    if d % 16 != 0 or not 16 <= d <= 256:
        return f"head_dim must be a multiple of 16 up to 256, got {d}"
    if n_kv < 1 or n_heads % n_kv != 0:
        return f"H ({n_heads}) must be a multiple of Hkv ({n_kv})"
    g = n_heads // n_kv
    if g % 2 != 0 or g > 16:
        return f"needs an even number of query heads per KV head, at most 16, got {g}"
    limits = device.resolve(limits) or device.HOPPER
    return device.shared_memory_unsupported(limits, smem_bytes(d, g, tiling), "the sdpa kernel")


def sdpa_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    *,
    scale: float,
    mask: mx.array | None = None,
    context: int | None = None,
    nsplit: int | None = None,
    within_causal: bool = False,
    tiling: Tiling | None = None,
) -> mx.array:
    """q `[1, H, S, d]` bf16, keys/values `[1, Hkv, cap, d]` (cache backings, read in place),
    positions int32 `[S]`; mask None (causal: row r sees the tokens `t <= positions[r]`) or a
    bool keep-mask `[1, 1, S, T]` with `T <= cap` (row r sees `t < T` where `mask[.., r, t]`;
    any strides, e.g. a slice of a wider mask) -> `[1, H, S, d]` bf16. A row that sees no
    token gives 0.

    `context`: the most tokens a row sees (the layer's T; default the mask's width, or the
    backing's length): it sizes the split-K of calls with few rows (`split_count`), which then
    take a second launch to merge (split_k_merge.cu). `nsplit` sets that split instead (a power
    of two up to ``MAX_SPLIT``; 1: one launch), for tests and side-by-side timing.
    `within_causal`: the caller knows `mask` keeps no token past its row's position (every QSA
    keep-mask, RUNTIME.md §8), so a row tile's stages past its furthest position are skipped.
    Masks whose rows are 4-byte aligned (as the layer's are) are read a word at a time.
    `tiling`: how K/V are streamed (default ``TILING``; the others for side-by-side timing)."""
    fn = "sdpa_cuda"
    n_heads, rows, n_kv, d = _launch.check_attention(fn, q, keys, values)
    if rows < 1:
        raise ValueError(f"{fn}: q must hold at least one query row, got {list(q.shape)}")
    _launch.check_positions(fn, positions, rows)
    if mask is not None:
        _launch.check_dtype(fn, "mask", mask, (mx.bool_,))
        if mask.ndim != 4 or mask.shape[:3] != (1, 1, rows) or mask.shape[3] > keys.shape[2]:
            raise ValueError(
                f"{fn}: mask must be [1, 1, {rows}, T] with T <= cap ({keys.shape[2]}), "
                f"got {list(mask.shape)}"
            )
    if not scale > 0:
        raise ValueError(f"{fn}: scale must be a positive float, got {scale}")
    if nsplit is not None and nsplit not in {2**i for i in range(MAX_SPLIT.bit_length())}:
        raise ValueError(f"{fn}: nsplit must be a power of two up to {MAX_SPLIT}, got {nsplit}")
    if tiling is None:
        tiling = TILING
    elif tiling.step not in (32, 64) or not 2 <= tiling.nstage <= 4:
        raise ValueError(f"{fn}: tiling must have step 32 or 64 and nstage 2..4, got {tiling}")
    _launch.require_cuda(fn)
    why = sdpa_unsupported(q.dtype, n_heads, n_kv, d, tiling=tiling)
    if why is not None:
        raise NotImplementedError(f"{fn}: {why}")
    g = n_heads // n_kv
    masked = mask is not None
    if context is None:
        context = mask.shape[3] if masked else keys.shape[2]
    if nsplit is None:
        nsplit = split_count(rows, n_kv, context, device.sm_count(), tiling.step)
    inputs = [q, keys, values, positions] + ([mask] if masked else [])
    causal_mask = masked and within_causal
    bits = _launch.float_bits(scale)
    return _plan(d, g, n_kv, rows, nsplit, masked, causal_mask, bits, tiling)(*inputs)


def sdpa_listed_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    lists: mx.array,
    counts: mx.array,
    rowwise: mx.array,
    *,
    scale: float,
    limit: int,
    ratio: int,
    tiling: Tiling | None = None,
) -> mx.array:
    """The kernel over shared tiles (`prefill_flash` on CUDA, `kernels.prefill_flash`): row tile
    i attends the blocks of its union list `lists[i, :counts[i]]` (`tile_union_cuda`), a row the
    RATIO tokens of the entries that list it, up to its position. The rows of tiles whose union
    holds more than `limit` blocks are copied from `rowwise` (the per-row kernel's output, which
    has them). One launch: callers keep it to calls whose row tiles fill the GPU
    (`split_count` 1). Arguments as `prefill_flash_cuda` checked them."""
    tiling = TILING if tiling is None else tiling
    n_heads, rows, n_kv, d = q.shape[1], q.shape[2], keys.shape[1], q.shape[-1]
    listed = (limit, ratio, lists.shape[1])
    run = _plan(
        d, n_heads // n_kv, n_kv, rows, 1, False, False, _launch.float_bits(scale), tiling, listed
    )
    return run(q, keys, values, positions, lists, counts, rowwise)


def listed_smem_bytes(d: int, g: int, limit: int, tiling: Tiling = TILING) -> int:
    """Dynamic shared memory of the shared-tile form: `smem_bytes` and the tile's list."""
    return smem_bytes(d, g, tiling) + 4 * limit


@functools.lru_cache(maxsize=256)
def _plan(
    d: int, g: int, n_kv: int, rows: int, nsplit: int, masked: bool, causal_mask: bool,
    scale_bits: int, tiling: Tiling, listed: tuple[int, int, int] | None = None,
):  # fmt: skip
    """The launch(es) of one call shape: the kernel writing `out`, or with `nsplit` > 1 its
    split-K partials and the shared merge kernel (`_launch.plan_split_k`). `listed`: (limit,
    ratio, list width) of the shared-tile form (QSA_LIST)."""
    names = ("q", "keys", "values", "pos") + (("mask",) if masked else ())
    template = (("D", d), ("G", g), ("HKV", n_kv), ("SCALE_BITS", scale_bits))
    template += (("STEP", tiling.step), ("NSTAGE", tiling.nstage))
    prefix = "#define QSA_MASK\n" if masked else ""
    key = ("mask",) if masked else ("causal",)
    smem = smem_bytes(d, g, tiling)
    if listed is not None:
        limit, ratio, width = listed
        names += ("lists", "counts", "rowwise")
        template += (("LIMIT", limit), ("RATIO", ratio), ("NE", width))
        prefix += "#define QSA_LIST\n"
        key = ("list",)
        smem = listed_smem_bytes(d, g, limit, tiling)
    if causal_mask:
        prefix += "#define QSA_MASK_CAUSAL\n"
        key = ("maskcausal",)
    if tiling.kv_split:
        prefix += "#define QSA_KV_SPLIT\n"
        key += ("kvsplit",)
    n_cta = -(-rows // _RT) * n_kv
    threads = g // 2 * 32
    out_shape = (1, g * n_kv, rows, d)
    if nsplit == 1:
        kernel = _launch.build(
            "sdpa.cu", "attend", names, ("out",), key, smem, prefix=prefix,
            template=template,
        )  # fmt: skip
        return _launch.single_output(kernel, out_shape, mx.bfloat16, n_cta, threads)
    run = _launch.plan_split_k(
        "sdpa.cu",
        names,
        template + (("NSPLIT", nsplit),),
        n_cta=n_cta * nsplit,
        rows=g * n_kv * rows,
        out_shape=out_shape,
        nsplit=nsplit,
        shared_memory=smem,
        out_dtype=mx.bfloat16,
        one_launch=False,
        section="attend",
        threads=threads,
        key=key + ("split",),
        prefix=prefix + "#define QSA_SPLIT\n",
    )
    return lambda *arrays: run(list(arrays))
