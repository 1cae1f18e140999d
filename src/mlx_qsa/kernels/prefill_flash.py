"""Block-sparse prefill attention on CUDA tensor cores (RUNTIME.md §8 `prefill_flash`).

Each row attends its valid selected blocks (RATIO tokens each) plus its own 0..RATIO-1 tail
tokens, reading K/V in place from the cache backings; the portable twin is
`consumers.prefill.prefill_flash` (the tiled row-token gather), with the same token sets.

Two algorithms share the work (PERFORMANCE.md §3). Per row, a CTA gathers the row's own 2051
tokens (`attend`): 8.6 GB of K/V for a 2048-row chunk, whatever the rows share. Over shared
tiles (`shared=True`), each 8-row tile's union of blocks is listed once (`tile_union`) and
read once for all its rows by the `sdpa` kernel's list form, with each row's own blocks
visible. That reads each shared block once but computes every row over the whole union, so it
pays only where a tile's rows select mostly the same blocks: tiles whose union holds at most
`tile_limit` blocks take it, the others the per-row kernel, decided on the GPU per tile.
"""

from __future__ import annotations

import mlx.core as mx

from . import _launch, device, sdpa
from .device import DeviceLimits

_NT, _STEP, _NSTAGE, _MAX_G = 128, 64, 3, 16


_STATIC_SMEM = 1024  # room left for the kernel's static shared memory


def prefill_flash_unsupported(
    dtype,
    n_heads: int,
    n_kv: int,
    d: int,
    ratio: int,
    k: int = 512,
    limits: DeviceLimits | None = None,
) -> str | None:
    """Why the kernel cannot take these shapes (`k` blocks per row) on this GPU (`limits`, by
    default MLX's, else an H100's), or None if it can."""
    limits = device.resolve(limits) or device.HOPPER
    why = _launch.attention_unsupported(dtype, n_heads, n_kv, d, limits)
    if why is not None:
        return why
    if n_heads // n_kv > _MAX_G:
        return f"at most {_MAX_G} query heads per KV head (one m16 tile), got {n_heads // n_kv}"
    if ratio < 1:
        return f"ratio must be >= 1, got {ratio}"
    nbytes = smem_bytes(d, k, ratio) + _STATIC_SMEM
    if nbytes > limits.max_shared_memory:
        return (
            f"a row's {k} x {ratio} token list beside the K/V stages needs {nbytes} bytes of "
            f"shared memory; {limits.arch} allows {limits.max_shared_memory}"
        )
    return None


def smem_bytes(d: int, k: int, ratio: int) -> int:
    """Dynamic shared memory: the K/V stages, the query tile, the row's token list."""
    return _NSTAGE * 2 * _STEP * (d + 8) * 2 + 16 * (d + 8) * 2 + (k * ratio + ratio) * 4


RT = 8  # rows of a shared tile (sdpa.cu's row tile)
_UNION_THREADS = 512

# Whether prefill_flash_cuda uses shared tiles unless told. Off: on independent random rows
# (no tile qualifies) the hybrid costs 6-8 % (H100, 32K; 8 % with the union's table form, 15 %
# with its sort, medians of 3 in one run); it pays from ~90 % adjacent-row overlap.
SHARED_DEFAULT_ON = False


def shared_env() -> bool:
    """``MLX_QSA_PREFILL_SHARED=1`` / ``=0``, else ``SHARED_DEFAULT_ON``."""
    v = _launch.env_switch("MLX_QSA_PREFILL_SHARED")
    return SHARED_DEFAULT_ON if v is None else v != "0"


def tile_limit(k: int) -> int:
    """The most blocks a tile's union may hold for the shared-tile kernel (pure): a quarter of
    its rows' ``RT * k`` selections. The tile kernel computes all RT rows over the union; the
    per-row kernel reads each row's own k blocks. Measured break-even near a third (H200, 32K
    and 128K: unions of ~1400 blocks of 4096); a quarter keeps a margin."""
    return RT * k // 4


