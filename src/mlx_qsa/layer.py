"""QSAAttention: projections → indexer (compiled core or eager) → KV append → consumer →
gate → o_proj (QSA.md §10–§11, RUNTIME.md §5).

The layer asks `plan` what to do and then does it; it never decides by itself. A call
stages every cache change and commits at the end, so an error leaves the cache untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import plan
from .cache import CacheUpdate, QSACache, ensure_rows, kv_append, row_index, write_rows
from .config import QSAConfig, QSAOptions
from .consumers import dispatch
from .core import CoreInputs, IndexerCore
from .device_arrays import int_arange
from .indexer import (
    IndexerGeometry,
    QSAIndexer,
    Selection,
    block_penalty,
    dense_keep_mask,
    pool_blocks,
    prepare_queries,
    row_token_slots,
    select_row_tokens,
    select_rows,
    split_qk_rows,
)
from .kernels import resolve_impl
from .rope import (
    norm_rope,
    prepare_device_constants,
    rope_tables,
    text_positions,
    text_rope,
)
from .sharding import check_cache, claim_cache, shard_layer

FUSED_LEVELS = (0, 3, 4)
_DTYPES = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}
_KV_PROJ = {0: "k_proj", 3: "qkv_proj", 4: "qkvi_proj"}  # K rows' projection by `fused`


@dataclass(frozen=True)
class VisionState:
    """A request's vision RoPE state (RUNTIME.md §1.3): `table` int32 `[3, L]`, `delta`."""

    table: mx.array
    delta: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.table, mx.array) or self.table.ndim != 2 or self.table.shape[0] != 3:
            shape = list(self.table.shape) if isinstance(self.table, mx.array) else self.table
            raise ValueError(f"VisionState.table: expected an int array [3, L], got {shape}")
        if self.table.dtype not in (mx.int32, mx.int64, mx.uint32):
            raise ValueError(f"VisionState.table: expected int32, got {self.table.dtype}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, int):
            raise ValueError(f"VisionState.delta: expected an int, got {self.delta!r}")


@dataclass
class CallInfo:
    """What the last call did (the observable routing of RUNTIME §5)."""

    rows: int
    pos: int
    mode: str | None
    compiled: bool
    selection: str
    selector: str
    consumers: tuple[str, ...]
    counts: dict[str, int]
    library_counts: dict[str, int] = field(default_factory=dict)


def _dtype_name(dtype: mx.Dtype) -> str:
    name = _DTYPES.get(dtype)  # no str() of the dtype unless it is needed: 9 calls a layer step
    return name if name is not None else str(dtype).removeprefix("mlx.core.")


class QSAAttention(nn.Module):
    """One QSA attention layer (batch 1). `layer(x, cache=cache, vision=None) -> y`.

    x: `[1, S, hidden_size]`; y: same shape. `fused` is the projection-fusion level
    (0 separate, 3 `qkv_proj`, 4 `qkvi_proj` incl. the indexer); it is forced to 0 for biased
    layers and layers without an indexer (RUNTIME §1.1).
    """

    def __init__(
        self,
        config: QSAConfig,
        options: QSAOptions | None = None,
        fused: int = 0,
        capabilities: plan.Capabilities | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, QSAConfig):
            raise ValueError(f"config: expected a QSAConfig, got {type(config).__name__}")
        if fused not in FUSED_LEVELS:
            raise ValueError(f"fused: expected one of {FUSED_LEVELS}, got {fused!r}")
        if options is not None and not isinstance(options, QSAOptions):
            raise ValueError(f"options: expected a QSAOptions, got {type(options).__name__}")
        self.config = config
        self.options = options or QSAOptions()
        self.capabilities = capabilities or plan.Capabilities.reference()
        prepare_device_constants()
        self.requested_fused = fused
        if config.attention_bias or not config.has_indexer:
            fused = 0
        self.fused = fused
        D, bias = config.hidden_size, config.attention_bias
        qw, kvw = config.q_proj_width, config.kv_proj_width
        if fused == 0:
            self.q_proj = nn.Linear(D, qw, bias=bias)
            self.k_proj = nn.Linear(D, kvw, bias=bias)
            self.v_proj = nn.Linear(D, kvw, bias=bias)
        elif fused == 3:
            self.qkv_proj = nn.Linear(D, qw + 2 * kvw, bias=False)
        else:
            self.qkvi_proj = nn.Linear(D, qw + 2 * kvw + config.index_proj_width, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, D, bias=bias)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        if config.has_indexer:
            self.indexer = QSAIndexer(config, with_projection=fused != 4)
            self._geometry = IndexerGeometry.of(config)
        self._core: IndexerCore | None = None
        self.counters: dict[str, int] = dict.fromkeys(plan.LIBRARY_COUNTERS, 0)
        self.last_call: CallInfo | None = None
        self.shard_layout = None  # set by shard(): this rank's heads (sharding.ShardLayout)

    # -- construction helpers ----------------------------------------------------------
    @classmethod
    def from_hf(
        cls,
        config_dict: dict[str, Any],
        weights: dict[str, mx.array],
        fused: int = 0,
        options: QSAOptions | None = None,
        zero_centered_norms: bool | None = None,
        capabilities: plan.Capabilities | None = None,
    ) -> QSAAttention:
        """Build a layer from HF-named tensors (keys relative to `self_attn.`).

        HF checkpoints store zero-centred norm weights (the norm multiplies by `1 + w`);
        they are folded to the plain form on load (QSA.md §3). Weights that `sanitize`
        already converted (its `SanitizedWeights`, or fused keys) are loaded as they are,
        never folded twice. `zero_centered_norms`: None detects from the source format,
        True insists on a checkpoint, False means the norms are already plain (see
        `weights.sanitize`).
        """
        from .weights import sanitize

        cfg = QSAConfig.from_dict(config_dict)
        layer = cls(cfg, options=options, fused=fused, capabilities=capabilities)
        layer.load_weights(
            list(
                sanitize(
                    weights, cfg, fused=layer.fused, zero_centered_norms=zero_centered_norms
                ).items()
            )
        )
        return layer

    @property
    def impl(self) -> str:
        """Which implementation runs the selector and consumers: "cuda" or "portable"
        (`options.kernels` and the default device decide; routing does not depend on it)."""
        return resolve_impl(self.options.kernels)

    def make_cache(self) -> QSACache:
        cfg = self.config
        c = QSACache(
            index_head_dim=cfg.indexer_head_dim or 0,
            has_indexer=cfg.has_indexer,
            ratio=cfg.indexer_compress_ratio or 4,
        )
        c.signature = self._signature()
        c.shard_key = self.shard_layout.key if self.shard_layout is not None else None
        c.shard_known = True
        return c

    def _signature(self) -> tuple:
        c = self.config
        shard = self.shard_layout.key if self.shard_layout is not None else None
        return (
            c.num_key_value_heads,
            c.head_dim,
            c.indexer_head_dim,
            c.indexer_compress_ratio,
            shard,
        )

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        """Tensor-parallel split over `group` (default: the global group), in place, after
        the weights are loaded (mlx-lm's convention; see `sharding.shard_layer`)."""
        shard_layer(self, group)

    @property
    def core(self) -> IndexerCore | None:
        """The compiled indexer core (None until the first compiled call)."""
        return self._core

    # -- validation ----------------------------------------------------------------------
    def _check_call(self, x: mx.array, cache: QSACache, vision: VisionState | None) -> None:
        cfg = self.config
        if not isinstance(x, mx.array):
            raise ValueError(
                f"x: expected an mx.array [1, S, {cfg.hidden_size}], got {type(x).__name__}"
            )
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != cfg.hidden_size or x.shape[1] < 1:
            raise ValueError(
                f"x: expected shape [1, S >= 1, {cfg.hidden_size}], got {list(x.shape)}"
            )
        if x.dtype not in _DTYPES:
            raise ValueError(f"x: expected dtype bfloat16, float16 or float32, got {x.dtype}")
        if not isinstance(cache, QSACache):
            raise ValueError(f"cache: expected a QSACache, got {type(cache).__name__}")
        check_cache(self, cache)
        if cache.signature is not None and cache.signature != self._signature():
            raise ValueError(
                f"cache: made for a layer with geometry {cache.signature}, this "
                f"layer has {self._signature()}"
            )
        if cache.has_indexer != cfg.has_indexer:
            raise ValueError("cache: indexer presence differs from this layer's")
        # A restored cache (from_state) carries no signature: check its arrays' geometry.
        if cfg.has_indexer and cache.index_head_dim != cfg.indexer_head_dim:
            raise ValueError(
                f"cache: index head dim {cache.index_head_dim}, this layer has "
                f"{cfg.indexer_head_dim}"
            )
        # A restored cache's block size must be this layer's (trim rounds pooled_len by it).
        if cfg.has_indexer and cache.ratio != cfg.indexer_compress_ratio:
            raise ValueError(
                f"cache: block size (compress ratio) {cache.ratio}, this layer has "
                f"{cfg.indexer_compress_ratio}"
            )
        kv = (cfg.num_key_value_heads, cfg.head_dim)
        if cache.keys is not None and (cache.keys.shape[1], cache.keys.shape[3]) != kv:
            raise ValueError(
                f"cache: K/V rows are [H_kv, d] = {[cache.keys.shape[1], cache.keys.shape[3]]}, "
                f"this layer has {list(kv)}"
            )
        if vision is not None and not isinstance(vision, VisionState):
            raise ValueError(f"vision: expected a VisionState or None, got {type(vision).__name__}")
        if cache.offset + x.shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"x: positions up to {cache.offset + x.shape[1] - 1} exceed "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        if cache.keys is not None and cache.keys.dtype != self._kv_dtype(x):
            raise ValueError(
                f"x: dtype {x.dtype} gives K/V of dtype {self._kv_dtype(x)}, the "
                f"cache holds {cache.keys.dtype}"
            )

    def _kv_dtype(self, x: mx.array) -> mx.Dtype:
        """dtype of the K/V rows this input produces (projection output promotion)."""
        # The promotion rule itself, not a probe graph (every call pays for its primitives);
        # the module's own mapping (nn.Module is a dict) instead of attribute fallbacks.
        return mx.result_type(x.dtype, self[_KV_PROJ[self.fused]]["weight"].dtype)

    # -- projections -----------------------------------------------------------------------
    def _project(
        self, x: mx.array, with_query: bool = True
    ) -> tuple[mx.array | None, mx.array, mx.array, mx.array | None]:
        """q_proj / k_proj / v_proj outputs and, at level 4, the indexer's 640 columns.

        Without the query (state-only prefill) a fused matrix is applied without its query
        rows; the GEMM is exact per output column, so the states keep their bits.
        """
        cfg = self.config
        qw, kvw = cfg.q_proj_width, cfg.kv_proj_width
        if self.fused == 0:
            q = self.q_proj(x) if with_query else None
            return q, self.k_proj(x), self.v_proj(x), None
        fused = self.qkv_proj if self.fused == 3 else self.qkvi_proj
        if with_query:
            u = fused(x)
        else:
            u = x @ fused.weight[qw:].T
            qw = 0
        # One split (views) instead of a slice per part: one MLX primitive, not three or four.
        cuts = [qw, qw + kvw, qw + 2 * kvw] if self.fused == 4 else [qw, qw + kvw]
        parts = mx.split(u, cuts, axis=-1)
        q = parts[0] if with_query else None
        return q, parts[1], parts[2], parts[3] if self.fused == 4 else None

    # -- the call ---------------------------------------------------------------------------
    def __call__(
        self, x: mx.array, cache: QSACache | None = None, vision: VisionState | None = None
    ) -> mx.array:
        if cache is None:
            cache = self.make_cache()
        self._check_call(x, cache, vision)
        return self._forward(x, cache, vision, state_only=False)

    def prefill_state(self, x: mx.array, cache: QSACache) -> None:
        """Write the states of rows `x` without computing attention (state-only prefill).

        Gives the same states as one eager forward of those rows (RUNTIME §9.3 prefix fill);
        the compiled core is not touched and no counter moves.
        """
        self._check_call(x, cache, None)
        self._forward(x, cache, None, state_only=True)

    def _forward(
        self, x: mx.array, cache: QSACache, vision: VisionState | None, state_only: bool
    ) -> mx.array | None:
        cfg, opts = self.config, self.options
        B, S, _ = x.shape
        P = cache.offset
        T = P + S
        H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        u = cache.staged()

        q_lin, k_lin, v_lin, qk_rows = self._project(x, with_query=not state_only)
        # Attention RoPE at text positions `[S]` or MRoPE ones `[3, S]`. Text tables come from
        # `text_rope`, shared with the indexer's rows, the consumers and the model's other
        # layers at this step (every MLX primitive costs host time).
        if vision is None or not cfg.has_mrope_axes:
            _, cos, sin = text_rope(cfg, P, T)
        else:
            cos, sin = rope_tables(_vision_positions(vision, P, T), cfg)
        prep = _qk_prep(
            H, Hkv, d, cfg.rotary_dim, cfg.rms_norm_eps, S <= COMPILED_PREP_MAX_ROWS, self.impl
        )
        if q_lin is not None:
            q, k, gate = prep(q_lin, k_lin, self.q_norm.weight, self.k_norm.weight, cos, sin)
        else:
            k = prep(None, k_lin, None, self.k_norm.weight, cos, sin)[0]
        v = v_lin.reshape(1, S, Hkv, d).transpose(0, 2, 1, 3)

        call = plan.CallShape(S, P, cfg.indexer_compress_ratio or 4, cfg.block_topk or 512)
        rows = text_rope(cfg, P, T)[0]  # the rows' indices: every write of this call
        selection = Selection("none")
        iplan = None
        if cfg.has_indexer:
            iplan = self._plan_indexer(x, call, u) if not state_only else None
            source = qk_rows if qk_rows is not None else x
            if iplan is not None and iplan.compiled:
                selection = self._compiled_indexer(source, call, u, iplan, vision, rows)
            else:
                selection = self._eager_indexer(source, call, u, iplan, vision, rows)

        kv_append(u, k, v, rows)
        if state_only:
            cache.commit(u)
            claim_cache(self, cache)
            return None

        vision_kind = "none" if vision is None else ("table" if cfg.has_mrope_axes else "no_axes")
        contract = plan.prefill_flash_contract(
            n_heads=H,
            kv_heads=Hkv,
            head_dim=d,
            block_topk=cfg.block_topk,
            dtype=_dtype_name(x.dtype),
            scale=cfg.scale,
        )
        cplan = plan.plan_consumers(
            opts,
            self.capabilities,
            call,
            selection.kind,
            has_indexer=cfg.has_indexer,
            vision=vision_kind,
            prefill_flash_contract=contract,
        )
        o = dispatch(
            cplan,
            q,
            u.keys,
            u.values,
            selection,
            rows,
            T,
            cfg.indexer_compress_ratio or 4,
            cfg.scale,
            self.impl,
            gate=gate,
        )  # gated: [1, S, H, d]
        o = o.reshape(1, S, H * d)
        y = self.o_proj(o)

        cache.commit(u)
        claim_cache(self, cache)
        names = (iplan.counts if iplan else ()) + cplan.counts
        self.last_call = CallInfo(
            rows=S,
            pos=P,
            mode=iplan.mode if iplan else None,
            compiled=bool(iplan and iplan.compiled),
            selection=selection.kind,
            selector=iplan.selector if iplan else "none",
            consumers=cplan.consumers,
            counts=plan.ordered_counts(names),
            library_counts=plan.ordered_counts(names, False),
        )
        for n in names:
            self.counters[n] += 1
        return y

    # -- indexer ----------------------------------------------------------------------------
    def _plan_indexer(self, x: mx.array, call: plan.CallShape, u: CacheUpdate) -> plan.IndexerPlan:
        cfg = self.config
        raw = (
            (u.raw_keys.shape[1], _dtype_name(u.raw_keys.dtype)) if u.raw_keys is not None else None
        )
        pooled = (u.pooled.shape[1], _dtype_name(u.pooled.dtype)) if u.pooled is not None else None
        return plan.plan_indexer(
            self.options,
            self.capabilities,
            call,
            fused_level=self.fused,
            index_kv_heads=cfg.indexer_kv_heads,
            index_head_dim=cfg.indexer_head_dim,
            input_dtype=_dtype_name(x.dtype),
            norm_dtype=_dtype_name(self.indexer.q_layernorm.weight.dtype),
            raw_backing=raw,
            pooled_backing=pooled,
            pooled_len=u.pooled_len,
        )

    def _vision_sparse(self, vision: VisionState | None) -> bool:
        """Whether the indexer takes MRoPE positions (the `vision_sparse` opt-in)."""
        return vision is not None and self.options.vision_sparse and self.config.has_mrope_axes

    def _index_tables(
        self, P: int, T: int, vision: VisionState | None
    ) -> tuple[mx.array, mx.array]:
        """RoPE tables at the rows' indexer positions (this call's text tables unless
        `vision_sparse`)."""
        if self._vision_sparse(vision):
            return rope_tables(_vision_positions(vision, P, T), self.config)
        return text_rope(self.config, P, T)[1:]

    def _block_tables(
        self, first_block: int, n_blocks: int, vision: VisionState | None
    ) -> tuple[mx.array, mx.array]:
        """RoPE tables at blocks' first tokens (text ones shared across layers and steps).
        With `vision_sparse` each block takes its first token's own position, so its key does
        not depend on which call or staging window pools it (eager pooling == compiled window
        pooling)."""
        r = self._geometry.ratio
        start, stop = first_block * r, (first_block + n_blocks) * r
        if self._vision_sparse(vision):
            tokens = text_positions(start, stop, r)
            return rope_tables(_vision_token_positions(vision, tokens), self.config)
        return text_rope(self.config, start, stop, r)[1:]

    def _index_z(self, source: mx.array) -> mx.array:
        if self.fused == 4:
            return source
        return self.indexer.index_qk_proj(source)

    def _compiled_indexer(
        self,
        source: mx.array,
        call: plan.CallShape,
        u: CacheUpdate,
        iplan: plan.IndexerPlan,
        vision: VisionState | None,
        rows: mx.array,
    ) -> Selection:
        cfg, g = self.config, self._geometry
        P, S, T, nb, m = call.pos, call.rows, call.T, call.nb, call.m
        cap_raw0 = u.raw_keys.shape[1] if u.raw_keys is not None else 0
        cap_pool0 = u.pooled.shape[1] if u.pooled is not None else 0
        cap_raw, cap_pool = plan.compiled_reservation(cap_raw0, cap_pool0, P, S, g.ratio)
        dt = source.dtype
        raw = ensure_rows(u.raw_keys, cap_raw, 1, ((1, 1, g.head_dim), dt))
        pooled = ensure_rows(u.pooled, cap_pool, 1, ((1, 1, g.head_dim), dt))
        key = plan.make_compiled_key(
            source=iplan.source,
            mode=iplan.mode,
            rows=S,
            input_width=source.shape[2],
            input_dtype=_dtype_name(dt),
            cap_raw=cap_raw,
            cap_pool=cap_pool,
            raw_dtype=_dtype_name(raw.dtype),
            pooled_dtype=_dtype_name(pooled.dtype),
            caps=self.capabilities,
            q_dtype=_dtype_name(dt),
            n_heads=g.n_heads,
            kv_heads=cfg.indexer_kv_heads,
            head_dim=g.head_dim,
            block_topk=g.block_topk,
            compress_ratio=g.ratio,
            prefill_workspace=self.options.prefill_workspace,
        )
        start = plan.staging_window_start(nb, m, u.pooled_len, cap_raw, cap_pool, g.ratio)
        cos_r, sin_r = self._index_tables(P, T, vision)
        cos_w, sin_w = self._block_tables(start, m, vision)
        inputs = CoreInputs(
            source=source,
            proj_w=None if self.fused == 4 else self.indexer.index_qk_proj.weight,
            q_norm_w=self.indexer.q_layernorm.weight,
            k_norm_w=self.indexer.k_layernorm.weight,
            raw=raw,
            pooled=pooled,
            cos_rows=cos_r,
            sin_rows=sin_r,
            cos_win=cos_w,
            sin_win=sin_w,
            positions=rows,
            win_start=_window_start(start),
            penalty=block_penalty(cap_pool),
        )
        if self._core is None:
            self._core = IndexerCore(g)
        out = self._core.dispatch(key, m, inputs, self.impl)
        u.raw_keys, u.pooled = out[0], out[1]
        u.pooled_f32_t = None  # the graph rewrote `pooled` wholesale (RUNTIME §2.3 c)
        u.pooled_len = nb
        return self._selection_from_outputs(iplan.mode, out[2:], T)

    def _selection_from_outputs(self, mode: str, out: tuple, T: int) -> Selection:
        if mode == "update_only":
            return Selection("none")
        if mode in ("blocks", "prefill_blocks"):
            ids, valid, scores = out
            return Selection(
                mode,
                ids=ids,
                valid=valid,
                scores=scores,
                tail_start=T // self._geometry.ratio * self._geometry.ratio,
            )
        if mode == "row_tokens":
            return Selection(mode, slots=out[0], slot_valid=out[1])
        return Selection("dense_mask", mask=out[0][:, :T][None, None])

    def _eager_indexer(
        self,
        source: mx.array,
        call: plan.CallShape,
        u: CacheUpdate,
        iplan: plan.IndexerPlan | None,
        vision: VisionState | None,
        rows: mx.array,
    ) -> Selection:
        """RUNTIME §5.5 (iplan None: state-only prefill, no selection)."""
        g = self._geometry
        P, S, T, nb = call.pos, call.rows, call.T, call.nb
        z = self._index_z(source)
        q_raw, k_raw = split_qk_rows(z, g)
        dt = k_raw.dtype
        cap_raw = u.raw_keys.shape[1] if u.raw_keys is not None else 0
        new_cap = plan.eager_growth(cap_raw, T)
        raw = ensure_rows(u.raw_keys, new_cap, 1, ((1, 1, g.head_dim), dt))
        u.raw_keys = write_rows(raw, k_raw, rows, 1)

        if nb > u.pooled_len:
            b0, n = u.pooled_len, nb - u.pooled_len
            cos_b, sin_b = self._block_tables(b0, n, vision)
            blocks = pool_blocks(
                u.raw_keys, b0, n, self.indexer.k_layernorm.weight, cos_b, sin_b, g, self.impl
            )
            cap_pool = u.pooled.shape[1] if u.pooled is not None else 0
            pooled = ensure_rows(
                u.pooled, plan.eager_growth(cap_pool, nb), 1, ((1, 1, g.head_dim), dt)
            )
            block_rows = row_index(b0, n)  # one index array for the pooled and mirror writes
            u.pooled = write_rows(pooled, blocks, block_rows, 1)
            if u.pooled_f32_t is None:
                u.pooled_f32_t = _mirror_of(u.pooled)
            else:
                mirror = ensure_rows(
                    u.pooled_f32_t, u.pooled.shape[1], 3, ((1, 1, g.head_dim, 1), mx.float32)
                )
                u.pooled_f32_t = write_rows(
                    mirror, blocks.astype(mx.float32).transpose(0, 2, 1)[None], block_rows, 3
                )
        u.pooled_len = nb

        if iplan is None or iplan.selection == "none":
            return Selection("none")
        if iplan.ensure_mirror and u.pooled_f32_t is None:
            u.pooled_f32_t = _mirror_of(u.pooled)
        keys_t = (
            u.pooled_f32_t[0, 0] if iplan.selector == "oracle" else u.pooled[0].astype(mx.float32).T
        )
        cos_q, sin_q = self._index_tables(P, T, vision)
        q = prepare_queries(q_raw, self.indexer.q_layernorm.weight, cos_q, sin_q, g, self.impl)
        chunk = self._eager_chunk(iplan, S, keys_t.shape[1], q.dtype, u.pooled.dtype)
        kind = iplan.selection
        args = (q, keys_t, block_penalty(keys_t.shape[1]), rows, g.ratio, g.block_topk, chunk)
        if kind == "row_tokens":
            slots, slot_valid = select_row_tokens(*args, u.pooled, self.impl)
            return Selection(kind, slots=slots, slot_valid=slot_valid)
        ids, valid, scores = select_rows(*args, u.pooled, self.impl)
        if kind in ("blocks", "prefill_blocks"):
            return Selection(
                kind, ids=ids, valid=valid, scores=scores, tail_start=T // g.ratio * g.ratio
            )
        if kind == "token_list":
            slots, _ = row_token_slots(ids, valid, rows, g.ratio)
            k_eff = min(g.block_topk, nb)
            tail = T % g.ratio
            w = g.block_topk * g.ratio
            tokens = mx.concatenate([slots[0, : k_eff * g.ratio], slots[0, w : w + tail]])
            return Selection(kind, slots=tokens)
        mask = dense_keep_mask(ids, valid, rows, T, g.ratio)
        return Selection("dense_mask", mask=mask[None, None])

    def _eager_chunk(
        self,
        iplan: plan.IndexerPlan,
        S: int,
        n_blocks: int,
        q_dtype: mx.Dtype,
        pooled_dtype: mx.Dtype,
    ) -> int:
        """Rows per eager scoring pass: the oracle's tile_rows, else the §6.3 plans."""
        opts = self.options
        if iplan.selector == "oracle" and 0 < opts.tile_rows < S:
            return opts.tile_rows
        if iplan.selection == "prefill_blocks":
            producer = plan.prefill_score_producer(
                self.capabilities, _dtype_name(q_dtype), _dtype_name(pooled_dtype)
            )
            return plan.selector_chunk_rows(
                "prefill_blocks",
                S,
                n_blocks,
                producer=producer,
                prefill_workspace=opts.prefill_workspace,
            )
        return plan.selector_chunk_rows("blocks", S, n_blocks)


# Decode and verify widths take the compiled q/k preparation (a bounded set of traced shapes;
# fewer MLX primitives per step); wider calls run the same routine eagerly (the same bits: the
# routines are written for mx.compile, rope.py).
COMPILED_PREP_MAX_ROWS = 16


@lru_cache(maxsize=64)
def _qk_prep(
    n_heads: int,
    kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    eps: float,
    compiled: bool,
    impl: str = "portable",
):
    """Per-head RMSNorm then partial RoPE of the query half of q_proj (QSA.md §4) and of k:
    `prep(q_lin | None, k_lin, q_norm_w, k_norm_w, cos, sin) -> (q, k, gate) | (k,)`: q and k
    `[1, heads, S, d]`, the output gate's logits `[1, S, heads, d]` (`impl`: the
    implementation of the norms and the RoPE, `rope.norm` and `rope.rope`)."""

    heads_first = (0, 2, 1, 3)

    def k_part(k_lin, k_w, cos, sin):
        S = k_lin.shape[1]
        k = k_lin.reshape(1, S, kv_heads, head_dim)
        return norm_rope(k, k_w, eps, cos, sin, rotary_dim, impl, heads_first)

    def both(q_lin, k_lin, q_w, k_w, cos, sin):
        S = q_lin.shape[1]
        # q_proj's rows are (query, gate) per head: one reshape and one split (views) for both
        q_half, gate = mx.split(q_lin.reshape(1, S, n_heads, 2, head_dim), 2, axis=3)
        q = norm_rope(q_half.squeeze(3), q_w, eps, cos, sin, rotary_dim, impl, heads_first)
        return q, k_part(k_lin, k_w, cos, sin), gate.squeeze(3)

    def only_k(k_lin, k_w, cos, sin):
        return (k_part(k_lin, k_w, cos, sin),)

    run_both = mx.compile(both) if compiled else both
    run_k = mx.compile(only_k) if compiled else only_k

    def prep(q_lin, k_lin, q_w, k_w, cos, sin):
        if q_lin is None:
            return run_k(k_lin, k_w, cos, sin)
        return run_both(q_lin, k_lin, q_w, k_w, cos, sin)

    return prep


@lru_cache(maxsize=64)
def _window_start(start: int) -> mx.array:
    """The staging window's first block as the core's int32 `[1]` input, made once per value:
    a model's layers at one step and a window's steps share it (each host-made array costs
    host time and a copy to the device when evaluated). Made on the device, past 8 bytes
    (`device_arrays`)."""
    return int_arange(start, start + 1)


def _mirror_of(pooled: mx.array) -> mx.array:
    return pooled.astype(mx.float32).transpose(0, 2, 1)[None]


def _vision_token_positions(vision: VisionState, tokens: mx.array) -> mx.array:
    """MRoPE positions `[3, n]` token by token: the table column inside it, else + delta."""
    L = vision.table.shape[1]
    shifted = mx.broadcast_to((tokens + vision.delta)[None, :], (3, tokens.shape[0]))
    if L == 0:
        return shifted
    cols = mx.take(vision.table.astype(mx.int32), mx.minimum(tokens, L - 1), axis=1)
    return mx.where((tokens < L)[None, :], cols, shifted)


def _vision_positions(vision: VisionState, start: int, stop: int, step: int = 1) -> mx.array:
    """MRoPE positions `[3, n]` of tokens start, start+step, ... < stop (RUNTIME §1.3)."""
    L = vision.table.shape[1]
    tokens = text_positions(start, stop, step)
    if 0 <= start and stop <= L:
        return mx.take(vision.table.astype(mx.int32), tokens, axis=1)
    return mx.broadcast_to((tokens + vision.delta)[None, :], (3, tokens.shape[0]))
