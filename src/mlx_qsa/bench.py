"""`mlx-qsa bench decode|prefill`: one QSA layer timed beside its peers (PERFORMANCE.md §7).

Every number of one JSON comes from one process on one device. Decode times, per context and
row count, over >= 8 rotated buffer sets (so L2 does not hold the working set):
- `qsa_cuda` / `qsa_portable`: selection (score + exact top-512) + attention through the
  library's own routines (`indexer.select_rows`, `consumers.dispatch`) with the CUDA kernels
  or the portable MLX code;
- `qsa_cuda_layer` / `qsa_portable_layer`: the whole layer call (projections included), and
  `_layer_async` queued as an engine's decode loop runs it;
- `mlx_gather_sdpa`: MLX's `take` of the selected rows + `mx.fast.scaled_dot_product_attention`
  (attention only, given the selection);
- `mlx_dense_sdpa`: MLX's SDPA over the whole context; `torch_dense_sdpa`: torch's SDPA (flash
  backend where it runs) over the whole context;
- MLX entries end each step in `mx.eval` (a host round trip per step), `_async` ones queue the
  steps (`mx.async_eval`, one synchronisation per pass); `torch_dense_sdpa` is queued (CUDA
  events around the pass) and `torch_dense_sdpa_sync` synchronises after every step. `ratios`
  pairs like with like as well as every entry against the synchronised CUDA step;
- the bandwidth floor: the bytes a step must move (block keys, the union of the rows' selected
  K/V, queries, outputs) over the device copy bandwidth measured in the same run.
Each configuration is checked before it is timed: CUDA and portable selections bit-identical,
outputs against a float64 reference over the same tokens.

`--tp N` runs the layer sharded over `mx.distributed` (any backend; rank 0 reports): outputs are
checked against the unsharded layer on every rank, and the `all_sum` of the output is timed alone.
`--tp 1,2,4` starts each size's ranks itself and reports the scaling (`bench_tp`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from . import plan
from .cache import QSACache
from .config import QSAConfig, QSAOptions
from .consumers import dispatch
from .indexer import (
    Selection,
    block_penalty,
    cuda_selector_supports,
    select_row_tokens,
    select_rows,
)
from .kernels import _launch
from .kernels import selector as selector_kernel
from .layer import QSAAttention
from .rope import text_positions, text_rope
from .sweep import _arg, _non_negative_seconds, backend_name, environment
from .turns import take_turns

DEFAULT_CONTEXTS = (8192, 32768, 131072, 262144)
DEFAULT_ROWS = (1, 2, 4, 8)
PREFILL_CONTEXTS = (8192, 32768, 131072)
PROMPT_LENGTHS = (8192, 32768)
REL_TOL = 1e-2  # bf16 outputs against the float64 reference


# ---- timing ---------------------------------------------------------------------------------


def summary(samples_us: list[float]) -> dict[str, Any]:
    return {
        "median_us": statistics.median(samples_us),
        "min_us": min(samples_us),
        "max_us": max(samples_us),
        "samples_us": samples_us,
    }


def mlx_pass(
    step: Callable[[int], Any], n_sets: int, sync_each: bool = True, spin: bool = False
) -> Callable[[], float]:
    """One sample of an MLX entry: a pass over the sets, µs per step.

    `sync_each`: each step ends in `mx.eval` (host round trip included); otherwise steps are
    queued with `mx.async_eval` and the pass ends in one `mx.synchronize`. `spin`: each step
    ends in `mx.async_eval` and `mx.synchronize` instead of `mx.eval`, where `mx.eval` sleeps on a
    blocking event (MLX 0.32's `event.cu`; the wake-up took 40-420 µs on the lent hosts). MLX's
    CUDA synchronize spins in `cudaStreamSynchronize` but then waits for a completion handler
    that its worker thread runs (`device.cpp`), so it does not skip the wake-up: 33 µs less than
    `mx.eval` at 128K decode, still ~115 µs after the last kernel (H100,
    benchmarks/results/spin_2026-12-07)."""

    def one_pass() -> float:
        mx.synchronize()  # nothing of the previous entry runs into this one
        t0 = time.perf_counter()
        for i in range(n_sets):
            out = step(i)
            if spin:
                mx.async_eval(out)
                mx.synchronize()
            else:
                mx.eval(out) if sync_each else mx.async_eval(out)
        mx.synchronize()
        return (time.perf_counter() - t0) / n_sets * 1e6

    return one_pass


def mlx_gpu_pass(
    step: Callable[[int], Any], n_sets: int, stamp: Callable[[mx.array], mx.array] | None = None
) -> Callable[[], float]:
    """One sample of an MLX entry on the GPU's clock, µs per step: the steps queued as
    `mlx_pass(sync_each=False)` queues them, between two GPU timer stamps (`kernels.stamp`), as
    `torch_pass` times torch's queued pass between CUDA events. Step 0's graph is built before
    the first stamp, as torch's first launch follows its first event at once. A host clock would
    also count that build and the wake-up of MLX's blocking wait at the end (40-420 µs on the
    lent hosts: benchmarks/timeline.py). `stamp` stands in for the kernel in tests."""
    if stamp is None:
        from .kernels.stamp import gpu_stamp as stamp
    anchor = mx.zeros((1,), mx.uint32)
    mx.eval(anchor)

    def one_pass() -> float:
        mx.synchronize()  # nothing of the previous entry runs into this one
        out = step(0)
        first = stamp(anchor)
        mx.async_eval(first)
        mx.async_eval(out)
        for i in range(1, n_sets):
            out = step(i)
            mx.async_eval(out)
        last = stamp(out if isinstance(out, mx.array) else out[0])
        mx.eval(first, last)
        return (int(last.item()) - int(first.item())) / 1e3 / n_sets

    return one_pass


def one_kernel_pass(
    n_sets: int, stamp: Callable[[mx.array], mx.array] | None = None
) -> Callable[[], float]:
    """MLX's floor for a queued step, on the GPU's clock as `mlx_gpu_pass` times ours: a step of
    one trivial `cuda_kernel` launch (the timer stamp, one thread's store) on its own input. No
    MLX step that launches a kernel is issued faster on this host, so torch's events ÷ this
    entry bound the ratio any MLX decode step can reach against torch in the same run."""
    if stamp is None:
        from .kernels.stamp import gpu_stamp as stamp
    inputs = [mx.full((1,), i, mx.uint32) for i in range(n_sets)]
    mx.eval(inputs)
    return mlx_gpu_pass(lambda i: stamp(inputs[i]), n_sets, stamp=stamp)


def set_switch(name: str, value: str | None) -> None:
    """Set (None: unset) an ``MLX_QSA_*`` switch for the steps that follow (its cached read is
    cleared), for A/B timing of two forms in one process."""
    from .kernels._launch import env_switch

    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    env_switch.cache_clear()


def switched_passes(
    step: Callable[[int], Any],
    n_sets: int,
    name: str,
    modes: dict[str, str | None],
    queued: bool = False,
) -> dict[str, Callable[[], float]]:
    """`mlx_pass` of `step` in each mode (switch `name` set to its value inside the pass, so the
    modes can take turns), keyed by mode; with `queued` also each mode's queued pass
    (`<mode>_queued`)."""
    passes = {}
    for mode, value in modes.items():
        for sync in (True, False) if queued else (True,):
            one = mlx_pass(step, n_sets, sync_each=sync)

            def timed(one=one, value=value) -> float:
                set_switch(name, value)
                return one()

            passes[mode if sync else f"{mode}_queued"] = timed
    return passes


def torch_pass(
    step: Callable[[int], Any],
    n_sets: int,
    sync_each: bool = False,
    around: Callable[[], AbstractContextManager] | None = None,
) -> Callable[[], float]:
    """One sample of a torch entry, µs per step: CUDA events around the queued pass, or
    (`sync_each`) wall clock with `torch.cuda.synchronize()` after every step, as `mlx_pass`
    times one `mx.eval` per step. `around()` is a context entered for the pass, untimed."""
    import torch

    def one_pass() -> float:
        with around() if around is not None else contextlib.nullcontext():
            return timed_pass()

    def timed_pass() -> float:
        torch.cuda.synchronize()
        if sync_each:
            t0 = time.perf_counter()
            for i in range(n_sets):
                step(i)
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n_sets * 1e6
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for i in range(n_sets):
            step(i)
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) * 1e3 / n_sets

    return one_pass


def time_in_turns(
    passes: dict[str, Callable[[], float]], warmup: int, repeats: int, settle_s: float = 0.0
) -> dict[str, dict[str, Any]]:
    """Median over `repeats` samples of every entry, the entries taking turns sample by sample
    (`turns.take_turns`: the lent GPUs' power cap makes phase-by-phase ratios depend on the
    order) after `warmup` untimed passes of each and `settle_s` seconds of untimed rounds."""
    samples = take_turns(passes, repeats, warm_rounds=warmup, settle_s=settle_s)
    return {name: summary(v) for name, v in samples.items()}


def loaded_blas() -> list[str]:
    """The BLAS libraries this process has mapped (Linux: /proc/self/maps), e.g. the netlib
    reference BLAS that MLX's Linux CPU wheel bundles or an OpenBLAS preloaded in its place:
    MLX's float32 CPU matmuls ran ~30x apart between those two here
    (benchmarks/results/cpu_2026-12-07c). Empty where the maps cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {f[5] for ln in lines if len(f := ln.split(maxsplit=5)) == 6}  # f[5]: the path
    return sorted(p for p in paths if "blas" in os.path.basename(p).lower())


def host_calibration(repeats: int = 5, steps: int = 100) -> dict[str, float]:
    """µs per step of trivial work with a host round trip each, medians: MLX's `mx.eval` of one
    small op, and on CUDA torch's one small op + `torch.cuda.synchronize()`, in turns.

    Lent machines with the same GPU have hosts that run MLX's host-bound work up to 2× apart
    (BENCHMARKS.md, twelfth session); a run's host-bound figures compare with another run's only
    beside these."""
    x = mx.zeros((256,), mx.float32)
    mx.eval(x)
    passes = {"mlx_eval_one_op_us": mlx_pass(lambda i: x + 1, steps)}
    torch = _torch_cuda()
    if torch is not None:
        t = torch.zeros(256, device="cuda")
        passes["torch_one_op_sync_us"] = torch_pass(lambda i: t + 1, steps, sync_each=True)
    return {k: v["median_us"] for k, v in time_in_turns(passes, 1, repeats).items()}


def timing_doc(args: argparse.Namespace) -> dict[str, Any]:
    """How a point's entries were timed, for the JSON."""
    return {
        "order": "in turns: every entry's pass over the sets, then the next entry's, round by "
        "round (turns.take_turns)",
        "warmup_passes": args.warmup,
        "settle_s": args.settle,
        "samples": args.repeats,
        "sample": "one pass over the rotated sets, time / steps; the median is reported",
    }


def time_mlx(
    step: Callable[[int], Any], n_sets: int, warmup: int, repeats: int, sync_each: bool = True
) -> dict[str, Any]:
    """One MLX entry alone (`mlx_pass`): median over `repeats` passes after `warmup`."""
    return time_in_turns({"": mlx_pass(step, n_sets, sync_each)}, warmup, repeats)[""]


def release_device_memory() -> None:
    """Hand the memory of a finished point back: MLX's buffer cache and torch's caching
    allocator each keep freed blocks, and together they left too little for the next
    allocation (`copy_bandwidth` ran out of memory after the 128K prefill point, H100)."""
    import gc

    gc.collect()
    mx.clear_cache()
    torch = _torch_cuda()
    if torch is not None:
        torch.cuda.empty_cache()


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """Device-to-device copy bandwidth (read + write bytes / time) of MLX, and torch's on CUDA."""
    n = nbytes // 2
    a = mx.zeros((n,), mx.bfloat16) + 1
    mx.eval(a)
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        mx.eval(a + 1)
        mx.synchronize()
        samples.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"bytes": 2 * n * 2, "mlx_gbps": 2 * n * 2 / min(samples[1:]) / 1e9}
    del a
    torch = _torch_cuda()
    if torch is not None:
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(repeats):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            y.copy_(x)
            t1.record()
            torch.cuda.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        out["torch_gbps"] = 2 * n * 2 / best / 1e9
        del x, y
    out["gbps"] = max(v for k, v in out.items() if k.endswith("_gbps"))
    return out


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ---- decode inputs ----------------------------------------------------------------------------