def shared_applies(rows: int, n_kv: int, sm_count: int) -> bool:
    """Whether a call takes the shared-tile form (pure): its row tiles must fill the GPU on
    their own (the list form runs in one launch, without split-K)."""
    return -(-rows // RT) * n_kv >= sm_count


# The table form of `tile_union` (a byte of row bits per block, in 64 KB of shared memory):
# contexts of fewer than this many blocks (256K tokens at ratio 4); longer ones sort.
UNION_TABLE_BLOCKS = 65536
UNION_TABLE = True  # the table form where it fits (GPU-tested, and faster than the sort: H100)


def _table_fits(cap: int, ratio: int) -> bool:
    """Whether every block of a backing of `cap` tokens (and a tail block past the last whole
    one) has a byte of the union table."""
    return cap // ratio + 1 <= UNION_TABLE_BLOCKS


def union_form(cap: int, ratio: int) -> str:
    """Which `tile_union` form a backing of `cap` tokens takes (pure): "table" where it fits
    (`_table_fits`), else "sort"."""
    return "table" if UNION_TABLE and _table_fits(cap, ratio) else "sort"


def union_keys(k: int) -> int:
    """Sort length of `tile_union`: the power of two that holds a tile's RT * k selections
    and RT tail blocks (pure)."""
    n = RT * k + RT
    return 1 << (n - 1).bit_length()


def shared_unsupported(n_heads: int, n_kv: int, d: int, k: int) -> str | None:
    """Why the shared-tile form cannot take these shapes (the sdpa kernel's own limits, its
    list beside its shared memory, the sort's static shared memory), or None."""
    why = sdpa.sdpa_unsupported(mx.bfloat16, n_heads, n_kv, d)
    if why is not None:
        return why
    limits = device.resolve(None) or device.HOPPER
    g = n_heads // n_kv
    nbytes = sdpa.listed_smem_bytes(d, g, tile_limit(k))
    why = device.shared_memory_unsupported(limits, nbytes, "the shared-tile kernel")
    if why is not None:
        return why
    if union_keys(k) * 4 > device.DEFAULT_BLOCK_SMEM:  # the sort's static shared memory
        return f"a tile's {RT} x {k} selections exceed the union sort's 48 KB"
    return None


def tile_union_cuda(
    ids: mx.array,
    valid: mx.array,
    positions: mx.array,
    keys: mx.array,
    *,
    ratio: int,
    form: str | None = None,
) -> tuple[mx.array, mx.array]:
    """Each 8-row tile's union of valid selected blocks and tail blocks, ascending, entries
    packed as ``block | rows << 24`` -> (lists int32 `[n_tiles, RT * K + RT]`, past the count
    unwritten; counts int32 `[n_tiles]`). `keys` gives the backing's length (blocks past it are
    dropped, as the per-row kernel drops them). `form`: "table" or "sort" (the same lists;
    default `union_form`)."""
    rows, k = ids.shape
    n_tiles = -(-rows // RT)
    cap = keys.shape[2]
    form = union_form(cap, ratio) if form is None else form
    if form == "table" and not _table_fits(cap, ratio):
        raise ValueError(f"tile_union_cuda: the table form holds {UNION_TABLE_BLOCKS} blocks")
    template = (("K", k), ("RATIO", ratio), ("NT", _UNION_THREADS))
    if form == "table":
        section, smem = "union_pre+tile_union_bitmap", UNION_TABLE_BLOCKS
        template += (("NBMAX", UNION_TABLE_BLOCKS),)
    elif form == "sort":
        section, smem = "union_pre+tile_union", 0
        template += (("NKEYS", union_keys(k)),)
    else:
        raise ValueError(f"tile_union_cuda: form must be 'table' or 'sort', got {form!r}")
    kernel = _launch.build(
        "prefill_flash.cu",
        section,
        ("ids", "valid", "pos", "keys"),
        ("lists", "counts"),
        (form,),
        shared_memory=smem,
        template=template,
    )
    return tuple(
        kernel(
            inputs=[ids, valid, positions, keys],
            grid=(n_tiles * _UNION_THREADS, 1, 1),
            threadgroup=(_UNION_THREADS, 1, 1),
            output_shapes=[(n_tiles, RT * k + RT), (n_tiles,)],
            output_dtypes=[mx.int32, mx.int32],
        )
    )


def prefill_flash_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    ids: mx.array,
    valid: mx.array,
    positions: mx.array,
    *,
    scale: float,
    ratio: int = 4,
    shared: bool | None = None,
) -> mx.array:
    """q `[1, H, S, d]` bf16, keys/values `[1, Hkv, cap, d]`, ids int32 / valid bool `[S, K]`,
    positions int32 `[S]` -> `[1, H, S, d]` bf16. A row without tokens gives 0.

    `shared`: attend the 8-row tiles whose union of blocks is small over shared tiles, the
    others per row (None: ``shared_env()`` where `shared_applies`; where the shapes do not
    allow it, per row)."""
    args = (q, keys, values, ids, valid, positions)
    n_heads, rows, n_kv, d, k = _check_attend("prefill_flash_cuda", *args, scale, ratio)
    if shared is None:
        shared = shared_env() and shared_applies(rows, n_kv, device.sm_count())
    if shared and shared_unsupported(n_heads, n_kv, d, k) is not None:
        shared = False
    if not shared:
        return _attend(args, scale, ratio)
    limit = tile_limit(k)
    lists, counts = tile_union_cuda(ids, valid, positions, keys, ratio=ratio)
    out = _attend(
        args + (counts,), scale, ratio, ("skip",), "#define QSA_TILE_SKIP\n", (("LIMIT", limit),)
    )
    # the shared tiles, and the other tiles' rows copied from the per-row kernel's output
    return sdpa.sdpa_listed_cuda(
        q, keys, values, positions, lists, counts, out, scale=scale, limit=limit, ratio=ratio
    )


def _check_attend(fn: str, q, keys, values, ids, valid, positions, scale: float, ratio: int):
    """The per-row kernel's argument checks, in its launchers' order; (H, S, Hkv, d, K)."""
    n_heads, rows, n_kv, d = _launch.check_attention(fn, q, keys, values)
    _launch.check_row_lists(fn, rows, ("ids", "valid"), ids, valid, "[S, K]")
    _launch.check_positions(fn, positions, rows)
    _launch.require_cuda(fn)
    k = ids.shape[1]
    why = prefill_flash_unsupported(q.dtype, n_heads, n_kv, d, ratio, k)
    if why is not None:
        raise NotImplementedError(f"{fn}: {why}")
    if not scale > 0:
        raise ValueError(f"{fn}: scale must be a positive float, got {scale}")
    return n_heads, rows, n_kv, d, k


_ATTEND_INPUTS = ("q", "keys", "values", "ids", "valid", "pos", "counts")


def _attend(
    inputs: tuple, scale: float, ratio: int, key: tuple = (), prefix: str = "", extra: tuple = ()
) -> mx.array:
    """One launch of the per-row kernel (`attend`) over checked `inputs` (q, keys, values, ids,
    valid, positions[, counts]); `prefix` defines its form, `extra` adds template values."""
    q, _, _, ids = inputs[:4]
    _, n_heads, rows, d = q.shape
    n_kv, k = inputs[1].shape[1], ids.shape[1]
    template = (
        ("D", d),
        ("G", n_heads // n_kv),
        ("HKV", n_kv),
        ("K", k),
        ("RATIO", ratio),
        ("SCALE_BITS", _launch.float_bits(scale)),
    ) + extra
    kernel = _launch.build(
        "prefill_flash.cu",
        "attend",
        _ATTEND_INPUTS[: len(inputs)],
        ("out",),
        key,
        shared_memory=smem_bytes(d, k, ratio),
        prefix=prefix,
        template=template,
    )
    return kernel(
        inputs=list(inputs),
        grid=(rows * n_kv * _NT, 1, 1),
        threadgroup=(_NT, 1, 1),
        output_shapes=[(1, n_heads, rows, d)],
        output_dtypes=[q.dtype],
    )[0]


# The benchmarks' forms of the per-row kernel (`prefill_flash_form_cuda`): its defines.
FORMS = {
    "stream": "#define QSA_PART_STREAM\n",
    "math": "#define QSA_PART_MATH\n",
}


def prefill_flash_form_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    ids: mx.array,
    valid: mx.array,
    positions: mx.array,
    *,
    form: str,
    scale: float = 1.0,
    ratio: int = 4,
) -> mx.array:
    """The per-row kernel in one of the benchmarks' `FORMS`. `stream` issues its K/V loads
    without the math and `math` its tensor-core work and softmax over zeroed stages without
    the loads (both write zeros): the kernel costs at least the larger of the two, so each
    bounds what speeding up the other can gain (PERFORMANCE.md §3: 8.6 GB of K/V a chunk)."""
    fn = "prefill_flash_form_cuda"
    if form not in FORMS:
        raise ValueError(f"{fn}: form must be one of {tuple(FORMS)}, got {form!r}")
    args = (q, keys, values, ids, valid, positions)
    _check_attend(fn, *args, scale, ratio)
    return _attend(args, scale, ratio, ("form", form), FORMS[form])
