"""Trace profiles p0–p9 (RUNTIME §9.2) and an int-level model of the cache (§2).

Pure Python: the model tracks only capacities, presence and counters, and routes every call
through `mlx_qsa.plan`, so it re-derives the non-hash fields of a trace record without arrays.
The trace harness imports `PROFILES`; tests compare `expected_records` with the fixture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_qsa import plan
from mlx_qsa.config import QSAOptions
from mlx_qsa.plan import CallShape, Capabilities, CoreReceipt

# Trace geometry (§9.1).
HIDDEN = 64
N_HEADS, KV_HEADS, HEAD_DIM = 24, 2, 256
INDEX_HEADS, INDEX_KV_HEADS, INDEX_DIM = 4, 1, 128
QK_ROWS_WIDTH = (INDEX_HEADS + INDEX_KV_HEADS) * INDEX_DIM
DTYPE = "bfloat16"

Step = tuple[str, int, int] | tuple[str, int]

# Record keys in §9.4 order; the hash-free ones are what `expected_record` produces.
RECORD_KEYS = (
    "kernel",
    "sha256",
    "profile",
    "step",
    "rows",
    "pos",
    "prefix",
    "fused",
    "vision",
    "no_indexer",
    "biased",
    "flash_min",
    "prefill_gather",
    "options",
    "consumers",
    "counts",
    "offset",
    "pooled_len",
    "state_present",
    "shapes",
    "core",
    "frequencies",
)
NON_HASH_KEYS = tuple(k for k in RECORD_KEYS if k not in ("sha256", "frequencies"))


@dataclass(frozen=True)
class Profile:
    """One row of the §9.2 table. `steps` holds ("call", S, P) and ("trim", n) items."""

    profile: int
    fused_level: int
    vision: str
    no_indexer: bool
    biased: bool
    flash_min: int
    prefill_gather: bool
    option_changes: dict[str, Any] = field(hash=False)
    prefix: int
    steps: tuple[Step, ...]

    def options(self, tf32: bool = True) -> QSAOptions:
        """The configured options of this profile's calls (trace defaults + changes)."""
        return QSAOptions.trace(
            **self.option_changes,
            flash_min=self.flash_min,
            prefill_gather=self.prefill_gather,
            tf32=tf32,
        )

    @property
    def calls(self) -> tuple[tuple[int, int], ...]:
        """(S, P) of each recorded step."""
        return tuple((s[1], s[2]) for s in self.steps if s[0] == "call")


def _p(
    profile: int,
    fused_level: int,
    steps: tuple[Step, ...],
    *,
    prefix: int = 0,
    vision: str = "none",
    flash_min: int = 2049,
    prefill_gather: bool = True,
    no_indexer: bool = False,
    biased: bool = False,
    **option_changes: Any,
) -> Profile:
    return Profile(
        profile, fused_level, vision, no_indexer, biased, flash_min, prefill_gather,
        dict(option_changes), prefix, steps,
    )  # fmt: skip


PROFILES: tuple[Profile, ...] = (
    _p(0, 4, (("call", 1, 0), ("call", 4, 1), ("call", 33, 5))),
    _p(1, 3, (("call", 2048, 0), ("call", 1, 2048))),
    _p(2, 4, (("call", 1, 2051), ("call", 4, 2052), ("trim", 2), ("call", 33, 2054)), prefix=2051),
    _p(3, 0, (("call", 33, 2051), ("call", 1, 2084), ("call", 4, 2085)), prefix=2051,
       flash_min=32768, compiled=False, flash=False, gather=False),
    _p(4, 3, (("call", 33, 2051), ("call", 1, 2084), ("call", 4, 2085)), prefix=2051,
       flash_min=32768, prefill_gather=False),
    _p(5, 0, (("call", 1, 2051), ("call", 4, 2052)), prefix=2051, flash_min=32768,
       fused=False, compiled=False, flash=False, gather_decode=True),
    _p(6, 4, (("call", 2048, 32768), ("call", 1, 34816), ("call", 4, 34817)), prefix=32768,
       flash_min=32768),
    _p(7, 4, (("call", 1, 2051), ("call", 4, 2052), ("trim", 2), ("call", 2, 2054),
              ("call", 1, 2056)), prefix=2051, vision="table"),
    _p(8, 0, (("call", 3, 0), ("call", 1, 3), ("call", 4, 4)), no_indexer=True, biased=True),
    _p(9, 3, (("call", 1, 2051), ("call", 4, 2052)), prefix=2051, vision="no_axes"),
)  # fmt: skip