class DecodeSet:
    """One rotated buffer set: K/V backings, block keys, the rows' queries at context T."""

    def __init__(self, cfg: QSAConfig, T: int, rows: int, seed: int) -> None:
        H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H_I, d_I, r = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
        key = mx.random.key(seed)
        k1, k2, k3, k4, k5 = mx.random.split(key, 5)
        cap = plan.roundup256(T)
        bf = mx.bfloat16
        self.T, self.rows = T, rows
        self.keys = mx.random.normal((1, Hkv, cap, d), key=k1).astype(bf)
        self.values = mx.random.normal((1, Hkv, cap, d), key=k2).astype(bf)
        self.pooled = mx.random.normal((1, max(1, cap // r), d_I), key=k3).astype(bf)
        self.q = mx.random.normal((1, H, rows, d), key=k4).astype(bf)
        self.index_q = mx.random.normal((1, H_I, rows, d_I), key=k5).astype(bf)
        self.positions = text_positions(T - rows, T)  # as the layer makes them
        mx.eval(self.keys, self.values, self.pooled, self.q, self.index_q, self.positions)


def qsa_step(cfg: QSAConfig, s: DecodeSet, impl: str) -> tuple[mx.array, Selection]:
    """Selection + attention of the rows, as the layer runs them (RUNTIME.md §5–§8): the
    options, capabilities and consumer plan are the layer's (held, not remade per step). On
    CUDA the selector runs as a compiled function (`_cuda_selection`), as the layer's compiled
    core runs it, and the attention through `consumers.decode_launch`."""
    r, K = cfg.indexer_compress_ratio, cfg.block_topk
    if impl == "cuda" and cuda_selector_supports(s.index_q, s.pooled):
        # the selector's switches are part of the key: a trace keeps the form it was made with
        switches = (selector_kernel.select_one_launch_env(), selector_kernel.split_heads_env(),
                    _launch.one_launch_env())  # fmt: skip
        run = _cuda_selection(r, K, s.rows, switches)
        out = run(s.index_q, s.pooled, s.positions, _launch.counter_slot())
    else:
        keys_t = s.pooled[0].astype(mx.float32).T
        out = step_selector(s.rows)(
            s.index_q, keys_t, block_penalty(keys_t.shape[1]), s.positions, r, K, s.rows,
            s.pooled, impl,
        )  # fmt: skip
    sel = step_selection(cfg, s, out)
    return step_attention(cfg, s, sel, impl), sel


def step_selector(rows: int) -> Callable[..., tuple[mx.array, ...]]:
    """The layer's selection routine for a decode step of `rows` rows: `blocks` for one row,
    `row_tokens` for verify rows (the CUDA selector writes the slots itself)."""
    return select_rows if rows == 1 else select_row_tokens


def step_selection(cfg: QSAConfig, s: DecodeSet, out: tuple) -> Selection:
    """`step_selector`'s outputs for `s`'s rows as the step's `Selection`."""
    if s.rows == 1:
        r = cfg.indexer_compress_ratio
        ids, valid, scores = out
        return Selection("blocks", ids=ids, valid=valid, scores=scores, tail_start=s.T // r * r)
    return Selection("row_tokens", slots=out[0], slot_valid=out[1])


def step_attention(cfg: QSAConfig, s: DecodeSet, sel: Selection, impl: str) -> mx.array:
    """The attention of `s`'s rows over `sel`, through the library defaults' consumer plan."""
    r, K = cfg.indexer_compress_ratio, cfg.block_topk
    cplan = _consumer_plan(plan.CallShape(s.rows, s.T - s.rows, r, K), sel.kind)
    return dispatch(cplan, s.q, s.keys, s.values, sel, s.positions, s.T, r, cfg.scale, impl)


@functools.lru_cache(maxsize=64)
def _cuda_selection(ratio: int, k: int, rows: int, switches: tuple) -> Callable[..., Any]:
    """The CUDA selector of `qsa_step` as an `mx.compile`d function of (index_q, pooled,
    positions, counter slot): the slot is an input, fresh each step, as in the layer's core.
    `switches`: the selector's MLX_QSA_* switches when it traces (only a key)."""
    select = step_selector(rows)

    def run(index_q: mx.array, pooled: mx.array, positions: mx.array, ctr: mx.array):
        return select(index_q, None, None, positions, ratio, k, rows, pooled, "cuda", ctr=ctr)

    return mx.compile(run)


@functools.lru_cache(maxsize=256)
def _consumer_plan(call: plan.CallShape, kind: str) -> plan.ConsumerPlan:
    """The library defaults' consumer plan (pure: made once per call shape, as a layer would
    keep its options and capabilities)."""
    return plan.plan_consumers(
        QSAOptions(), plan.Capabilities.portable(), call, kind, has_indexer=True
    )


def primitive_counts(*arrays: mx.array) -> dict[str, Any]:
    """MLX primitives still to run for `arrays` (their unevaluated graph), by kind: each one
    costs host time on every step (PERFORMANCE.md §4, §7.5)."""
    import collections
    import io
    import re

    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    kinds = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))
    return {"total": sum(kinds.values()), "by_kind": dict(kinds.most_common())}


def token_lists(sel: Selection, positions: np.ndarray, ratio: int) -> list[np.ndarray]:
    """Per row, the token positions the selection attends (blocks' tokens, then the tail)."""
    if sel.kind == "row_tokens":  # the slots are already that list, with their validity
        slots, ok = np.array(sel.slots), np.array(sel.slot_valid)
        return [slots[i][ok[i]] for i in range(len(positions))]
    ids, valid = np.array(sel.ids), np.array(sel.valid)
    out = []
    for i, p in enumerate(positions):
        b = ids[i][valid[i]]
        tail = np.arange(ratio * ((p + 1) // ratio), p + 1)
        out.append(np.concatenate([(ratio * b[:, None] + np.arange(ratio)).ravel(), tail]))
    return out


def reference_attention(s: DecodeSet, tokens: list[np.ndarray], scale: float) -> np.ndarray:
    """Float64 attention of each row over its tokens: `[H, S, d]`."""
    q = np.array(s.q[0].astype(mx.float32), np.float64)  # [H, S, d]
    H, S, d = q.shape
    Hkv = s.keys.shape[1]
    G = H // Hkv
    out = np.zeros((H, S, d))
    for i, tok in enumerate(tokens):
        t = mx.array(tok.astype(np.int32))
        k = np.array(mx.take(s.keys, t, axis=2)[0].astype(mx.float32), np.float64)
        v = np.array(mx.take(s.values, t, axis=2)[0].astype(mx.float32), np.float64)
        for h in range(H):
            a = scale * (k[h // G] @ q[h, i])
            p = np.exp(a - a.max())
            out[h, i] = (p / p.sum()) @ v[h // G]
    return out


def rel_err(a: mx.array, ref: np.ndarray) -> float:
    x = np.array(a.astype(mx.float32), np.float64).reshape(ref.shape)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def gather_inputs(tokens: list[np.ndarray]) -> tuple[mx.array, mx.array]:
    """Token ids `[S, W]` (padded with 0) and their keep-mask `[S, 1, 1, W]`."""
    W = max(len(t) for t in tokens)
    ids = np.zeros((len(tokens), W), np.int32)
    keep = np.zeros((len(tokens), W), bool)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = t
        keep[i, : len(t)] = True
    return mx.array(ids), mx.array(keep)[:, None, None, :]


def mlx_gather_sdpa(s: DecodeSet, ids: mx.array, keep: mx.array, scale: float) -> mx.array:
    """MLX built-ins: take the selected rows, then SDPA per row (rows as the batch)."""
    S, W = ids.shape
    Hkv, d = s.keys.shape[1], s.keys.shape[3]
    # from the 4-D backing: a gather from the view `keys[0]` would copy the whole cache first
    k = mx.take(s.keys, ids.reshape(-1), axis=2).reshape(Hkv, S, W, d).transpose(1, 0, 2, 3)
    v = mx.take(s.values, ids.reshape(-1), axis=2).reshape(Hkv, S, W, d).transpose(1, 0, 2, 3)
    q = s.q[0].transpose(1, 0, 2)[:, :, None, :]  # [S, H, 1, d]
    mask = None if bool(keep.all()) else keep
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def mlx_dense_sdpa(s: DecodeSet, scale: float) -> mx.array:
    k, v = s.keys[:, :, : s.T], s.values[:, :, : s.T]
    mask = None if s.rows == 1 else "causal"  # MLX aligns the causal mask to the last key
    return mx.fast.scaled_dot_product_attention(s.q, k, v, scale=scale, mask=mask)


def step_bytes(cfg: QSAConfig, s: DecodeSet, tokens: list[np.ndarray]) -> int:
    """Minimum bytes of one step: block keys, union of selected K/V, queries in, output out."""
    nb = s.T // cfg.indexer_compress_ratio
    union = len(np.unique(np.concatenate(tokens)))
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    H_I, d_I = cfg.indexer_n_heads, cfg.indexer_head_dim
    return 2 * (nb * d_I + union * Hkv * d * 2 + s.rows * (H_I * d_I + 2 * H * d))


# ---- torch peer -------------------------------------------------------------------------------


class TorchDense:
    """torch's dense SDPA over the whole context, GQA without expanding K/V where possible."""

    def __init__(self, cfg: QSAConfig, T: int, rows: int, n_sets: int, seed: int) -> None:
        import torch

        self.torch = torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bf = torch.bfloat16

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(bf)

        self.sets = [
            (rnd(1, H, rows, d), rnd(1, Hkv, T, d), rnd(1, Hkv, T, d)) for _ in range(n_sets)
        ]
        self.scale = cfg.scale
        self.backend, self.note = self._pick_backend()

    def _call(self, i: int, backend) -> Any:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([backend]):
            return self.step(i)

    def _pick_backend(self) -> tuple[Any, str]:
        from torch.nn.attention import SDPBackend

        errors = []
        for b in (
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        ):
            try:
                self._call(0, b)
                self.torch.cuda.synchronize()
                return b, "; ".join(errors)
            except Exception as e:  # noqa: BLE001 - a backend that does not take the shape
                errors.append(f"{b.name}: {str(e).splitlines()[0][:120]}")
        raise RuntimeError("torch SDPA: no backend ran: " + "; ".join(errors))

    def pinned(self) -> Any:
        """A context in which `step` runs on the picked backend: entered once per pass, as an
        engine would, not once per step (its flag updates were host time in every step)."""
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel([self.backend])

    def step(self, i: int) -> Any:
        """One step; inside `pinned()`."""
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        q, k, v = self.sets[i]
        return sdpa(q, k, v, scale=self.scale, enable_gqa=True)


# ---- decode bench -------------------------------------------------------------------------------


def random_cache(layer: QSAAttention, T: int, rows: int, seed: int) -> QSACache:
    """A cache at offset T - rows with random states of its own (timing only; a cache that
    shared its backings with other arrays would be copied, not updated in place, on append).

    A sharded layer's cache holds its KV heads of the same random backings."""
    cfg = layer.config
    layout = layer.shard_layout
    full_kv = getattr(layer, "full_config", cfg).num_key_value_heads
    heads = list(layout.kv_heads) if layout is not None else list(range(full_kv))
    r, d_I, d = cfg.indexer_compress_ratio, cfg.indexer_head_dim, cfg.head_dim
    cap = plan.roundup256(T)
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    bf = mx.bfloat16
    c = layer.make_cache()
    kv = mx.array(heads, dtype=mx.int32)
    c.keys = mx.take(mx.random.normal((1, full_kv, cap, d), key=k1).astype(bf), kv, axis=1)
    c.values = mx.take(mx.random.normal((1, full_kv, cap, d), key=k2).astype(bf), kv, axis=1)
    c.raw_keys = mx.random.normal((1, cap, d_I), key=k3).astype(bf)
    c.pooled = mx.random.normal((1, max(1, cap // r), d_I), key=k4).astype(bf)
    P = T - rows
    c.offset, c.pooled_len = P, P // r
    mx.eval(c.keys, c.values, c.raw_keys, c.pooled)
    return c


def layer_rows(cfg: QSAConfig, rows: int, seed: int) -> mx.array:
    x = mx.random.normal((1, rows, cfg.hidden_size), key=mx.random.key(seed))
    return (x * 0.5).astype(mx.bfloat16)


def decode_layer_step(
    layer: QSAAttention, xs: list[mx.array], caches: list[QSACache], rows: int
) -> Callable[[int], mx.array]:
    """One timed decode step of `layer` on rotated set i: its rows `xs[i]` at context T, then
    `caches[i]` trimmed back to T - rows, so every step sees context T."""

    def step(i: int) -> mx.array:
        # Every timed step makes its own RoPE tables, as a model's first QSA layer at a new
        # position does (the later layers of that step reuse them).
        text_rope.cache_clear()
        y = layer(xs[i], cache=caches[i])
        caches[i].trim(rows)
        return y

    return step


def bench_decode_point(
    cfg: QSAConfig, T: int, rows: int, args: argparse.Namespace, impls: tuple[str, ...],
    layers: dict[str, QSAAttention], bandwidth_gbps: float,
) -> dict[str, Any]:  # fmt: skip
    n, warm, reps = args.sets, args.warmup, args.repeats
    sets = [DecodeSet(cfg, T, rows, seed=1000 * T + 10 * rows + i) for i in range(n)]
    rec: dict[str, Any] = {"context": T, "rows": rows, "sets": n, "timings": {}, "checks": {}}
    scale = cfg.scale
    # correctness first (set 0): selections, outputs against float64 over the same tokens
    outs = {impl: qsa_step(cfg, sets[0], impl) for impl in impls}
    # counted before anything runs (then the graph is gone)
    rec["primitives"] = {f"qsa_{impl}": primitive_counts(o) for impl, (o, _) in outs.items()}
    base_sel = outs["portable"][1]
    pos = np.array(sets[0].positions)
    tokens = token_lists(base_sel, pos, cfg.indexer_compress_ratio)
    ref = reference_attention(sets[0], tokens, scale)
    fields = ("slots", "slot_valid") if base_sel.kind == "row_tokens" else ("ids", "valid")
    for impl, (o, sel) in outs.items():
        same = all(
            np.array_equal(np.array(getattr(sel, f)), np.array(getattr(base_sel, f)))
            for f in fields
        )
        rec["checks"][f"qsa_{impl}"] = {"rel_err": rel_err(o[0], ref), "selection_equal": same}
    ids, keep = gather_inputs(tokens)
    g = mlx_gather_sdpa(sets[0], ids, keep, scale)
    rec["checks"]["mlx_gather_sdpa"] = {"rel_err": rel_err(g.transpose(1, 0, 2, 3)[:, :, 0], ref)}
    floor_bytes = step_bytes(cfg, sets[0], tokens)
    rec["floor"] = {"bytes": floor_bytes, "us": floor_bytes / (bandwidth_gbps * 1e3)}

    gathers = []
    for s in sets:
        sel = qsa_step(cfg, s, "portable")[1]
        gathers.append(gather_inputs(token_lists(sel, np.array(s.positions), 4)))
    # Every entry below takes turns with the others, pass by pass (`time_in_turns`).
    passes: dict[str, Callable[[], float]] = {}
    for impl in impls:

        def step(i: int, impl=impl) -> mx.array:
            return qsa_step(cfg, sets[i], impl)[0]

        passes[f"qsa_{impl}"] = mlx_pass(step, n)
        passes[f"qsa_{impl}_async"] = mlx_pass(step, n, sync_each=False)
        if impl == "cuda":  # queued, on the GPU's clock (torch's events' counterpart)
            passes[f"qsa_{impl}_gpu"] = mlx_gpu_pass(step, n)
            # a step at a time, waited for by mx.synchronize, as torch's sync entry
            passes[f"qsa_{impl}_spin"] = mlx_pass(step, n, spin=True)

    def gather_step(i: int) -> mx.array:
        return mlx_gather_sdpa(sets[i], *gathers[i], scale)

    passes["mlx_gather_sdpa"] = mlx_pass(gather_step, n)
    passes["mlx_gather_sdpa_async"] = mlx_pass(gather_step, n, sync_each=False)
    passes["mlx_dense_sdpa"] = mlx_pass(lambda i: mlx_dense_sdpa(sets[i], scale), n)
    if "cuda" in impls:
        passes["mlx_one_kernel_gpu"] = one_kernel_pass(n)
    consumers: dict[str, list[str]] = {}  # each layer's, from its counted step
    if layers:
        caches = [random_cache(next(iter(layers.values())), T, rows, seed=i) for i in range(n)]
        xs = [layer_rows(cfg, rows, seed=i) for i in range(n)]
        for impl, layer in layers.items():
            layer_step = decode_layer_step(layer, xs, caches, rows)
            # One step's graph, counted before it runs: the second call on this cache, as
            # every timed step is (the first call's graph also holds the lazy random input
            # rows and what a cache's first call builds for later steps).
            for counted in (False, True):
                text_rope.cache_clear()
                y = layer(xs[0], cache=caches[0])
                if counted:
                    rec["primitives"][f"qsa_{impl}_layer"] = primitive_counts(y, *caches[0].state)
                    consumers[impl] = list(layer.last_call.consumers)
                mx.eval(y, *caches[0].state)
                caches[0].trim(rows)
            passes[f"qsa_{impl}_layer"] = mlx_pass(layer_step, n)
            # Queued, as an engine runs its decode loop (mlx-lm: `mx.async_eval` of step N+1
            # while step N runs): host build and device work overlap.
            passes[f"qsa_{impl}_layer_async"] = mlx_pass(layer_step, n, sync_each=False)
    torch = _torch_cuda() if not args.no_torch else None
    peer = None
    if torch is not None:
        peer = TorchDense(cfg, T, rows, n, seed=T + rows)
        passes["torch_dense_sdpa"] = torch_pass(peer.step, n, around=peer.pinned)
        passes["torch_dense_sdpa_sync"] = torch_pass(
            peer.step, n, sync_each=True, around=peer.pinned
        )
    else:
        rec["skipped"] = {"torch_dense_sdpa": "torch with CUDA is not importable here"}
    t = rec["timings"]
    t.update(time_in_turns(passes, warm, reps, args.settle))
    for impl, names in consumers.items():
        t[f"qsa_{impl}_layer"]["consumers"] = names
    if peer is not None:
        t["torch_dense_sdpa"]["backend"] = peer.backend.name
        if peer.note:
            t["torch_dense_sdpa"]["note"] = peer.note
        if rows > 1:
            t["torch_dense_sdpa"]["mask"] = "none (the rows see the whole context)"
    return rec


def ratios(rec: dict[str, Any]) -> dict[str, float]:
    """Peer median / ours (> 1: ours faster), and ours over the floor. Besides every entry
    over ours with a host round trip per step, the queued peers over ours queued (torch's
    `torch_dense_sdpa` is queued: CUDA events around the steps), so each mode has a ratio of
    like against like; torch's events also against our GPU-clock entry (`mlx_gpu_pass`), torch's
    synchronized steps against ours waited for by `mx.synchronize` (`_spin`)."""
    t = rec["timings"]
    ours = "qsa_cuda" if "qsa_cuda" in t else "qsa_portable"
    m = t[ours]["median_us"]
    out = {f"{k}/{ours}": v["median_us"] / m for k, v in t.items() if k != ours}
    queued = f"{ours}_async"
    if queued in t:
        for k in ("torch_dense_sdpa", "mlx_gather_sdpa_async"):
            if k in t:
                out[f"{k}/{queued}"] = t[k]["median_us"] / t[queued]["median_us"]
    gpu = f"{ours}_gpu"  # queued on the GPU's clock: torch's events against our stamps
    if gpu in t and "torch_dense_sdpa" in t:
        out[f"torch_dense_sdpa/{gpu}"] = t["torch_dense_sdpa"]["median_us"] / t[gpu]["median_us"]
    if "mlx_one_kernel_gpu" in t and "torch_dense_sdpa" in t:  # the most any MLX step reaches
        out["torch_dense_sdpa/mlx_one_kernel_gpu"] = (
            t["torch_dense_sdpa"]["median_us"] / t["mlx_one_kernel_gpu"]["median_us"]
        )
    spin = f"{ours}_spin"  # a step at a time, both sides ending in their synchronize
    if spin in t and "torch_dense_sdpa_sync" in t:
        out[f"torch_dense_sdpa_sync/{spin}"] = (
            t["torch_dense_sdpa_sync"]["median_us"] / t[spin]["median_us"]
        )
    out[f"{ours}/floor"] = m / rec["floor"]["us"]
    return out


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    cfg = QSAConfig()
    backend = backend_name()
    impls = ("cuda", "portable") if backend == "cuda" and not args.portable_only else ("portable",)
    bw = copy_bandwidth(args.copy_bytes)
    layers: dict[str, QSAAttention] = {}
    if not args.no_layer:
        mx.random.seed(0)
        base = QSAAttention(cfg, fused=4)
        base.set_dtype(mx.bfloat16)
        for impl in impls:
            opts = QSAOptions(kernels="auto" if impl == "cuda" else "portable")
            lay = QSAAttention(cfg, options=opts, fused=4)
            lay.update(base.parameters())
            layers[impl] = lay
        mx.eval(base.parameters())
    points = []
    for T in args.contexts:
        for rows in args.rows:
            rec = bench_decode_point(cfg, T, rows, args, impls, layers, bw["gbps"])
            rec["ratios"] = ratios(rec)
            points.append(rec)
            _progress(rec)
    return {"bandwidth": bw, "points": points}


def _progress(rec: dict[str, Any]) -> None:
    t = rec["timings"]
    cols = " ".join(f"{k}={v['median_us']:.1f}" for k, v in t.items())
    print(
        f"T={rec['context']} rows={rec['rows']} floor={rec['floor']['us']:.2f}us {cols}", flush=True
    )


# ---- prefill bench ------------------------------------------------------------------------------


def _layer_bench_setup(args: argparse.Namespace) -> tuple[QSAConfig, tuple[str, ...], QSAAttention]:
    """The geometry, the implementations to time (CUDA and portable on CUDA, unless
    `--portable-only` or `--no-portable`) and the bf16 layer whose weights every timed layer
    takes."""
    cfg = QSAConfig()
    cuda = backend_name() == "cuda" and not args.portable_only
    impls = ("cuda", "portable") if cuda else ("portable",)
    if cuda and args.no_portable:
        impls = ("cuda",)
    mx.random.seed(0)
    base = QSAAttention(cfg, fused=4)
    base.set_dtype(mx.bfloat16)
    return cfg, impls, base


def _layer_like(base: QSAAttention, routing: QSAOptions, impl: str) -> QSAAttention:
    """A layer with `base`'s weights, `routing`'s options and the implementation `impl`."""
    opts = routing.replace(kernels="auto" if impl == "cuda" else "portable")
    lay = QSAAttention(base.config, options=opts, fused=4)
    lay.update(base.parameters())
    return lay


def run_prefill(args: argparse.Namespace) -> dict[str, Any]:
    """A 2048-row chunk after each prefix, whole layer (indexer, selection, attention, all
    projections), with torch's dense causal SDPA over the same context as the peer."""
    cfg, impls, base = _layer_bench_setup(args)
    S = args.chunk
    layer_options = prefill_layer_options(args.large_from)
    points = []
    for P in args.contexts:
        T = P + S
        rec: dict[str, Any] = {"prefix": P, "rows": S, "timings": {}}
        caches = [random_cache(base, T, S, seed=i) for i in range(args.sets)]
        xs = [layer_rows(cfg, S, seed=i) for i in range(args.sets)]
        sets = [DecodeSet(cfg, T, S, seed=7 * T + i) for i in range(args.sets)]
        work = prefill_flops(cfg, P, S)
        rec["flops"] = work
        rec["attention_kv_bytes"] = prefill_kv_bytes(cfg, P, S)
        outs = {}
        passes: dict[str, Callable[[], float]] = {}  # taken in turns (`time_in_turns`)
        consumers, selectors = {}, {}
        for impl in impls:
            comp, consumers[f"qsa_{impl}_attention"], outs[impl] = prefill_components(
                cfg, sets, impl, layer_options[-1][1]
            )
            passes.update({f"qsa_{impl}_{k}": v for k, v in comp.items()})
            for suffix, routing in layer_options:
                name = f"qsa_{impl}_layer{suffix}"
                lay = _layer_like(base, routing, impl)

                def step(i: int, lay=lay, xs=xs, caches=caches) -> mx.array:
                    y = lay(xs[i], cache=caches[i])
                    caches[i].trim(S)
                    return y

                mx.eval(step(0))
                consumers[name] = list(lay.last_call.consumers)
                selectors[name] = lay.last_call.selector
                passes[name] = mlx_pass(step, args.sets)
                if impl == "cuda":
                    passes[f"{name}_gpu"] = mlx_gpu_pass(step, args.sets)
        if len(layer_options) > 1:
            rec["large_from"] = layer_options[-1][1].effective_prefill_min_context
        if "cuda" in outs and "portable" in outs:
            rec["checks"] = prefill_checks(outs["cuda"], outs["portable"])
        del outs
        if _torch_causal_peer(passes, rec, cfg, T, S, args):
            rec["flops"]["dense_causal_attention"] = (
                4 * cfg.num_attention_heads * cfg.head_dim * (S * P + S * (S + 1) // 2)
            )
        t = rec["timings"]
        t.update(time_in_turns(passes, args.warmup, args.repeats, args.settle))
        for name, names in consumers.items():
            t[name]["consumers"] = names
        for name, selector in selectors.items():
            t[name]["selector"] = selector
        _note_torch_causal(t, "K/V expanded to 24 heads; lower-right causal mask")
        del sets, passes, caches, xs
        release_device_memory()
        points.append(rec)
        _progress_prefill(rec)
    body: dict[str, Any] = {"matmul_ceiling": matmul_ceiling(args.ceiling_n), "points": points}
    if backend_name() == "cuda":  # the attention's bytes against what a plain copy moves
        body["copy_bandwidth"] = copy_bandwidth(args.copy_bytes)
    return body


def prefill_layer_options(large_from: int | None) -> list[tuple[str, QSAOptions]]:
    """The routing options the prefill bench times the layer with (pure): the library defaults
    (entry suffix ""), and with `large_from` also those with the large-prefill lane and the
    `prefill_flash` consumer from context `large_from` on (`prefill_min_context` = `flash_min`
    = `large_from`; suffix "_large"). Below 32K the defaults send a chunk to the keep-mask
    `sdpa` consumer, with its selection made by the eager oracle path (RUNTIME.md §5.5); both
    options must move, or the chunk takes the `prefill_gather` tier. The chunk's own selection
    and attention entries follow the last of these."""
    out = [("", QSAOptions())]
    if large_from is not None:
        out.append(("_large", QSAOptions(prefill_min_context=large_from, flash_min=large_from)))
    return out


def prompt_chunks(n: int, chunk: int) -> list[int]:
    """The widths of an n-token prompt fed `chunk` rows at a time, the last one shorter (pure)."""
    if n < 1 or chunk < 1:
        raise ValueError(f"prompt_chunks: n and chunk must be >= 1, got {n}, {chunk}")
    return [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])


def run_prompt(args: argparse.Namespace) -> dict[str, Any]:
    """Whole prompts through one layer: each prompt of `args.contexts` tokens fed in
    `args.chunk`-row chunks from an empty cache, as an engine prefills it (time to the last
    chunk's output, cache growth included). The layer runs with the library defaults and, with
    `--large-from`, with the large-prefill lane from that context (`prefill_layer_options`).
    The peer is torch's dense causal SDPA over the whole prompt in one call: attention only,
    which is its best case (no chunks, no projections)."""
    cfg, impls, base = _layer_bench_setup(args)
    layer_options = prefill_layer_options(args.large_from)
    points = []
    for n in args.contexts:
        widths = prompt_chunks(n, args.chunk)
        rec: dict[str, Any] = {"prompt": n, "chunks": widths, "timings": {}}
        xs = [layer_rows(cfg, n, seed=i) for i in range(args.sets)]
        passes: dict[str, Callable[[], float]] = {}
        routes: dict[str, list[list[str]]] = {}
        last: dict[str, mx.array] = {}
        for impl in impls:
            for suffix, routing in layer_options:
                name = f"qsa_{impl}_prompt{suffix}"
                lay = _layer_like(base, routing, impl)

                def step(i: int, lay=lay, xs=xs, widths=widths, log=None) -> list[mx.array]:
                    # The chunks' graphs, built in order and evaluated together by the pass:
                    # an evaluation per chunk would run step 0 of a GPU-clock pass before its
                    # first stamp (`mlx_gpu_pass`).
                    cache, r0, y = lay.make_cache(), 0, None
                    for w in widths:
                        y = lay(xs[i][:, r0 : r0 + w], cache=cache)
                        if log is not None:
                            c = lay.last_call
                            log.append([c.selector, *c.consumers])
                        r0 += w
                    return [y, *cache.state]

                routes[name] = []
                last[name] = step(0, log=routes[name])[0]
                mx.eval(last[name])
                passes[name] = mlx_pass(step, args.sets)
                if impl == "cuda":
                    passes[f"{name}_gpu"] = mlx_gpu_pass(step, args.sets)
        ref = last[f"qsa_{impls[-1]}_prompt"].astype(mx.float32)
        rec["checks"] = {
            name: {
                "last_chunk_rel_diff": (
                    mx.linalg.norm((y.astype(mx.float32) - ref).flatten())
                    / mx.linalg.norm(ref.flatten())
                ).item()
            }
            for name, y in last.items()
        }
        _torch_causal_peer(passes, rec, cfg, n, n, args)
        t = rec["timings"]
        t.update(time_in_turns(passes, args.warmup, args.repeats, args.settle))
        for name, names in routes.items():
            t[name]["routes"] = names
        _note_torch_causal(t, "the whole prompt in one call; K/V expanded to 24 heads")
        del xs, passes, last
        release_device_memory()
        points.append(rec)
        cols = " ".join(f"{k}={v['median_us'] / 1e3:.2f}ms" for k, v in t.items())
        print(f"prompt={n} chunks={len(widths)} {cols} checks={rec['checks']}", flush=True)
    return {"points": points}


def _prefill_counts(cfg: QSAConfig, P: int, S: int) -> tuple[int, int]:
    """(visible blocks, attended tokens) summed over the chunk's rows."""
    r, K = cfg.indexer_compress_ratio, cfg.block_topk
    nb = [(p + 1) // r for p in range(P, P + S)]
    tokens = [min(b, K) * r + (p + 1) % r for b, p in zip(nb, range(P, P + S), strict=True)]
    return sum(nb), sum(tokens)


def prefill_flops(cfg: QSAConfig, P: int, S: int) -> dict[str, int]:
    """Useful FLOPs of one chunk: indexer scoring (every visible block, every head), sparse
    attention (QK and PV over each row's selected tokens)."""
    blocks, tokens = _prefill_counts(cfg, P, S)
    H_I, d_I = cfg.indexer_n_heads, cfg.indexer_head_dim
    H, d = cfg.num_attention_heads, cfg.head_dim
    return {"indexer": 2 * H_I * d_I * blocks, "sparse_attention": 4 * H * d * tokens}


def prefill_kv_bytes(cfg: QSAConfig, P: int, S: int) -> int:
    """K and V bytes the chunk's sparse attention reads: every row's selected tokens, every KV
    head, bf16 (rows share no tokens in the worst case; L2 serves what they do share)."""
    return _prefill_counts(cfg, P, S)[1] * cfg.num_key_value_heads * cfg.head_dim * 2 * 2


def prefill_steps(
    cfg: QSAConfig, sets: list[DecodeSet], impl: str, routing: QSAOptions | None = None
) -> tuple[dict[str, Callable[[int], mx.array]], list[str], tuple[Selection, mx.array]]:
    """Selection (scoring + exact top-k, RUNTIME §6.3 chunks) and attention (the prefill
    consumer that `routing`, by default the library defaults, picks for prefill blocks) of the
    chunk's rows on set i, apart and together (`selection`, `attention` on selections made
    beforehand, `selection_attention`); the attention's consumers; set 0's selection and output
    (for the CUDA-against-portable checks)."""
    r, K = cfg.indexer_compress_ratio, cfg.block_topk
    caps = plan.Capabilities.reference()
    S, P = sets[0].rows, sets[0].T - sets[0].rows
    call = plan.CallShape(S, P, r, K)
    producer = plan.prefill_score_producer(caps, "bfloat16", "bfloat16")

    def select(s: DecodeSet) -> Selection:
        keys_t = s.pooled[0].astype(mx.float32).T
        chunk = plan.selector_chunk_rows("prefill_blocks", S, keys_t.shape[1], producer=producer)
        ids, valid, scores = select_rows(
            s.index_q, keys_t, block_penalty(keys_t.shape[1]), s.positions, r, K, chunk,
            s.pooled, impl,
        )  # fmt: skip
        return Selection("prefill_blocks", ids=ids, valid=valid, scores=scores)

    contract = plan.prefill_flash_contract(
        n_heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        block_topk=K,
        dtype="bfloat16",
        scale=cfg.scale,
    )
    cplan = plan.plan_consumers(
        routing or QSAOptions(), caps, call, "prefill_blocks", has_indexer=True,
        prefill_flash_contract=contract,
    )  # fmt: skip

    def attend(s: DecodeSet, sel: Selection) -> mx.array:
        return dispatch(cplan, s.q, s.keys, s.values, sel, s.positions, s.T, r, cfg.scale, impl)

    sels = [select(s) for s in sets]
    mx.eval([(x.ids, x.valid) for x in sels])
    steps = {
        "selection": lambda i: select(sets[i]).ids,
        "attention": lambda i: attend(sets[i], sels[i]),
        "selection_attention": lambda i: attend(sets[i], select(sets[i])),
    }
    return steps, list(cplan.consumers), (sels[0], attend(sets[0], sels[0]))


def prefill_components(
    cfg: QSAConfig, sets: list[DecodeSet], impl: str, routing: QSAOptions | None = None
) -> tuple[dict[str, Callable[[], float]], list[str], tuple[Selection, mx.array]]:
    """`prefill_steps` as passes to time in turns: an `mx.eval` per step, and on CUDA also on
    the GPU's clock and ending in `mx.synchronize`; the consumers and set 0's outputs as there."""
    steps, consumers, outputs = prefill_steps(cfg, sets, impl, routing)
    n = len(sets)
    passes = {k: mlx_pass(f, n) for k, f in steps.items()}
    if impl == "cuda":  # also on the GPU's clock, as torch's events time its peer
        passes.update({f"{k}_gpu": mlx_gpu_pass(f, n) for k, f in steps.items()})
        # and a step at a time ending in mx.synchronize, as torch's synchronized peer
        passes["selection_attention_spin"] = mlx_pass(steps["selection_attention"], n, spin=True)
    return passes, consumers, outputs


def prefill_checks(
    cuda: tuple[Selection, mx.array], portable: tuple[Selection, mx.array]
) -> dict[str, Any]:
    """The CUDA chunk against the portable one on the same inputs: selections bit for bit,
    attention outputs by relative error."""
    (sc, oc), (sp, op) = cuda, portable
    same = bool(mx.array_equal(sc.ids, sp.ids).item() and mx.array_equal(sc.valid, sp.valid).item())
    rows_differ = int(mx.sum(mx.any(sc.ids != sp.ids, axis=-1)).item())
    a, b = oc.astype(mx.float32), op.astype(mx.float32)
    rel = (mx.linalg.norm((a - b).flatten()) / mx.linalg.norm(b.flatten())).item()
    return {"selection_equal": same, "rows_with_other_ids": rows_differ, "attention_rel_diff": rel}


def matmul_ceiling(n: int, repeats: int = 5) -> dict[str, Any]:
    """bf16 matrix-unit rate of this device: an n x n x n matmul, best of `repeats`."""
    a = mx.random.normal((n, n), key=mx.random.key(1)).astype(mx.bfloat16)
    b = mx.random.normal((n, n), key=mx.random.key(2)).astype(mx.bfloat16)
    mx.eval(a, b, a @ b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "tflops": 2 * n**3 / best / 1e12}


def _torch_causal_peer(
    passes: dict[str, Callable[[], float]],
    rec: dict[str, Any],
    cfg: QSAConfig,
    T: int,
    S: int,
    args: argparse.Namespace,
) -> bool:
    """Add torch's dense causal SDPA of S rows over T tokens to `passes`, queued (CUDA events)
    and with a synchronize per step (the peer of our eval-per-step entries); or record in `rec`
    why it is absent. Whether it was added."""
    if args.no_torch or _torch_cuda() is None:
        rec["skipped"] = {"torch_dense_causal_sdpa": "torch with CUDA is not importable here"}
        return False
    passes["torch_dense_causal_sdpa"] = _torch_prefill(cfg, T, S, args)
    passes["torch_dense_causal_sdpa_sync"] = _torch_prefill(cfg, T, S, args, sync=True)
    return True


def _note_torch_causal(t: dict[str, Any], note: str) -> None:
    """Put `note` on the torch entries that ran."""
    for name in ("torch_dense_causal_sdpa", "torch_dense_causal_sdpa_sync"):
        if name in t:
            t[name]["note"] = note


def _torch_prefill(
    cfg: QSAConfig, T: int, S: int, args: argparse.Namespace, sync: bool = False
) -> Callable[[], float]:
    """torch's dense causal SDPA over the chunk's context, as a pass over its own sets: CUDA
    events around the queued pass, or (`sync`) wall clock with a synchronize per step."""
    return torch_causal_pass(
        cfg.num_attention_heads, cfg.head_dim, S, T, args.sets, cfg.scale, sync_each=sync
    )


def torch_causal_pass(
    H: int, d: int, S: int, T: int, n_sets: int, scale: float, sync_each: bool = False
) -> Callable[[], float]:
    """torch's dense causal SDPA of S rows (the last S positions) over T tokens, H heads of d,
    bf16, as a `torch_pass` over `n_sets` sets of its own (seeded by T)."""
    import torch
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(T)
    bf = torch.bfloat16
    sets = [
        tuple(
            torch.randn(*sh, generator=g, device="cuda").to(bf)
            for sh in ((1, H, S, d), (1, H, T, d), (1, H, T, d))
        )
        for _ in range(n_sets)
    ]
    mask = causal_lower_right(S, T)  # rows are the last S positions

    def step(i: int):
        q, k, v = sets[i]
        return sdpa(q, k, v, attn_mask=mask, scale=scale)

    return torch_pass(step, n_sets, sync_each=sync_each)


def prefill_rates(doc_body: dict[str, Any]) -> None:
    """Achieved TFLOP/s of each timed column against the measured matmul ceiling (in place)."""
    ceiling = doc_body["matmul_ceiling"]["tflops"]
    for p in doc_body["points"]:
        f = p["flops"]
        rates = {}
        for name, t in p["timings"].items():
            # a GPU-clock entry (ours) or a synchronized one (torch's) does its entry's work
            work = name.removesuffix("_gpu").removesuffix("_sync").removesuffix("_spin")
            if work.endswith("_selection"):
                flops = f["indexer"]
            elif work.endswith("_selection_attention"):  # before "_attention", which it ends in
                flops = f["indexer"] + f["sparse_attention"]
            elif work.endswith("_attention"):
                flops = f["sparse_attention"]
            elif work == "torch_dense_causal_sdpa":
                flops = f["dense_causal_attention"]
            else:
                continue
            tf = flops / (t["median_us"] * 1e-6) / 1e12
            rates[name] = {"tflops": tf, "of_ceiling": tf / ceiling}
            if work.endswith("_attention") and "attention_kv_bytes" in p:
                gbps = p["attention_kv_bytes"] / (t["median_us"] * 1e-6) / 1e9
                rates[name]["kv_gbps"] = gbps
                if "copy_bandwidth" in doc_body:
                    rates[name]["kv_of_copy"] = gbps / doc_body["copy_bandwidth"]["gbps"]
        p["rates"] = rates


def _progress_prefill(rec: dict[str, Any]) -> None:
    cols = " ".join(f"{k}={v['median_us'] / 1e3:.2f}ms" for k, v in rec["timings"].items())
    if "checks" in rec:
        cols += f" checks={rec['checks']}"
    print(f"prefix={rec['prefix']} rows={rec['rows']} {cols}", flush=True)


# ---- tensor parallel ------------------------------------------------------------------------


def run_tp(args: argparse.Namespace) -> dict[str, Any]:
    """The sharded layer at each context: output vs the unsharded layer, step time, all_sum."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (NCCL hosts)
    group = mx.distributed.init()
    if group.size() != args.tp:
        raise SystemExit(
            f"bench --tp {args.tp}: the distributed group has {group.size()} ranks; start one "
            f"process per rank (e.g. `mlx.launch -n {args.tp} -m mlx_qsa bench ...`)"
        )
    cfg = QSAConfig()
    rows_list = args.rows if args.mode == "decode" else (args.chunk,)
    mx.random.seed(0)  # every rank builds the same unsharded weights, then keeps its shard
    full = QSAAttention(cfg, fused=4)
    full.set_dtype(mx.bfloat16)
    mx.eval(full.parameters())
    sharded = QSAAttention(cfg, fused=4)
    sharded.update(full.parameters())
    sharded.shard(group)
    points = []
    for T0 in args.contexts:
        for rows in rows_list:
            T = T0 if args.mode == "decode" else T0 + rows
            x = layer_rows(cfg, rows, seed=rows)
            c_full, c_shard = random_cache(full, T, rows, 0), random_cache(sharded, T, rows, 0)
            y_ref = full(x, cache=c_full)
            y = sharded(x, cache=c_shard)
            err = float(
                mx.sqrt(mx.sum((y.astype(mx.float32) - y_ref.astype(mx.float32)) ** 2))
                / mx.sqrt(mx.sum(y_ref.astype(mx.float32) ** 2))
            )
            c_shard.trim(rows)

            def step(i: int, x=x, c_shard=c_shard, rows=rows) -> mx.array:
                out = sharded(x, cache=c_shard)
                c_shard.trim(rows)
                return out

            rec = {
                "context": T,
                "rows": rows,
                "rel_err_vs_unsharded": err,
                "step": time_mlx(step, 1, args.warmup, args.repeats),
                "all_sum": time_mlx(
                    lambda i, y=y: mx.distributed.all_sum(y, group=group),
                    1,
                    args.warmup,
                    args.repeats,
                ),
                "all_sum_bytes": int(y.nbytes),
                "rank_kv_bytes": int(c_shard.nbytes),
            }
            points.append(rec)
            if group.rank() == 0:
                print(
                    f"tp={args.tp} T={T} rows={rows} err={err:.2e} "
                    f"step={rec['step']['median_us']:.1f}us "
                    f"all_sum={rec['all_sum']['median_us']:.1f}us",
                    flush=True,
                )
    bad = [p for p in points if not p["rel_err_vs_unsharded"] <= REL_TOL]
    if bad:
        raise SystemExit(
            f"bench --tp {args.tp}: rank {group.rank()} output differs from the unsharded "
            f"layer's (relative error {bad[0]['rel_err_vs_unsharded']:.3g} > {REL_TOL}) at "
            f"T={bad[0]['context']}, rows={bad[0]['rows']}"
        )
    return {"tp": args.tp, "rank": group.rank(), "points": points}


# ---- command line ---------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(
            int(float(v[:-1]) * 1024) if v.lower().endswith("k") else int(v)
            for v in text.split(",")
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", choices=("decode", "prefill", "prompt"))
    p.add_argument(
        "--contexts",
        type=_int_list,
        default=None,
        help="contexts (decode), prefixes (prefill) or prompt lengths (prompt), e.g. 8k,32k",
    )
    p.add_argument("--rows", type=_int_list, default=DEFAULT_ROWS, help="decode rows per step")
    p.add_argument("--chunk", type=int, default=2048, help="prefill / prompt chunk rows")
    p.add_argument("--sets", type=int, default=8, help="rotated buffer sets (>= 8 defeats L2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--settle",
        type=_arg(_non_negative_seconds),  # sweep --settle's rule: finite, >= 0
        default=1.0,
        help="seconds of untimed rounds of all entries, after the warm-up, before any sample "
        "is timed (the GPU's clocks settle under the mix; default 1)",
    )
    p.add_argument("--copy-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--ceiling-n", type=int, default=None, help="matmul size of the ceiling (prefill)"
    )
    p.add_argument(
        "--tp",
        type=_int_list,
        default=None,
        help="tensor-parallel group size (inside mx.distributed, one process per rank; 1 = the "
        "sharded path on a group of one), or several sizes, e.g. 1,2,4,8: then bench starts "
        "each size's processes itself and reports the scaling",
    )
    p.add_argument(
        "--tp-backend",
        choices=("auto", "ring", "nccl"),
        default="auto",
        help="launcher backend of a --tp list (auto: nccl on CUDA, else ring)",
    )
    p.add_argument("--tp-timeout", type=int, default=1800, help="seconds per size of a --tp list")
    p.add_argument("--no-torch", action="store_true", help="skip the torch peer")
    p.add_argument("--no-layer", action="store_true", help="skip the whole-layer columns")
    p.add_argument(
        "--large-from",
        type=int,
        default=None,
        help="prefill, prompt: also time the layer with prefill_min_context = flash_min = this "
        "context (entries qsa_*_layer_large / qsa_*_prompt_large; prefill's selection and "
        "attention entries then use its consumer), beside the library defaults",
    )
    p.add_argument("--portable-only", action="store_true")
    p.add_argument(
        "--no-portable",
        action="store_true",
        help="prefill, prompt: on CUDA time the CUDA entries only (no portable columns or "
        "CUDA-against-portable checks; device time)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--png", type=Path, default=None, help="chart to write (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    if args.contexts is None:
        args.contexts = {"decode": DEFAULT_CONTEXTS, "prefill": PREFILL_CONTEXTS}.get(
            args.mode, PROMPT_LENGTHS
        )
    if args.ceiling_n is None:
        args.ceiling_n = 8192 if backend_name() == "cuda" else 1024
    if args.sets < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("bench: --sets and --repeats must be >= 1, --warmup >= 0")
    large_from = args.large_from
    if large_from is not None and (args.mode == "decode" or args.tp is not None):
        raise SystemExit("bench: --large-from applies to bench prefill and prompt (without --tp)")
    if args.mode == "prompt" and (args.tp is not None or args.chunk < 1):
        raise SystemExit("bench prompt: needs --chunk >= 1 and no --tp")
    if args.no_portable and (args.mode == "decode" or args.portable_only):
        raise SystemExit(
            "bench: --no-portable applies to prefill and prompt, without --portable-only"
        )
    if large_from is not None and large_from < 0:
        raise SystemExit(f"bench: --large-from must be a context >= 0, got {large_from}")
    backend = backend_name()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.tp is not None and len(args.tp) > 1:
        from .bench_tp import run_scaling

        tp_backend = args.tp_backend
        if tp_backend == "auto":
            tp_backend = "nccl" if backend == "cuda" else "ring"
        body = run_scaling(args, tp_backend)
    elif args.tp is not None:
        args.tp = args.tp[0]
        body = run_tp(args)
    else:
        body = {"timing": timing_doc(args)}
        before = host_calibration()
        run_mode = {"decode": run_decode, "prefill": run_prefill, "prompt": run_prompt}
        body |= run_mode[args.mode](args)
        body["host_calibration"] = {"before": before, "after": host_calibration()}
        if args.mode == "prefill":
            prefill_rates(body)
    env = environment(backend)
    doc = {
        "bench": args.mode,
        "device_name": (env.get(backend) or {}).get("device_name"),
        "command": "mlx-qsa bench "
        + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "date": started,
        "backend": backend,
        "environment": env,
        # the library's A/B switches set for this run (none: every default form)
        "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_QSA_")},
        # CPU figures depend on which BLAS MLX calls (README, Linux CPU): the mapped ones, and
        # LD_PRELOAD, whose libraries' symbols come first
        "blas": {"mapped": loaded_blas(), "ld_preload": os.environ.get("LD_PRELOAD", "")},
        "geometry": QSAConfig().to_dict(),
        **body,
    }
    if body.get("rank", 0) != 0:
        return 0
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.png is not None and "scaling" in body:
        print("bench: no chart for a --tp list yet (the table is in the JSON)")
    elif args.png is not None:
        from .bench_chart import write_chart

        write_chart(doc, args.png)
        print(f"wrote {args.png}")
    return 0
