"""Tensor parallelism of a QSA layer over an `mx.distributed` group (mlx-lm's `shard`).

`shard_layer(layer, group)` splits a loaded `QSAAttention` in place:

- query heads (each a query slab then a gate slab of the gated `q_proj`) go to the ranks in
  contiguous runs of H / N heads;
- key/value heads are split the same way when N divides H_kv; otherwise each rank keeps the
  key/value heads its own query heads read (`ShardLayout.kv_heads`);
- `o_proj` becomes sharded-to-all (its input columns are the rank's heads; one `all_sum`);
- the indexer stays whole on every rank (no communication; README "Tensor parallelism"
  gives the costs of the alternative), so every rank computes the same selection bits as the
  unsharded layer.

Fused matrices are split segment by segment (query+gate, key, value, indexer rows). The
layer's config is replaced by the per-rank one (H / N attention heads, the kept KV heads),
which is what drives its forward; its caches hold only the rank's K/V heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, shard_linear

from .config import QSAConfig


@dataclass(frozen=True)
class ShardLayout:
    """Which heads one rank of an N-way group holds (global head ids).

    `kv_heads[j]` is the global KV head stored as local KV head j; local query head i reads
    local KV head i // (len(heads) // len(kv_heads)). A KV head is listed more than once only
    when a rank's query heads straddle KV heads unevenly (see `plan_layout`).
    """

    size: int
    rank: int
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    split_kv: bool  # N divides H_kv: KV heads split N ways (else kept per rank)

    @property
    def key(self) -> tuple:
        """What a cache records of the group it was made for."""
        return (self.size, self.rank, self.kv_heads)


def check_group_size(cfg: QSAConfig, size: int) -> None:
    H = cfg.num_attention_heads
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"shard(group): group size must be a positive int, got {size!r}")
    if H % size != 0:
        raise ValueError(
            f"shard(group): a group of size {size} does not divide num_attention_heads={H}; "
            f"use a group size in {[n for n in range(1, H + 1) if H % n == 0]}"
        )


def plan_layout(cfg: QSAConfig, size: int, rank: int) -> ShardLayout:
    """The heads of `rank` in a `size`-way split of `cfg` (pure; raises before any change).

    When N does not divide H_kv, the rank's H / N query heads are cut into the largest equal
    runs that each read one KV head, and that KV head is kept once per run: usually a single
    run (the rank's heads all read one KV head), so the rank keeps one KV head.
    """
    check_group_size(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"shard(group): rank {rank} outside a group of size {size}")
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    Hl, G = H // size, cfg.gqa_group
    heads = tuple(range(rank * Hl, (rank + 1) * Hl))
    if Hkv % size == 0:
        n = Hkv // size
        return ShardLayout(size, rank, heads, tuple(range(rank * n, (rank + 1) * n)), True)
    for run in sorted((g for g in range(1, Hl + 1) if Hl % g == 0), reverse=True):
        blocks = [heads[i : i + run] for i in range(0, Hl, run)]
        if all(len({h // G for h in b}) == 1 for b in blocks):
            return ShardLayout(size, rank, heads, tuple(b[0] // G for b in blocks), False)
    raise AssertionError("unreachable: runs of one head always read one KV head")


def local_config(cfg: QSAConfig, layout: ShardLayout) -> QSAConfig:
    """The per-rank config: the rank's attention and KV head counts, all else unchanged."""
    return cfg.replace(
        num_attention_heads=len(layout.heads), num_key_value_heads=len(layout.kv_heads)
    )


# -- row maps of the projections (what each rank keeps, per segment) --------------------------


def _q_rows(cfg: QSAConfig, layout: ShardLayout) -> mx.array:
    """Rows of the gated q_proj for the rank's heads: per head [query d; gate d]."""
    w = 2 * cfg.head_dim
    return mx.arange(layout.heads[0] * w, (layout.heads[-1] + 1) * w, dtype=mx.int32)


def _kv_rows(cfg: QSAConfig, layout: ShardLayout) -> mx.array:
    d = cfg.head_dim
    return mx.concatenate([mx.arange(h * d, (h + 1) * d, dtype=mx.int32) for h in layout.kv_heads])


def segment_rows(cfg: QSAConfig, layout: ShardLayout, fused: int) -> dict[str, mx.array]:
    """Global row ids each rank keeps of each projection weight of fusion level `fused`.

    Level 0: `q_proj`, `k_proj`, `v_proj` (the indexer's `index_qk_proj` stays whole).
    Levels 3/4: the fused matrix's rows, segment by segment: the rank's query+gate rows,
    then its key rows, its value rows and (4) all the indexer rows.
    """
    q, kv = _q_rows(cfg, layout), _kv_rows(cfg, layout)
    if fused == 0:
        return {"q_proj": q, "k_proj": kv, "v_proj": kv}
    qw, kvw = cfg.q_proj_width, cfg.kv_proj_width
    parts = [q, qw + kv, qw + kvw + kv]
    name = "qkv_proj"
    if fused == 4:
        name = "qkvi_proj"
        e = qw + 2 * kvw
        parts.append(mx.arange(e, e + cfg.index_proj_width, dtype=mx.int32))
    return {name: mx.concatenate(parts)}


def _rows_linear(lin: nn.Linear, rows: mx.array, group: Any) -> AllToShardedLinear:
    """An `AllToShardedLinear` holding `rows` of `lin` (weight and bias)."""
    out_dims, in_dims = lin.weight.shape
    n = rows.shape[0]
    has_bias = "bias" in lin
    # The constructor's random init is lazy and is replaced before it is ever evaluated.
    sl = AllToShardedLinear(in_dims, n * group.size(), bias=has_bias, group=group)
    params = {"weight": mx.contiguous(mx.take(lin.weight, rows, axis=0))}
    if has_bias:
        params["bias"] = mx.contiguous(mx.take(lin.bias, rows, axis=0))
    sl.update(params)
    return sl


# -- the layer ------------------------------------------------------------------------------


def shard_layer(layer: Any, group: Any = None) -> None:
    """Shard a loaded `QSAAttention` in place over `group` (default: the global group).

    Every check runs before any weight changes: a group size that does not divide the query
    heads, or a layer that is already sharded, raises ValueError and leaves the layer as is.
    """
    if getattr(layer, "shard_layout", None) is not None:
        lay = layer.shard_layout
        raise ValueError(
            f"shard(group): the layer is already sharded over a group of size {lay.size} "
            f"(rank {lay.rank}); shard a layer once, after its weights are loaded"
        )
    group = group if group is not None else mx.distributed.init()
    if not hasattr(group, "size") or not hasattr(group, "rank"):
        raise ValueError(
            f"shard(group): expected an mx.distributed.Group or None, got {type(group).__name__}"
        )
    cfg = layer.config
    layout = plan_layout(cfg, group.size(), group.rank())

    rows = segment_rows(cfg, layout, layer.fused)
    new: dict[str, nn.Module] = {}
    for name, r in rows.items():
        lin = getattr(layer, name)
        if name == "q_proj":  # contiguous head slabs: MLX's even row split
            new[name] = shard_linear(lin, "all-to-sharded", group=group)
        elif name in ("k_proj", "v_proj") and layout.split_kv:
            new[name] = shard_linear(lin, "all-to-sharded", group=group)
        elif name == "qkv_proj" and layout.split_kv:
            qw, kvw = cfg.q_proj_width, cfg.kv_proj_width
            new[name] = shard_linear(lin, "all-to-sharded", segments=[qw, qw + kvw], group=group)
        else:
            new[name] = _rows_linear(lin, r, group)
    new["o_proj"] = shard_linear(layer.o_proj, "sharded-to-all", group=group)
    for name, m in new.items():
        setattr(layer, name, m)
    layer.config = local_config(cfg, layout)
    layer.full_config = cfg
    layer.group = group
    layer.shard_layout = layout
    mx.eval(layer.parameters())  # drop the references to the full matrices now


def _describe(key: tuple | None) -> str:
    if key is None:
        return "an unsharded layer (all K/V heads)"
    return f"rank {key[1]} of a group of size {key[0]} (K/V heads {list(key[2])})"


def check_cache(layer: Any, cache: Any) -> None:
    """Reject a cache made for, or restored from, another sharding of this layer.

    Runs in the layer's call validation, before anything is touched. The cache's shard
    identity comes from `make_cache` or its restored meta_state (`QSACache.shard_key`); a
    sharded layer also refuses a non-empty cache whose identity is unknown (`state`
    assigned without a meta_state) and one whose K/V arrays hold another number of heads.
    """
    mine = getattr(layer, "shard_layout", None)
    if cache.shard_known:
        theirs = cache.shard_key
        made = cache.signature is not None and cache.signature[-1] == theirs
        _check_identity(mine, theirs, made)
    elif mine is not None and not cache.empty():  # an empty cache holds no one's heads
        raise ValueError(
            f"cache: holds K/V state whose shard is unknown (its `state` was assigned without "
            f"a meta_state); this layer is {_describe(mine.key)}: restore each rank's cache "
            f"with QSACache.from_state(state, meta_state) from that rank's own save"
        )
    if mine is not None and cache.keys is not None and cache.keys.shape[1] != len(mine.kv_heads):
        raise ValueError(
            f"cache: its K/V rows hold {cache.keys.shape[1]} KV heads, this layer is "
            f"{_describe(mine.key)} and keeps {len(mine.kv_heads)}: each rank keeps its own "
            f"cache"
        )


def _check_identity(mine: ShardLayout | None, theirs: tuple | None, made: bool) -> None:
    """`made`: the cache came from make_cache (else its meta_state was restored)."""
    if mine is None and theirs is None:
        return
    if mine is not None and theirs is None:
        if made:
            raise ValueError(
                "cache: made before shard() (it holds all the K/V heads); make the cache with "
                "layer.make_cache() after layer.shard(group)"
            )
        raise ValueError(
            f"cache: restored from the state of an unsharded layer (all K/V heads), this "
            f"layer is {_describe(mine.key)}: restore each rank's cache from its own state"
        )
    how = "made by" if made else "restored from the state of"
    if mine is None:
        raise ValueError(
            f"cache: {how} a layer sharded over a group of size {theirs[0]} (rank "
            f"{theirs[1]}), this layer is not sharded"
        )
    if theirs != mine.key:
        how = "made for" if made else "restored from the state of"
        raise ValueError(
            f"cache: {how} rank {theirs[1]} of a group of size {theirs[0]}, this layer is "
            f"rank {mine.rank} of a group of size {mine.size}: each rank keeps its own cache "
            f"(K/V heads {list(theirs[2])} there, {list(mine.kv_heads)} here)"
        )


def claim_cache(layer: Any, cache: Any) -> None:
    """After a call wrote the cache: it now holds this layer's K/V heads (its shard)."""
    if not cache.shard_known:
        lay = getattr(layer, "shard_layout", None)
        cache.shard_key, cache.shard_known = (lay.key if lay is not None else None), True
