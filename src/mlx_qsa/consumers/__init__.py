"""The six attention consumers (RUNTIME.md §8) and the dispatch of a consumer plan.

Each consumer is one algorithm; `dispatch` runs what the plan chose, with the portable
implementation here, or with `impl="cuda"` the CUDA kernel of the consumer where one exists
and covers the shapes (flash, rows_gather, prefill_flash; prefill_gather runs the rows-gather
kernel per tile; sdpa with a causal or keep-mask, and dense_mask, on the masked-attention
kernel); the plan itself never depends on `impl`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from .. import plan
from ..indexer import Selection, dense_keep_mask, row_token_slots

# the kernel modules, not their functions: a launcher looked up at call time can be replaced
# (tests count the calls)
from ..kernels import _launch
from ..kernels import flash_decode as flash_kernel
from ..kernels import rows_gather as rows_kernel
from .flash import flash
from .prefill import dense_mask_attention, prefill_flash, prefill_gather
from .rows_gather import rows_gather
from .sdpa import sdpa

__all__ = [
    "dispatch",
    "masked_sdpa_form",
    "output_gate",
    "flash",
    "prefill_flash",
    "prefill_gather",
    "rows_gather",
    "sdpa",
    "dense_mask_attention",
]


def cuda_attention_supports(q: mx.array, keys: mx.array) -> bool:
    """Whether the CUDA flash / rows-gather kernels cover these shapes (their launchers'
    own rule; flash also needs the ratio to divide its token tile). Decided once per shape."""
    return _attention_supports(q.dtype, keys.dtype, q.shape[1], keys.shape[1], q.shape[-1])


@functools.lru_cache(maxsize=512)
def _attention_supports(q_dtype, k_dtype, n_heads: int, n_kv: int, d: int) -> bool:
    from ..kernels._launch import attention_unsupported

    if k_dtype != q_dtype:
        return False
    return attention_unsupported(q_dtype, n_heads, n_kv, d) is None


@functools.lru_cache(maxsize=64)
def _sdpa_supports(dtype, n_heads: int, n_kv: int, d: int) -> bool:
    """Whether the masked-attention kernel covers these shapes on this GPU (decided once)."""
    from ..kernels.sdpa import sdpa_unsupported

    return sdpa_unsupported(dtype, n_heads, n_kv, d) is None


def output_gate(o: mx.array, gate: mx.array) -> mx.array:
    """The output gate on an attention output (QSA.md §9): o `[1, H, S, d]`, the gate's logits
    `[1, S, H, d]` -> `o ⊙ sigmoid(gate)` as `[1, S, H, d]`, in MLX's order (sigmoid of the bf16
    gate rounded to bf16, the product rounded to bf16)."""
    return o.transpose(0, 2, 1, 3) * mx.sigmoid(gate)


class Operands(NamedTuple):
    """What every consumer of one call reads: queries `[1, H, S, d]`, the cache's K/V backing
    `[1, Hkv, cap, d]`, the selection, the rows' positions, the context length T, the block
    ratio and the softmax scale."""

    q: mx.array
    keys: mx.array
    values: mx.array
    sel: Selection
    positions: mx.array
    T: int
    ratio: int
    scale: float


def dispatch(
    cplan: plan.ConsumerPlan,
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    sel: Selection,
    positions: mx.array,
    T: int,
    ratio: int,
    scale: float,
    impl: str = "portable",
    gate: mx.array | None = None,
) -> mx.array:
    """Attention output `[1, H, S, d]` of the consumer chain `cplan.consumers`; with `gate`
    (the output gate's logits `[1, S, H, d]`), the gated output `[1, S, H, d]`.

    The CUDA flash and rows-gather kernels apply the gate in their merge (one launch instead of
    a sigmoid and a multiply after it, the same bits; ``MLX_QSA_FUSE_GATE=0`` turns that off);
    every other route applies it with `output_gate`."""
    a = Operands(q, keys, values, sel, positions, T, ratio, scale)
    out = None
    if impl == "cuda" and cuda_attention_supports(q, keys):
        fuse = gate if gate is not None and _launch.fuse_gate_env() else None
        out = _cuda(cplan, a, fuse)
    o, gated = out if out is not None else (_portable(cplan, a), False)
    if gate is None or gated:
        return o
    return output_gate(o, gate)


def decode_launch(
    kind: str, scale: float, ratio: int, arrays: tuple, gate: mx.array | None
) -> mx.array:
    """Run a decode consumer's CUDA kernel on `arrays` (`kind` "flash": q, keys, values, block
    ids, block validity, positions; "rows_gather": q, keys, values, slots, slot validity), with
    the output gate's logits `gate` fused if given. The launch is an `mx.compile`d function of
    those arrays and the one-launch merge's counter slot (a fresh slot per call, as an input:
    queued replays never share one), so a step replays one recorded primitive instead of
    running the launcher's Python and MLX's kernel call again; ``MLX_QSA_COMPILE_DECODE=0``
    runs the launcher directly (the same bits, for side-by-side timing)."""
    # the launchers' own switch is part of the key: a trace keeps the form it was made with
    compiled = _launch.compile_decode_env()
    fn = _decode_fn(kind, scale, ratio, gate is not None, compiled, _launch.one_launch_env())
    if gate is None:
        return fn(*arrays, _launch.counter_slot())
    return fn(*arrays, gate, _launch.counter_slot())


@functools.lru_cache(maxsize=64)
def _decode_fn(
    kind: str, scale: float, ratio: int, gated: bool, compiled: bool, one_launch: bool | None
) -> Callable:
    if kind == "flash":

        def run(q, keys, values, ids, valid, positions, *rest):
            gate, ctr = (rest[0] if gated else None), rest[-1]
            return flash_kernel.flash_decode_cuda(
                q, keys, values, ids, valid, scale=scale, ratio=ratio, pos=positions,
                one_launch=one_launch, gate=gate, ctr=ctr,
            )  # fmt: skip

    elif kind == "rows_gather":

        def run(q, keys, values, slots, slot_valid, *rest):
            gate, ctr = (rest[0] if gated else None), rest[-1]
            return rows_kernel.rows_gather_cuda(
                q, keys, values, slots, slot_valid, scale=scale, one_launch=one_launch, gate=gate,
                ctr=ctr,
            )  # fmt: skip

    else:
        raise ValueError(f"decode_launch: kind must be 'flash' or 'rows_gather', got {kind!r}")
    return mx.compile(run) if compiled else run


def _cuda(
    cplan: plan.ConsumerPlan, a: Operands, gate: mx.array | None
) -> tuple[mx.array, bool] | None:
    """The consumer on its CUDA kernel, and whether `gate` is already applied in its output;
    None where no kernel covers the call (the portable consumer runs)."""
    first = cplan.consumers[0]
    q, keys, values, sel = a.q, a.keys, a.values, a.sel
    if first == "flash" and flash_kernel.ratio_supported(a.ratio):
        # the selection's row and the row's position are read in place (no extra arrays)
        arrays = (q, keys, values, sel.ids, sel.valid, a.positions)
        return decode_launch("flash", a.scale, a.ratio, arrays, gate), gate is not None
    if first == "rows_gather":
        arrays = (q, keys, values, sel.slots, sel.slot_valid)
        return decode_launch("rows_gather", a.scale, a.ratio, arrays, gate), gate is not None
    if first == "prefill_flash":
        from ..kernels.prefill_flash import prefill_flash_cuda, prefill_flash_unsupported

        n_heads, n_kv, d = q.shape[1], keys.shape[1], q.shape[-1]
        why = prefill_flash_unsupported(q.dtype, n_heads, n_kv, d, a.ratio, sel.ids.shape[1])
        if why is None:
            o = prefill_flash_cuda(
                q, keys, values, sel.ids, sel.valid, a.positions, scale=a.scale, ratio=a.ratio
            )
            return o, False
    o = _masked_sdpa_cuda(cplan, a)
    if o is not None:
        return o, False
    if first in ("prefill_flash", "prefill_gather"):

        def gather(qt, k, v, slots, slot_valid, sc):
            return rows_kernel.rows_gather_cuda(qt, k, v, slots, slot_valid, scale=sc)

        consumer = prefill_flash if first == "prefill_flash" else prefill_gather
        o = consumer(
            q, keys, values, sel.ids, sel.valid, a.positions, a.ratio, a.scale, gather=gather
        )
        return o, False
    return None


def masked_sdpa_form(first: str, sdpa_mask: str, rows: int) -> str | None:
    """Which call the masked-attention kernel takes on CUDA (`kernels.sdpa`; pure: no arrays):
    "causal" (`sdpa`, causal), "mask" (`sdpa` with the selection's keep-mask), "dense_mask"
    (the `dense_mask` consumer's mask, made from prefill blocks), or None (another route, or
    fewer than `kernels.sdpa.MIN_ROWS` rows: MLX's SDPA)."""
    from ..kernels.sdpa import MIN_ROWS

    if rows < MIN_ROWS:
        return None
    if first == "sdpa":
        return {"causal": "causal", "dense_mask": "mask"}.get(sdpa_mask)
    return "dense_mask" if first == "dense_mask" else None


def _masked_sdpa_cuda(cplan: plan.ConsumerPlan, a: Operands) -> mx.array | None:
    """The call on the masked-attention kernel where it takes it (`masked_sdpa_form`) and
    covers the shapes, else None. The keep-masks here lie within the causal bound (RUNTIME.md
    §8: selected blocks and the tail, both at or before the row's position), which spares the
    kernel the stages past a row tile's furthest position."""
    q, keys, T = a.q, a.keys, a.T
    form = masked_sdpa_form(cplan.consumers[0], cplan.sdpa_mask, q.shape[2])
    if form is None:
        return None
    from ..kernels.sdpa import kernel_env, sdpa_cuda

    if not kernel_env():
        return None
    if not _sdpa_supports(q.dtype, q.shape[1], keys.shape[1], q.shape[-1]):
        return None
    mask = None
    if form == "mask":
        mask = a.sel.mask
    elif form == "dense_mask":  # rows padded to 4 bytes: the kernel reads the mask in words
        width = -(-T // 4) * 4
        sel = a.sel
        mask = dense_keep_mask(sel.ids, sel.valid, a.positions, width, a.ratio)[None, None, :, :T]
    return sdpa_cuda(
        q, keys, a.values, a.positions, scale=a.scale, mask=mask, context=T, within_causal=True
    )


def _portable(cplan: plan.ConsumerPlan, a: Operands) -> mx.array:
    q, keys, values, sel, positions, T, ratio, scale = a
    first = cplan.consumers[0]
    if first == "sdpa":
        mask = cplan.sdpa_mask
        if mask == "token_list":
            return sdpa(q, keys, values, T, scale, tokens=sel.slots)
        if mask == "dense_mask":
            return sdpa(q, keys, values, T, scale, mask=sel.mask)
        return sdpa(q, keys, values, T, scale, mask="causal" if mask == "causal" else None)
    if first == "flash":
        slots, slot_valid = row_token_slots(sel.ids, sel.valid, positions, ratio)
        return flash(q, keys, values, slots, slot_valid, scale)
    if first == "rows_gather":
        return rows_gather(q, keys, values, sel.slots, sel.slot_valid, scale)
    if first == "prefill_flash":
        return prefill_flash(q, keys, values, sel.ids, sel.valid, positions, ratio, scale)
    if first == "prefill_gather":
        return prefill_gather(q, keys, values, sel.ids, sel.valid, positions, ratio, scale)
    if first == "dense_mask":
        return dense_mask_attention(q, keys, values, sel.ids, sel.valid, positions, T, ratio, scale)
    raise ValueError(f"dispatch: unknown consumer {first!r}")
