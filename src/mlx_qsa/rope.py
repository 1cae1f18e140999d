"""Rotate-half RoPE, MRoPE (interleaved or chunked axes), plain-weight RMSNorm (QSA.md §3, §5).

Both routines write cache states, so every path (eager, compiled, legacy, oracle scorer)
must produce the same bits (RUNTIME.md §10). Two hazards are avoided by construction:
- FMA contraction: `mx.compile` fuses chains of elementwise ops into generated kernels,
  and the generated code may contract `a*c - b*s` into an FMA. A slice (not fusable) sits
  between the products and the add/sub, so each product is rounded to float32 first.
- Transcendental differences: cos/sin tables are computed eagerly by `rope_tables` and fed
  to compiled graphs as array inputs, never recomputed inside them.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from .config import QSAConfig, inv_frequencies, mrope_axes
from .device_arrays import device_constant, int_arange


@lru_cache(maxsize=32)
def _freqs(cfg: QSAConfig) -> mx.array:
    """The frequency row `[1, d_r/2]` (made once: no expand_dims per call; in device memory,
    `device_arrays`)."""
    return device_constant(mx.array([inv_frequencies(cfg)], dtype=mx.float32))


@lru_cache(maxsize=32)
def _axis_selectors(cfg: QSAConfig) -> tuple[mx.array, mx.array, mx.array]:
    axes = mrope_axes(cfg)
    return tuple(device_constant(mx.array([a == k for a in axes])) for k in range(3))


def rope_tables(positions: mx.array, cfg: QSAConfig) -> tuple[mx.array, mx.array]:
    """cos/sin tables `[n, d_r/2]` float32 for int positions `[n]` (text) or `[3, n]` (T, H, W).

    `phi_i = float32(pos_axis(i)) * f_i`; the axis of pair i follows QSA.md §5.
    """
    freqs = _freqs(cfg)
    pos = positions.astype(mx.float32)
    if positions.ndim == 1:
        phi = pos[:, None] * freqs
    elif positions.ndim == 2 and positions.shape[0] == 3:
        sel_t, sel_h, sel_w = _axis_selectors(cfg)
        p = mx.where(sel_h[None, :], pos[1][:, None], pos[0][:, None])
        p = mx.where(sel_w[None, :], pos[2][:, None], p)
        phi = p * freqs
    else:
        raise ValueError(f"positions: expected shape [n] or [3, n], got {list(positions.shape)}")
    return mx.cos(phi), mx.sin(phi)


# The signs of rotate-half, read by every RoPE kernel. Made on the host they sit in MLX's 8-byte
# managed pool (device_arrays), so `prepare_device_constants` (run when a layer is built, outside
# any mx.compile; not at import, which would start the GPU) swaps in a GPU-made copy.
_SIGNS_HOST = mx.array([[-1.0], [1.0]], dtype=mx.float32)
_signs: dict[str, mx.array] = {}


def prepare_device_constants() -> None:
    """Make RoPE's constants in device memory (evaluates: call outside mx.compile)."""
    if "signs" not in _signs:
        _signs["signs"] = device_constant(_SIGNS_HOST)


def text_positions(start: int, stop: int, step: int = 1) -> mx.array:
    """int32 text positions start, start+step, ... < stop (the decode kernels read them, so
    one or two of them are not left in MLX's 8-byte managed pool: `device_arrays.int_arange`)."""
    return int_arange(start, stop, step)


# Text positions whose RoPE tables are made together: a decode step's rows (and a staging
# window's block keys) take views of one window's tables instead of making their own.
ROPE_WINDOW = 64


@lru_cache(maxsize=8)
def rope_window(cfg: QSAConfig, base: int, step: int) -> tuple[mx.array, ...]:
    """`(positions, cos, sin)` of the ROPE_WINDOW text positions base, base+step, ...: made
    once per window (lazily, with the first graph that uses them). Each element is computed by
    itself (cast, product, cos, sin), so a row of the window has the bits a table made for
    that position alone has."""
    pos = text_positions(base, base + ROPE_WINDOW * step, step)
    return (pos, *rope_tables(pos, cfg))