@dataclass
class CacheModel:
    """Capacities and presence of the five states (§2.1), plus offset and pooled_len.

    A capacity of 0 means the state is absent; the mirror's capacity is always `cap_pool`.
    """

    has_indexer: bool = True
    cap_raw: int = 0
    cap_pool: int = 0
    mirror: bool = False
    cap_kv: int = 0
    offset: int = 0
    pooled_len: int = 0

    @property
    def state_present(self) -> list[bool]:
        kv = self.cap_kv > 0
        return [self.cap_raw > 0, self.cap_pool > 0, self.mirror, kv, kv]

    def shapes(self) -> list[list[int]]:
        """Physical shape of each present state, in §2.1 order."""
        out = []
        if self.cap_raw:
            out.append([1, self.cap_raw, INDEX_DIM])
        if self.cap_pool:
            out.append([1, self.cap_pool, INDEX_DIM])
        if self.mirror:
            out.append([1, 1, INDEX_DIM, self.cap_pool])
        if self.cap_kv:
            out += [[1, KV_HEADS, self.cap_kv, HEAD_DIM]] * 2
        return out

    def append_kv(self, P: int, S: int) -> None:
        grown = plan.kv_growth(self.cap_kv, P, S)
        if grown is not None:
            self.cap_kv = grown[1]
        self.offset = P + S

    def eager_indexer_write(self, T: int) -> None:
        """§5.5 steps 2–3: raw rows up to T, pool new blocks (mirror follows pooled)."""
        self.cap_raw = plan.eager_growth(self.cap_raw, T)
        nb = T // 4
        if nb > self.pooled_len:
            self.cap_pool = plan.eager_growth(self.cap_pool, nb)
            self.mirror = True
        self.pooled_len = nb

    def prefix_fill(self, prefix: int) -> None:
        """§9.3: the state of one eager forward of `prefix` rows on an empty cache."""
        if prefix == 0:
            return
        if self.has_indexer:
            self.eager_indexer_write(prefix)
        self.append_kv(0, prefix)

    def trim(self, n: int) -> int:
        """§2.4: roll back n tokens; no backing changes."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"trim(n): n must be in [0, offset={self.offset}], got {n}")
        self.offset -= n
        self.pooled_len = min(self.pooled_len, self.offset // 4)
        return n


@dataclass
class LayerModel:
    """One profile's layer: its variant, cache model and (lazily built) core receipt."""

    profile: Profile
    caps: Capabilities = field(default_factory=Capabilities.reference)
    cache: CacheModel = field(init=False)
    core: CoreReceipt | None = None

    def __post_init__(self) -> None:
        self.cache = CacheModel(has_indexer=not self.profile.no_indexer)

    def call(self, S: int, P: int, opts: QSAOptions) -> dict[str, Any]:
        """Route one call; returns consumers, counts and (library) counts of the call."""
        c = self.cache
        if P != c.offset:
            raise ValueError(f"call: P must equal the cache offset {c.offset}, got {P}")
        call = CallShape(rows=S, pos=P)
        names: list[str] = []
        selection = "none"
        if c.has_indexer:
            ip = plan.plan_indexer(
                opts,
                self.caps,
                call,
                fused_level=self.profile.fused_level,
                raw_backing=(c.cap_raw, DTYPE) if c.cap_raw else None,
                pooled_backing=(c.cap_pool, DTYPE) if c.cap_pool else None,
                pooled_len=c.pooled_len,
            )
            if ip.compiled:
                self._compiled(ip, call, opts)
            else:
                c.eager_indexer_write(call.T)
                if ip.ensure_mirror:
                    c.mirror = True
            names += ip.counts
            selection = ip.selection
        c.append_kv(P, S)
        cp = plan.plan_consumers(
            opts,
            self.caps,
            call,
            selection,
            has_indexer=c.has_indexer,
            vision=self.profile.vision,
        )
        names += cp.counts
        return {"consumers": list(cp.consumers), "names": names}

    def _compiled(self, ip: plan.IndexerPlan, call: CallShape, opts: QSAOptions) -> None:
        """§5.4: reserve buckets, dispatch the core, drop the mirror."""
        c = self.cache
        c.cap_raw, c.cap_pool = plan.compiled_reservation(
            c.cap_raw, c.cap_pool, call.pos, call.rows
        )
        width = QK_ROWS_WIDTH if ip.source == "qk_rows" else HIDDEN
        key = plan.make_compiled_key(
            source=ip.source,
            mode=ip.mode,
            rows=call.rows,
            input_width=width,
            input_dtype=DTYPE,
            cap_raw=c.cap_raw,
            cap_pool=c.cap_pool,
            raw_dtype=DTYPE,
            pooled_dtype=DTYPE,
            caps=self.caps,
            q_dtype=DTYPE,
            prefill_workspace=opts.prefill_workspace,
        )
        if self.core is None:
            self.core = CoreReceipt()
        self.core.record(key)
        c.pooled_len = call.nb
        c.mirror = False


def expected_record(
    prof: Profile, step: int, S: int, P: int, layer: LayerModel, tf32: bool
) -> dict[str, Any]:
    """Run one call on `layer` and build the non-hash fields of its record (§9.4 order)."""
    opts = prof.options(tf32)
    routed = layer.call(S, P, opts)
    c = layer.cache
    return {
        "kernel": f"qsa_attention_p{prof.profile}_s{step}",
        "profile": prof.profile,
        "step": step,
        "rows": S,
        "pos": P,
        "prefix": prof.prefix,
        "fused": prof.fused_level,
        "vision": prof.vision,
        "no_indexer": prof.no_indexer,
        "biased": prof.biased,
        "flash_min": prof.flash_min,
        "prefill_gather": prof.prefill_gather,
        "options": opts.to_trace_dict(),
        "consumers": routed["consumers"],
        "counts": plan.ordered_counts(routed["names"]),
        "offset": c.offset,
        "pooled_len": c.pooled_len,
        "state_present": c.state_present,
        "shapes": [[1, S, HIDDEN]] + c.shapes(),
        "core": layer.core.to_dict(opts.prefill_workspace) if layer.core else None,
    }


def expected_profile_records(
    prof: Profile, tf32: bool = True, caps: Capabilities | None = None
) -> list[dict[str, Any]]:
    """A fresh layer and cache: prefix fill, then every step (trims applied in order)."""
    layer = LayerModel(prof, caps or Capabilities.reference())
    layer.cache.prefix_fill(prof.prefix)
    records = []
    for item in prof.steps:
        if item[0] == "trim":
            layer.cache.trim(item[1])
            continue
        _, S, P = item
        records.append(expected_record(prof, len(records), S, P, layer, tf32))
    return records


def expected_records(caps: Capabilities | None = None) -> list[dict[str, Any]]:
    """All 56 records' non-hash fields: pass 1 (tf32 true) then pass 2 (tf32 false)."""
    out = []
    for tf32 in (True, False):
        for prof in PROFILES:
            out += expected_profile_records(prof, tf32, caps)
    return out
