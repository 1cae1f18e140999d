"""Dense masked attention on CUDA tensor cores: the `sdpa` consumer (RUNTIME.md §8) for many rows.

MLX's own `scaled_dot_product_attention` has no fused CUDA path at head_dim 256 with a mask
(PERFORMANCE.md §4): it writes the `[H, S, T]` scores to memory between two matmuls. This
kernel keeps them on chip. Rows see the tokens `t <= positions[r]` (causal), or with `mask` the
tokens `t < T` where `mask[r, t]`; query head h reads KV head `h // (H / Hkv)`. Its portable
twin is `consumers.sdpa.sdpa` (MLX's SDPA), with the same token sets.
"""

from __future__ import annotations

import mlx.core as mx

from . import _launch, device
from .device import DeviceLimits

_RT, _STEP, _NSTAGE = 8, 64, 2  # query rows per CTA, tokens per stage, stages (sdpa.cu)

# Fewest query rows the kernel takes (`consumers.dispatch`): a CTA holds 8 rows of one KV
# head and walks every token of the context alone, so short calls keep MLX's SDPA.
MIN_ROWS = 16


def kernel_env() -> bool:
    """Whether `consumers.dispatch` runs the calls `masked_sdpa_form` picks on this kernel (the
    default); ``MLX_QSA_SDPA_KERNEL=0`` leaves them to MLX's SDPA, for side-by-side timing."""
    return _launch.env_switch("MLX_QSA_SDPA_KERNEL") != "0"


def smem_bytes(d: int, g: int) -> int:
    """Dynamic shared memory: the K/V stages, then the G / 2 warps' query tiles."""
    return (_NSTAGE * 2 * _STEP + g // 2 * 16) * (d + 8) * 2


def sdpa_unsupported(
    dtype, n_heads: int, n_kv: int, d: int, limits: DeviceLimits | None = None
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
    return device.shared_memory_unsupported(limits, smem_bytes(d, g), "the sdpa kernel")


def sdpa_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    *,
    scale: float,
    mask: mx.array | None = None,
) -> mx.array:
    """q `[1, H, S, d]` bf16, keys/values `[1, Hkv, cap, d]` (cache backings, read in place),
    positions int32 `[S]`; mask None (causal: row r sees the tokens `t <= positions[r]`) or a
    bool keep-mask `[1, 1, S, T]` with `T <= cap` (row r sees `t < T` where `mask[.., r, t]`;
    any strides, e.g. a slice of a wider mask) -> `[1, H, S, d]` bf16. A row that sees no
    token gives 0."""
    fn = "sdpa_cuda"
    n_heads, rows, n_kv, d = _launch.check_attention(fn, q, keys, values)
    if rows < 1:
        raise ValueError(f"{fn}: q must hold at least one query row, got {list(q.shape)}")
    if positions.shape != (rows,) or positions.dtype != mx.int32:
        raise ValueError(
            f"{fn}: positions must be int32 [{rows}], got {list(positions.shape)} {positions.dtype}"
        )
    if mask is not None:
        _launch.check_dtype(fn, "mask", mask, (mx.bool_,))
        if mask.ndim != 4 or mask.shape[:3] != (1, 1, rows) or mask.shape[3] > keys.shape[2]:
            raise ValueError(
                f"{fn}: mask must be [1, 1, {rows}, T] with T <= cap ({keys.shape[2]}), "
                f"got {list(mask.shape)}"
            )
    if not scale > 0:
        raise ValueError(f"{fn}: scale must be a positive float, got {scale}")
    _launch.require_cuda(fn)
    why = sdpa_unsupported(q.dtype, n_heads, n_kv, d)
    if why is not None:
        raise NotImplementedError(f"{fn}: {why}")
    g = n_heads // n_kv
    masked = mask is not None
    kernel = _launch.build(
        "sdpa.cu",
        "attend",
        ("q", "keys", "values", "pos") + (("mask",) if masked else ()),
        ("out",),
        ("mask",) if masked else ("causal",),
        shared_memory=smem_bytes(d, g),
        prefix="#define QSA_MASK\n" if masked else "",
        template=(("D", d), ("G", g), ("HKV", n_kv), ("SCALE_BITS", _launch.float_bits(scale))),
    )
    n_cta = -(-rows // _RT) * n_kv
    inputs = [q, keys, values, positions] + ([mask] if masked else [])
    return _launch.single_output(kernel, (1, n_heads, rows, d), q.dtype, n_cta, g // 2 * 32)(
        *inputs
    )
