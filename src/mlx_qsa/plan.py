"""Every routing decision of the QSA runtime as pure functions (RUNTIME.md §2, §4–§6).

No `mlx`, no arrays: ints, strings and frozen dataclasses only, so the layer can plan on the
host and then run arrays through what the plan chose (FlashInfer's plan/run split), and the
trace's non-hash fields can be re-derived without executing anything.

Dtypes are short MLX names (`"bfloat16"`, `"float16"`, `"float32"`); compiled keys store the
full names (`"mlx.core.bfloat16"`) because that is what the receipt reports.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from mlx_qsa.config import QSAOptions, field_hash

# ------------------------------------------------------------------------------------
# Counters (§5.7)

TRACE_COUNTERS = (
    "metal_selector", "flash_kernel", "gather_tier", "dense_fallback", "decode_gather",
    "compiled_selector",
)  # fmt: skip
# Kept by the library, omitted from the trace.
LIBRARY_COUNTERS = TRACE_COUNTERS + (
    "eager_selector", "decode_flash_skip", "decode_dense_mask", "direct_kernel",
)  # fmt: skip


def ordered_counts(names: Iterable[str], trace_only: bool = True) -> dict[str, int]:
    """Count counter increments in the fixed §5.7 order, zero entries omitted.

    With `trace_only` the library-only counters are dropped (the trace never shows them).
    """
    return dict(_ordered_counts(tuple(names), trace_only))  # a fresh dict: callers may keep it


@lru_cache(maxsize=1024)
def _ordered_counts(names: tuple[str, ...], trace_only: bool) -> tuple[tuple[str, int], ...]:
    """`ordered_counts` once per distinct list of names (a layer asks for the same few lists at
    every step)."""
    unknown = sorted(set(names) - set(LIBRARY_COUNTERS))
    if unknown:
        raise ValueError(f"ordered_counts(names): unknown counters {unknown}")
    tally = Counter(names)
    order = TRACE_COUNTERS if trace_only else LIBRARY_COUNTERS
    return tuple((k, tally[k]) for k in order if tally[k])


# ------------------------------------------------------------------------------------
# Capacities (§0, §2.2)

KV_STEP = 256
MIN_CAPACITY = 256
SELECTOR_SCRATCH_BYTES = 33_554_432
DEFAULT_PREFILL_WORKSPACE = 134_217_728
DTYPES = ("bfloat16", "float16", "float32")


def _check_nonneg(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {v!r}")


def roundup256(n: int) -> int:
    """256·ceil(n/256)."""
    _check_nonneg("roundup256(n)", n)
    return -(-n // KV_STEP) * KV_STEP


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    _check_nonneg("next_pow2(n)", n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def bucket(n: int) -> int:
    """Compiled-core backing bucket: 0 if n == 0 else max(256, next_pow2(n))."""
    _check_nonneg("bucket(n)", n)
    return 0 if n == 0 else max(MIN_CAPACITY, next_pow2(n))


def kv_growth(cap: int, P: int, S: int) -> tuple[int, int] | None:
    """mlx-lm `KVCache` growth for writing rows [P, P+S) into a backing of `cap` rows.

    None when the backing already holds T = P + S rows. Otherwise (rows_kept, new_cap): keep
    the first rows_kept rows of the old backing, then zero rows up to new_cap. A backing whose
    frontier is not on a 256 boundary is cut to P rows first (mlx-lm's step logic).
    """
    _check_nonneg("kv_growth(cap)", cap)
    _check_nonneg("kv_growth(P)", P)
    if not isinstance(S, int) or S < 1:
        raise ValueError(f"kv_growth(S): expected an int >= 1, got {S!r}")
    T = P + S
    if cap > 0 and T <= cap:
        return None
    n = roundup256(S)
    if cap == 0:
        return 0, n
    kept = P if P % KV_STEP else cap
    return kept, kept + n


def eager_growth(cap: int, end: int) -> int:
    """Eager raw/pooled growth for a write ending at `end`: max(roundup256(end), 2·cap).

    Returns `cap` unchanged when no growth is needed (cap > 0 and end <= cap, or nothing
    written to an absent state).
    """
    _check_nonneg("eager_growth(cap)", cap)
    _check_nonneg("eager_growth(end)", end)
    if end <= cap:
        return cap
    return max(roundup256(end), 2 * cap)


def compiled_reservation(
    cap_raw: int, cap_pool: int, P: int, S: int, ratio: int = 4
) -> tuple[int, int]:
    """(cap_raw, cap_pool) after the bucket reservation that precedes every compiled call.

    Never shrinks (bucket(n) >= n) and never goes below 256.
    """
    call = CallShape(rows=S, pos=P, ratio=ratio)
    new_raw = bucket(max(cap_raw, call.T, ratio * call.m))
    new_pool = bucket(max(1, call.nb, cap_pool, call.m))
    return new_raw, new_pool


# ------------------------------------------------------------------------------------
# Capabilities (§4) and the call (§0)


@dataclass(frozen=True)
class Capabilities:
    """Accelerated routines a backend offers (RUNTIME §4). Routing reads only this."""

    __hash__ = field_hash

    indexer_kernels: bool = True
    compiled_core: bool = True
    flash_decode: bool = True
    prefill_selector: bool = True
    prefill_flash: bool = True
    fused_score_producer: bool = True
    f32_selector: bool = True

    @classmethod
    def reference(cls) -> Capabilities:
        """Every routine present: the reference implementation's routing."""
        return cls()

    @classmethod
    def portable(cls) -> Capabilities:
        """No routine present: the pure-MLX oracle path."""
        return cls(**{f.name: False for f in dataclasses.fields(cls)})

    @classmethod
    def native(cls, backend: str) -> Capabilities:
        """What a backend ("cpu", "metal", "cuda") natively offers today.

        No backend ships a native routine yet (the CUDA kernels are not wired into routing),
        so every backend is `portable`; `reference` stays the library and harness default.
        """
        if backend not in ("cpu", "metal", "cuda"):
            raise ValueError(
                f"Capabilities.native(backend): expected 'cpu', 'metal' or 'cuda', got {backend!r}"
            )
        return cls.portable()

    def effective_options(self, opts: QSAOptions) -> QSAOptions:
        """`opts` with fused/compiled/flash forced false where the capability is missing."""
        changes: dict[str, Any] = {}
        if not self.indexer_kernels and opts.fused:
            changes["fused"] = False
        if not self.compiled_core and opts.compiled:
            changes["compiled"] = False
        if not self.flash_decode and opts.flash:
            changes["flash"] = False
        return opts.replace(**changes) if changes else opts


@dataclass(frozen=True)
class CallShape:
    """One layer call: S = `rows` query rows at cache offset P = `pos`."""

    rows: int
    pos: int
    ratio: int = 4
    block_topk: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"CallShape.rows: expected an int >= 1, got {self.rows!r}")
        _check_nonneg("CallShape.pos", self.pos)
        for name in ("ratio", "block_topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"CallShape.{name}: expected an int >= 1, got {v!r}")

    @property
    def T(self) -> int:
        return self.pos + self.rows

    @property
    def decode(self) -> bool:
        return self.rows == 1

    @property
    def nb(self) -> int:
        """Complete blocks after the call."""
        return self.T // self.ratio

    @property
    def m(self) -> int:
        """ceil(S / ratio): staging-window width in blocks."""
        return -(-self.rows // self.ratio)

    @property
    def dense(self) -> bool:
        """nb <= K: every visible block is selected, so no selection is needed."""
        return self.nb <= self.block_topk


@dataclass(frozen=True)
class Predicates:
    """§5.1 predicates of one call (on the configured options)."""

    large: bool
    gatherable: bool
    tiled: bool


def predicates(opts: QSAOptions, call: CallShape) -> Predicates:
    """`large`, `gatherable`, `tiled` of §5.1 (prefill_min_context raised to 2049)."""
    S, T = call.rows, call.T
    large = opts.prefill and S >= opts.prefill_min_rows and T >= opts.effective_prefill_min_context
    gatherable = opts.gather and S <= opts.gather_max_rows and T >= opts.gather_min_context
    tiled = 0 < opts.tile_rows < S
    return Predicates(large=large, gatherable=gatherable, tiled=tiled)


# ------------------------------------------------------------------------------------
# Indexer routing (§5.2–§5.5)

MODES = ("update_only", "blocks", "prefill_blocks", "row_tokens", "dense_mask")
SELECTIONS = ("none", "blocks", "prefill_blocks", "row_tokens", "token_list", "dense_mask")
SELECTORS = ("none", "compiled", "legacy", "oracle", "prefill_kernel", "prefill_oracle")


def indexer_mode(opts: QSAOptions, caps: Capabilities, call: CallShape) -> str:
    """§5.2 mode of an indexer call (uses the effective `flash`)."""
    flash = caps.effective_options(opts).flash
    pred = predicates(opts, call)
    if call.dense:
        return "update_only"
    if call.decode and flash:
        return "blocks"
    if not call.decode and pred.large:
        return "prefill_blocks"
    if not call.decode and pred.gatherable:
        return "row_tokens"
    return "dense_mask"


def compiled_blockers(
    opts: QSAOptions, caps: Capabilities, call: CallShape, mode: str, *,
    index_kv_heads: int = 1, index_head_dim: int = 128,
    input_dtype: str = "bfloat16", norm_dtype: str = "bfloat16",
    raw_backing: tuple[int, str] | None = None, pooled_backing: tuple[int, str] | None = None,
    pooled_len: int = 0,
) -> tuple[int, ...]:  # fmt: skip
    """Numbers of the §5.3 rules that fail (empty = the call is compiled)."""
    eff = caps.effective_options(opts)
    S, decode = call.rows, call.decode
    failed = []
    # Rule 1; the source is always [1, S, w] here (one sequence per call).
    if not (eff.fused and eff.compiled) or index_kv_heads != 1 or index_head_dim > 128:
        failed.append(1)
    if not decode and mode == "update_only" and opts.phase_prefill:
        failed.append(2)
    if (
        not decode
        and S >= opts.prefill_min_rows
        and (mode not in ("prefill_blocks", "update_only") or S != opts.prefill_compile_rows)
    ):
        failed.append(3)
    if decode and opts.gather_decode and mode not in ("update_only", "blocks"):
        failed.append(4)
    cap_raw = raw_backing[0] if raw_backing is not None else 0
    backings_ok = all(b is None or b[1] == input_dtype for b in (raw_backing, pooled_backing))
    dtype_ok = input_dtype in DTYPES and input_dtype == norm_dtype and backings_ok
    if not dtype_ok or cap_raw < call.pos:
        failed.append(5)
    # The compiled staging window re-pools at most m trailing blocks.
    if call.nb - min(pooled_len, call.nb) > call.m:
        failed.append(6)
    if input_dtype == "float32" and not caps.f32_selector and mode != "update_only":
        failed.append(7)
    return tuple(failed)


@dataclass(frozen=True)
class IndexerPlan:
    """What the indexer stage of one call does (§5.2–§5.5).

    `selector` is "compiled" for every compiled call (the core runs even in `update_only`),
    "none" for an eager call without selection. `blockers` lists the failed §5.3 rules.
    """

    mode: str
    compiled: bool
    selection: str
    selector: str
    fused_prep: bool
    counts: tuple[str, ...]
    source: str
    blockers: tuple[int, ...] = ()

    @property
    def ensure_mirror(self) -> bool:
        """The eager oracle scorer runs and needs the float32 mirror (§2.3 b)."""
        return self.selector == "oracle"


def _eager_selection(
    opts: QSAOptions, caps: Capabilities, call: CallShape
) -> tuple[str, str, tuple[str, ...]]:
    """§5.5 step 4: (selection, selector, counts) of the eager path."""
    eff = caps.effective_options(opts)
    pred = predicates(opts, call)
    decode = call.decode
    if call.dense:
        return "none", "none", ()
    if not decode and pred.large:
        if caps.prefill_selector:
            return "prefill_blocks", "prefill_kernel", ("metal_selector",)
        return "prefill_blocks", "prefill_oracle", ("eager_selector",)
    legacy = (
        eff.fused
        and (decode or call.rows < opts.prefill_min_rows)
        and not (decode and opts.gather_decode)
    )
    if legacy:
        if decode and eff.flash:
            return "blocks", "legacy", ()
        if not decode and pred.gatherable:
            return "row_tokens", "legacy", ()
        return "dense_mask", "legacy", ()
    if decode and eff.flash:
        return "blocks", "oracle", ()
    if decode and opts.gather_decode:
        return "token_list", "oracle", ("decode_gather",)
    if not decode and pred.gatherable and not pred.tiled:
        return "row_tokens", "oracle", ()
    return "dense_mask", "oracle", ()


def plan_indexer(
    opts: QSAOptions, caps: Capabilities, call: CallShape, *, fused_level: int,
    index_kv_heads: int = 1, index_head_dim: int = 128,
    input_dtype: str = "bfloat16", norm_dtype: str = "bfloat16",
    raw_backing: tuple[int, str] | None = None, pooled_backing: tuple[int, str] | None = None,
    pooled_len: int = 0,
) -> IndexerPlan:  # fmt: skip
    """Mode, compiled eligibility, selection kind and selector of one indexer call.

    `raw_backing` / `pooled_backing` are (capacity, dtype) of states 0 / 1, None if absent.
    """
    if fused_level not in (0, 3, 4):
        raise ValueError(f"plan_indexer(fused_level): expected 0, 3 or 4, got {fused_level!r}")
    _check_nonneg("plan_indexer(pooled_len)", pooled_len)
    mode = indexer_mode(opts, caps, call)
    blockers = compiled_blockers(
        opts, caps, call, mode, index_kv_heads=index_kv_heads, index_head_dim=index_head_dim,
        input_dtype=input_dtype, norm_dtype=norm_dtype, raw_backing=raw_backing,
        pooled_backing=pooled_backing, pooled_len=pooled_len,
    )  # fmt: skip
    fused_prep = caps.effective_options(opts).fused
    source = "qk_rows" if fused_level == 4 else "hidden"
    if not blockers:
        selection = "none" if mode == "update_only" else mode
        counts = ("compiled_selector",) if mode == "prefill_blocks" else ()
        return IndexerPlan(mode, True, selection, "compiled", fused_prep, counts, source)
    selection, selector, counts = _eager_selection(opts, caps, call)
    return IndexerPlan(mode, False, selection, selector, fused_prep, counts, source, blockers)


# ------------------------------------------------------------------------------------
# Consumers (§5.6)

CONSUMERS = ("sdpa", "flash", "rows_gather", "prefill_flash", "prefill_gather", "dense_mask")
VISIONS = ("none", "table", "no_axes")


@dataclass(frozen=True)
class ConsumerPlan:
    """Which consumers compute the attention of one call, and with what sdpa mask."""

    consumers: tuple[str, ...]
    sdpa_mask: str
    counts: tuple[str, ...]


def prefill_flash_contract(
    *, n_heads: int, kv_heads: int, head_dim: int, block_topk: int, dtype: str, scale: float
) -> bool:
    """The `prefill_flash` kernel contract of §5.6 (P + S == T holds by construction)."""
    return (
        n_heads == 24
        and kv_heads == 2
        and head_dim == 256
        and block_topk == 512
        and dtype in ("float16", "bfloat16")
        and scale == 1 / 16
    )


def plan_consumers(
    opts: QSAOptions, caps: Capabilities, call: CallShape, selection: str, *,
    has_indexer: bool, vision: str = "none", prefill_flash_contract: bool = True,
) -> ConsumerPlan:  # fmt: skip
    """§5.6: the consumer chain for `selection` (dropped without indexer or with vision)."""
    if selection not in SELECTIONS:
        raise ValueError(
            f"plan_consumers(selection): expected one of {SELECTIONS}, got {selection!r}"
        )
    if vision not in VISIONS:
        raise ValueError(f"plan_consumers(vision): expected one of {VISIONS}, got {vision!r}")
    if not has_indexer or (vision != "none" and not opts.vision_sparse):
        selection = "none"
    S, decode = call.rows, call.decode
    if selection in ("blocks", "token_list") and not decode:
        raise ValueError(f"plan_consumers: selection {selection!r} needs S == 1, got S={S}")
    if selection == "prefill_blocks" and decode:
        raise ValueError("plan_consumers: selection 'prefill_blocks' needs S > 1, got S=1")
    if selection == "none":
        return ConsumerPlan(("sdpa",), "none" if decode else "causal", ())
    if selection == "blocks":
        return ConsumerPlan(("flash",), "", ("decode_flash_skip",))
    if selection == "prefill_blocks":
        if (
            S >= opts.prefill_min_rows
            and call.T >= opts.flash_min
            and not call.dense
            and caps.prefill_flash
            and prefill_flash_contract
        ):
            return ConsumerPlan(("prefill_flash",), "", ("flash_kernel",))
        if opts.prefill_gather:
            return ConsumerPlan(("prefill_gather", "rows_gather"), "", ("gather_tier",))
        return ConsumerPlan(("dense_mask", "sdpa"), "dense_mask", ("dense_fallback",))
    if selection == "row_tokens":
        return ConsumerPlan(("rows_gather",), "", ())
    if selection == "token_list":
        return ConsumerPlan(("sdpa",), "token_list", ())
    return ConsumerPlan(("sdpa",), "dense_mask", ("decode_dense_mask",) if decode else ())


# ------------------------------------------------------------------------------------
# Compiled core: chunking, staging window, keys, receipt (§6)


def prefill_score_producer(
    caps: Capabilities, q_dtype: str, pooled_dtype: str, *, n_heads: int = 4, head_dim: int = 128
) -> str:
    """§6.3: "mpp" (single reduced plane) or "mlx" (per-head logits + reduced plane)."""
    same_half = q_dtype == pooled_dtype and q_dtype in ("bfloat16", "float16")
    if caps.fused_score_producer and same_half and n_heads == 4 and head_dim == 128:
        return "mpp"
    return "mlx"


def selector_chunk_rows(
    mode: str, S: int, cap_pool: int, *, producer: str = "none",
    prefill_workspace: int = DEFAULT_PREFILL_WORKSPACE,
) -> int:  # fmt: skip
    """§6.3: query rows per selector dispatch (0 = no dispatch). `cap_pool` is post-reservation."""
    if mode == "update_only":
        return 0
    if not isinstance(cap_pool, int) or cap_pool < 1:
        raise ValueError(f"selector_chunk_rows(cap_pool): expected an int >= 1, got {cap_pool!r}")
    if mode in ("blocks", "row_tokens", "dense_mask"):
        # One float32 score row per backing block within the 32 MiB selector scratch.
        return min(S, max(1, SELECTOR_SCRATCH_BYTES // (cap_pool * 4)))
    if mode != "prefill_blocks":
        raise ValueError(f"selector_chunk_rows(mode): expected one of {MODES}, got {mode!r}")
    if producer not in ("mpp", "mlx"):
        raise ValueError(
            f"selector_chunk_rows(producer): expected 'mpp' or 'mlx', got {producer!r}"
        )
    planes = 1 if producer == "mpp" else 5
    c = min(S, max(1, prefill_workspace // (cap_pool * 4 * planes)))
    if 32 <= c < S:
        c = 32 * (c // 32)
    return c


def staging_window_start(
    nb: int, m: int, pooled_len_before: int, cap_raw: int, cap_pool: int, ratio: int = 4
) -> int:
    """§6.5: first block of the m-block window the compiled core re-pools."""
    return min(max(nb - m, 0), pooled_len_before, cap_raw // ratio - m, cap_pool - m)


def mlx_dtype_name(dtype: str) -> str:
    """Full MLX dtype name: "bfloat16" -> "mlx.core.bfloat16" (full names pass through)."""
    return dtype if dtype.startswith("mlx.core.") else f"mlx.core.{dtype}"


@dataclass(frozen=True)
class CompiledKey:
    """Structural key of one compiled-core graph (§6.2); fields in the receipt's order."""

    source: str
    mode: str
    input_shape: tuple[int, ...]
    input_dtype: str
    raw_shape: tuple[int, ...]
    raw_dtype: str
    pooled_shape: tuple[int, ...]
    pooled_dtype: str
    n_heads: int
    kv_heads: int
    head_dim: int
    block_topk: int
    compress_ratio: int
    dense_output_tokens: int
    prefill_score_producer: str
    selector_chunk_rows: int

    __hash__ = field_hash  # the receipt and the graph table hash the key on every call

    @property
    def rows(self) -> int:
        return self.input_shape[1]

    # Labels are read on every dispatch (graph lookup, receipt): made once per key (keys are
    # immutable, and `make_compiled_key` hands back the same object for the same call).
    @cached_property
    def bucket_label(self) -> str:
        return f"raw{self.raw_shape[1]}:pool{self.pooled_shape[1]}:out{self.dense_output_tokens}"

    @cached_property
    def label(self) -> str:
        return (
            f"{self.source}:{self.mode}:s{self.rows}:{self.bucket_label}"
            f":score{self.prefill_score_producer}:chunk{self.selector_chunk_rows}"
            f":{self.input_dtype}/{self.pooled_dtype}"
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        d["label"] = self.label
        return d


@lru_cache(maxsize=256)
def make_compiled_key(
    *, source: str, mode: str, rows: int, input_width: int, input_dtype: str, cap_raw: int,
    cap_pool: int, raw_dtype: str, pooled_dtype: str, caps: Capabilities, q_dtype: str,
    n_heads: int = 4, kv_heads: int = 1, head_dim: int = 128, block_topk: int = 512,
    compress_ratio: int = 4, prefill_workspace: int = DEFAULT_PREFILL_WORKSPACE,
) -> CompiledKey:  # fmt: skip
    """The key of a compiled call; capacities are those after the §2.2 reservation.

    Memoized: a decode step repeats its key, and one shared object hashes, compares (by
    identity first) and labels cheaply in the graph table and the receipt."""
    if source not in ("qk_rows", "hidden"):
        raise ValueError(
            f"make_compiled_key(source): expected 'qk_rows' or 'hidden', got {source!r}"
        )
    if mode not in MODES:
        raise ValueError(f"make_compiled_key(mode): expected one of {MODES}, got {mode!r}")
    # One spare block covers a 0-3 token tail of the dense mask.
    dense = (cap_pool + 1) * compress_ratio if mode == "dense_mask" else 0
    producer = "none"
    if mode == "prefill_blocks":
        producer = prefill_score_producer(
            caps, q_dtype, pooled_dtype, n_heads=n_heads, head_dim=head_dim
        )
    chunk = selector_chunk_rows(
        mode, rows, cap_pool, producer=producer, prefill_workspace=prefill_workspace
    )
    return CompiledKey(
        source, mode, (1, rows, input_width), mlx_dtype_name(input_dtype),
        (1, cap_raw, head_dim), mlx_dtype_name(raw_dtype),
        (1, cap_pool, head_dim), mlx_dtype_name(pooled_dtype),
        n_heads, kv_heads, head_dim, block_topk, compress_ratio, dense, producer, chunk,
    )  # fmt: skip


_RECEIPT_MODES = ("blocks", "prefill_blocks", "dense_mask", "row_tokens", "update_only")


class CoreReceipt:
    """Cumulative receipt of one layer's compiled core (§6.4): the trace's `core` object."""

    def __init__(self) -> None:
        self.calls = 0
        self.compiled_calls = 0
        self.hidden_calls = 0
        self.qk_rows_calls = 0
        self.traces = 0
        self.selector_dispatches = 0
        self.capacity_transitions = 0
        self.producers = {"mpp": 0, "mlx": 0}
        self.modes = dict.fromkeys(_RECEIPT_MODES, 0)
        self.buckets: dict[str, int] = {}
        self.keys: dict[CompiledKey, None] = {}  # insertion-ordered set
        self._last_caps: tuple[int, int] | None = None

    def record(self, key: CompiledKey, *, compiled: bool = True) -> bool:
        """Account one dispatch of `key`; returns True if the key is new (a trace)."""
        self.calls += 1
        self.compiled_calls += int(compiled)
        if key.source == "hidden":
            self.hidden_calls += 1
        else:
            self.qk_rows_calls += 1
        if key.selector_chunk_rows > 0:
            self.selector_dispatches += -(-key.rows // key.selector_chunk_rows)
        caps = (key.raw_shape[1], key.pooled_shape[1])
        if self._last_caps is not None and caps != self._last_caps:
            self.capacity_transitions += 1
        self._last_caps = caps
        if key.prefill_score_producer in self.producers:
            self.producers[key.prefill_score_producer] += 1
        self.modes[key.mode] += 1
        self.buckets[key.bucket_label] = self.buckets.get(key.bucket_label, 0) + 1
        new = key not in self.keys
        if new:
            self.keys[key] = None
            self.traces += 1
        return new

    @property
    def entry_count(self) -> int:
        return len(self.keys)

    def to_dict(self, prefill_workspace: int = DEFAULT_PREFILL_WORKSPACE) -> dict[str, Any]:
        """The trace record's `core` object (keys and value types as in the fixture)."""
        return {
            "calls": self.calls,
            "compiled_calls": self.compiled_calls,
            "hidden_calls": self.hidden_calls,
            "qk_rows_calls": self.qk_rows_calls,
            "traces": self.traces,
            "selector_dispatches": self.selector_dispatches,
            "capacity_transitions": self.capacity_transitions,
            "prefill_score_producers": dict(self.producers),
            "modes": dict(self.modes),
            "buckets": dict(self.buckets),
            "entry_count": self.entry_count,
            "compiled_keys": [k.to_dict() for k in sorted(self.keys, key=lambda k: k.label)],
            "require_bucketed_backing": True,
            "minimum_raw_capacity": MIN_CAPACITY,
            "minimum_pooled_capacity": MIN_CAPACITY,
            "selector_scratch_bytes": SELECTOR_SCRATCH_BYTES,
            "prefill_score_workspace_bytes": prefill_workspace,
            "rope_attention_scaling": 1.0,
        }