def window_span(start: int, stop: int, step: int) -> tuple[int, int, int] | None:
    """`(base, first, n)`: the window of positions start, start+step, ... < stop (rows
    first..first+n of `rope_window(cfg, base, step)`), or None when they do not fit one
    window (a prefill chunk, a negative start) and are made directly."""
    if step <= 0:
        return None
    n = len(range(start, stop, step))
    first = (start // step) % ROPE_WINDOW
    if n <= 0 or first + n > ROPE_WINDOW or start - first * step < 0:
        return None
    return start - first * step, first, n


@lru_cache(maxsize=16)
def text_rope(cfg: QSAConfig, start: int, stop: int, step: int = 1) -> tuple[mx.array, ...]:
    """`(positions, cos, sin)` of text positions start, start+step, ... < stop, made once for
    every caller that asks for the same range: the layers of a model at one step, a staging
    window's steps. The same arrays, so the same bits; six fewer primitives per repeat.
    Short ranges are views of a `rope_window` (three slices per step instead of ~7 ops),
    longer ones are made directly; a row's bits are the same either way."""
    span = window_span(start, stop, step)
    if span is None:
        pos = text_positions(start, stop, step)
        return (pos, *rope_tables(pos, cfg))
    base, first, n = span
    return tuple(a[first : first + n] for a in rope_window(cfg, base, step))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, rotary_dim: int) -> mx.array:
    """Rotate-half RoPE over the first `rotary_dim` channels of the last axis.

    x: `[..., n, width]` with the row axis second to last; cos/sin `[n, rotary_dim/2]`.
    Output has x's dtype; channels >= rotary_dim pass through unchanged.
    """
    half = rotary_dim // 2
    xf = x[..., :rotary_dim].astype(mx.float32)
    # [..., n, 1, 2, half] (a; b) times [n, 2, 1, half] (cos; sin): one broadcast multiply gives
    # all four products with no copies of x (each concatenation would be a kernel per input).
    pairs = xf.reshape(*xf.shape[:-1], 1, 2, half)
    table = mx.concatenate([cos, sin], axis=-1).reshape(cos.shape[0], 2, 1, half)  # 2 primitives
    prods = pairs * table
    # The split is the fusion barrier: each product is rounded to float32 before the add. One
    # split (views, no kernel) instead of an index per half: fewer primitives per rotation.
    by_cos, by_sin = mx.split(prods, 2, axis=-3)  # (a·cos; b·cos), (a·sin; b·sin)
    by_sin = by_sin[..., ::-1, :]  # (b·sin; a·sin)
    # (a·cos − b·sin; b·cos + a·sin): a product by ±1 is exact, so the add rounds as a subtract
    # (cast before the reshape: under mx.compile the cast fuses into the add's kernel)
    signs = _signs.get("signs", _SIGNS_HOST)
    rotated = (by_cos + signs * by_sin).astype(x.dtype).reshape(xf.shape)
    if rotary_dim == x.shape[-1]:
        return rotated
    return mx.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def rope(x: mx.array, cos: mx.array, sin: mx.array, rotary_dim: int, impl: str) -> mx.array:
    """`apply_rope` by the implementation `impl` names: with "cuda", the CUDA kernel
    (kernels/rope.py) where it covers the call, one MLX primitive instead of ~11; otherwise the
    portable routine. The same bits either way (same float32 products, one rounded add or
    subtract, the same cast)."""
    if impl == "cuda":
        from .kernels.rope import rope_cuda, rope_cuda_supports

        if rope_cuda_supports(x, cos, rotary_dim):
            return rope_cuda(x, cos, sin, rotary_dim)
    return apply_rope(x, cos, sin, rotary_dim)


def norm(x: mx.array, weight: mx.array, eps: float, impl: str) -> mx.array:
    """`rms_norm` by the implementation `impl` names: with "cuda", the CUDA kernel
    (kernels/rms_norm.py) where it covers the call, one MLX primitive instead of four;
    otherwise the portable routine. The same bits either way on MLX's CUDA backend (the same
    rounded operations, the row sum in MLX's order)."""
    if impl == "cuda":
        from .kernels.rms_norm import rms_norm_cuda, rms_norm_cuda_supports

        if rms_norm_cuda_supports(x, weight):
            return rms_norm_cuda(x, weight, eps)
    return rms_norm(x, weight, eps)


def norm_rope(
    x: mx.array,
    weight: mx.array,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    rotary_dim: int,
    impl: str,
    transpose: tuple[int, ...] | None = None,
) -> mx.array:
    """`rope(rms_norm(x).transpose(transpose), cos, sin, rotary_dim)`: query preparation. With
    "cuda", one kernel (kernels/rms_norm.py) where it covers the call, one primitive instead
    of ~6; otherwise `norm` then `rope`. The norm is per row, so the kernel reads x through the
    transposed view; the same bits either way."""
    if impl == "cuda":
        from .kernels.rms_norm import norm_rope_cuda, norm_rope_cuda_supports

        view = x if transpose is None else x.transpose(transpose)
        if norm_rope_cuda_supports(view, weight, rotary_dim):
            return norm_rope_cuda(view, weight, eps, cos, sin, rotary_dim)
    y = norm(x, weight, eps, impl)
    return rope(y if transpose is None else y.transpose(transpose), cos, sin, rotary_dim, impl)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Plain-weight RMSNorm: `bf16(x / sqrt(mean(x^2) + eps)) * w` (MLX order, QSA.md §3).

    Only correctly rounded operations (square, sum, divide, sqrt) are used, so eager SIMD
    code and `mx.compile`-generated code give the same bits; the mean is a division (not a
    multiply by 1/n) so no fused multiply-add can form with the epsilon add.
    """
    xf = x.astype(mx.float32)
    ms = mx.sum(xf * xf, axis=-1, keepdims=True) / xf.shape[-1]
    n = (xf / mx.sqrt(ms + eps)).astype(x.dtype)
    return n * weight.astype(x.dtype)
