"""Block-sparse prefill attention on CUDA tensor cores (RUNTIME.md §8 `prefill_flash`).

Each row attends its valid selected blocks (RATIO tokens each) plus its own 0..RATIO-1 tail
tokens, reading K/V in place from the cache backings; the portable twin is
`consumers.prefill.prefill_flash` (the tiled row-token gather), with the same token sets.
"""

from __future__ import annotations

import mlx.core as mx

from . import _launch, device
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
) -> mx.array:
    """q `[1, H, S, d]` bf16, keys/values `[1, Hkv, cap, d]`, ids int32 / valid bool `[S, K]`,
    positions int32 `[S]` -> `[1, H, S, d]` bf16. A row without tokens gives 0."""
    fn = "prefill_flash_cuda"
    n_heads, rows, n_kv, d = _launch.check_attention(fn, q, keys, values)
    _launch.check_row_lists(fn, rows, ("ids", "valid"), ids, valid, "[S, K]")
    if positions.shape != (rows,) or positions.dtype != mx.int32:
        raise ValueError(
            f"{fn}: positions must be int32 [{rows}], got {list(positions.shape)} {positions.dtype}"
        )
    _launch.require_cuda(fn)
    k = ids.shape[1]
    why = prefill_flash_unsupported(q.dtype, n_heads, n_kv, d, ratio, k)
    if why is not None:
        raise NotImplementedError(f"{fn}: {why}")
    if not scale > 0:
        raise ValueError(f"{fn}: scale must be a positive float, got {scale}")
    kernel = _launch.build(
        "prefill_flash.cu",
        "attend",
        ("q", "keys", "values", "ids", "valid", "pos"),
        ("out",),
        (),
        shared_memory=smem_bytes(d, k, ratio),
        template=(
            ("D", d),
            ("G", n_heads // n_kv),
            ("HKV", n_kv),
            ("K", k),
            ("RATIO", ratio),
            ("SCALE_BITS", _launch.float_bits(scale)),
        ),
    )
    return kernel(
        inputs=[q, keys, values, ids, valid, positions],
        grid=(rows * n_kv * _NT, 1, 1),
        threadgroup=(_NT, 1, 1),
        output_shapes=[(1, n_heads, rows, d)],
        output_dtypes=[q.dtype],
    )[0]
