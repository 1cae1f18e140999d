"""QSACache: the five per-layer states of RUNTIME.md §2, in mlx-lm's cache protocol.

States (order fixed): 0 `raw_keys` [1, cap_raw, d_I], 1 `pooled` [1, cap_pool, d_I],
2 `pooled_f32_t` [1, 1, d_I, cap_pool] float32 mirror, 3 `keys` [1, H_kv, cap_kv, d],
4 `values` [1, H_kv, cap_kv, d]. Backings are positional (row = absolute token / block) and
grow by the rules of `plan` (KV step 256, eager doubling, compiled power-of-two buckets).

The layer never mutates a cache mid-call: it builds new backings with functional row
writes and commits them all at the end (`CacheUpdate`), so an error raised anywhere in a
call leaves the cache exactly as it was. Because MLX is lazy, the old backing has no other
reference by evaluation time and MLX reuses its buffer (no copy per decode step).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import plan
from .device_arrays import int_arange

STATE_NAMES = ("raw_keys", "pooled", "pooled_f32_t", "keys", "values")
# Presence pattern of a saved state is fixed by how many arrays it has (RUNTIME §2.1:
# pooled needs raw, the mirror needs pooled, K/V exist from the first call on).
_PATTERNS = {
    0: (False, False, False, False, False),
    2: (False, False, False, True, True),
    3: (True, False, False, True, True),
    4: (True, True, False, True, True),
    5: (True, True, True, True, True),
}


def grow_rows(
    backing: mx.array | None, axis: int, keep: int, new_cap: int, like: tuple
) -> mx.array:
    """A zero-filled backing of `new_cap` rows along `axis` holding the first `keep` old rows.

    `like` = (shape with any row count, dtype) used when there is no old backing.
    """
    shape, dtype = like
    shape = list(shape)
    if backing is None or keep == 0:
        shape[axis] = new_cap
        return mx.zeros(shape, dtype=dtype)
    old = mx.take(backing, mx.arange(keep), axis=axis) if keep < backing.shape[axis] else backing
    shape = list(old.shape)
    shape[axis] = new_cap - keep
    return mx.concatenate([old, mx.zeros(shape, dtype=old.dtype)], axis=axis)


def row_index(start: int, n: int) -> mx.array:
    """int32 `[n]` row indices start, ..., start + n - 1 (for `write_rows`; the scatter
    kernel reads them, so one or two are not left in MLX's 8-byte managed pool)."""
    return int_arange(start, start + n)


def write_rows(backing: mx.array, rows: mx.array, index: mx.array, axis: int) -> mx.array:
    """`rows` written into `backing` at the int32 row indices `index` along `axis` (a
    functional update; MLX reuses the backing's buffer when nothing else holds it). `index` is
    `[n]`, or already of `rows`' shape (one index array shared by writes of equal shape).

    A scatter, not `mx.slice_update` with an array start: MLX 0.32's CUDA dynamic slice update
    launches one thread per element of the whole backing (each rewriting the update), which
    made a decode step's K/V write cost O(context) — 0.5 ms per write at 128K on an H200. The
    scatter's work is the update's size on every backend."""
    if index.ndim != backing.ndim:
        shape = [1] * backing.ndim
        shape[axis] = index.shape[0]
        index = index.reshape(shape)
    return mx.put_along_axis(backing, index, rows.astype(backing.dtype), axis=axis)


@dataclass
class CacheUpdate:
    """New values of a cache's fields, staged during a call and committed at its end."""

    raw_keys: mx.array | None
    pooled: mx.array | None
    pooled_f32_t: mx.array | None
    keys: mx.array | None
    values: mx.array | None
    offset: int
    pooled_len: int


class QSACache:
    """Per-layer, per-sequence QSA state (batch 1).

    `offset` is the number of tokens written; `pooled_len` the number of logical block keys.
    """

    def __init__(self, index_head_dim: int = 128, has_indexer: bool = True, ratio: int = 4) -> None:
        self.index_head_dim = index_head_dim
        self.has_indexer = has_indexer
        # Block size r: trim must keep pooled_len <= offset // r for the layer's own r
        # (a fixed 4 left a stale block "complete" at r = 8, so the eager path never re-pooled
        # it after a rollback, and under-counted blocks at r = 2).
        self.ratio = ratio
        self.raw_keys: mx.array | None = None
        self.pooled: mx.array | None = None
        self.pooled_f32_t: mx.array | None = None
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.pooled_len = 0
        # Set by QSAAttention.make_cache: the layer geometry this cache was made for.
        self.signature: tuple | None = None
        # Whose K/V heads the arrays hold: a sharded layer's `ShardLayout.key` (group size,
        # rank, global KV heads) or None for all heads (unsharded). Known once the cache is
        # made by a layer, restored with a meta_state, or first written; assigning `state`
        # alone makes it unknown again (the arrays may come from any rank).
        self.shard_key: tuple | None = None
        self.shard_known = False

    # -- mlx-lm protocol ----------------------------------------------------------------
    @property
    def state(self) -> tuple[mx.array, ...]:
        """The present arrays, in state order (absent ones are left out)."""
        return tuple(a for a in self.states() if a is not None)

    @state.setter
    def state(self, arrays: tuple[mx.array, ...]) -> None:
        arrays = tuple(arrays)
        if len(arrays) == 5 and any(a is None for a in arrays):
            full = arrays
        else:
            if len(arrays) not in _PATTERNS:
                raise ValueError(
                    f"state: expected 0, 2, 3, 4 or 5 arrays (present states in order), "
                    f"got {len(arrays)}"
                )
            it = iter(arrays)
            full = tuple(next(it) if p else None for p in _PATTERNS[len(arrays)])
        _check_states(full, self.index_head_dim)
        (self.raw_keys, self.pooled, self.pooled_f32_t, self.keys, self.values) = full
        self.shard_key, self.shard_known = None, False  # until a meta_state says whose

    @property
    def meta_state(self) -> tuple[str, ...]:
        """offset, pooled_len, presence bits, index head dim, has_indexer, ratio (6 strings;
        a 5-string meta_state from before the ratio was stored is read as ratio 4). A sharded
        layer's cache adds a 7th, its shard identity `"size:rank:kv,kv,..."`."""
        bits = "".join("1" if p else "0" for p in self.state_present)
        meta = (
            str(self.offset),
            str(self.pooled_len),
            bits,
            str(self.index_head_dim),
            "1" if self.has_indexer else "0",
            str(self.ratio),
        )
        if self.shard_key is not None:
            meta += (encode_shard_key(self.shard_key),)
        return meta

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        # Validate everything first, assign last: a rejected meta_state changes nothing.
        offset, pooled_len, bits, index_head_dim, has_indexer, ratio = _parse_meta(v)
        shard = decode_shard_key(v[6]) if len(v) == 7 else None
        present = tuple(c == "1" for c in bits)
        if present != self.state_present:
            raise ValueError(
                f"meta_state: presence bits {bits} do not match the state arrays "
                f"{''.join('1' if p else '0' for p in self.state_present)}"
            )
        cap_kv = self.keys.shape[2] if self.keys is not None else 0
        if not 0 <= offset <= cap_kv:
            raise ValueError(f"meta_state: offset must be in [0, cap_kv={cap_kv}], got {offset}")
        if not 0 <= pooled_len <= offset // ratio + 1 or (self.pooled is None and pooled_len):
            raise ValueError(f"meta_state: pooled_len {pooled_len} inconsistent with offset")
        if shard is not None and self.keys is not None and self.keys.shape[1] != len(shard[2]):
            raise ValueError(
                f"meta_state: shard identity {v[6]!r} names {len(shard[2])} K/V heads, the "
                f"state arrays hold {self.keys.shape[1]}"
            )
        self.index_head_dim, self.has_indexer = index_head_dim, has_indexer
        self.ratio = ratio
        self.offset, self.pooled_len = offset, pooled_len
        self.shard_key, self.shard_known = shard, True

    @classmethod
    def from_state(cls, state: tuple[mx.array, ...], meta_state: tuple[str, ...]) -> QSACache:
        _, _, _, index_head_dim, has_indexer, ratio = _parse_meta(meta_state)
        obj = cls(index_head_dim=index_head_dim, has_indexer=has_indexer, ratio=ratio)
        obj.state = state
        obj.meta_state = meta_state
        return obj

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Roll back the last `n` tokens (speculative rejection). Returns `n`."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.offset:
            raise ValueError(f"trim(n): n must be in [0, offset={self.offset}], got {n!r}")
        self.offset -= n
        self.pooled_len = min(self.pooled_len, self.offset // self.ratio)
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    # -- introspection --------------------------------------------------------------------
    def states(self) -> tuple[mx.array | None, ...]:
        return (self.raw_keys, self.pooled, self.pooled_f32_t, self.keys, self.values)

    @property
    def state_present(self) -> tuple[bool, ...]:
        return tuple(a is not None for a in self.states())

    def capacity(self, name: str) -> int:
        """Physical row capacity of a state (0 when absent)."""
        a = getattr(self, name)
        if a is None:
            return 0
        return a.shape[
            {"raw_keys": 1, "pooled": 1, "pooled_f32_t": 3, "keys": 2, "values": 2}[name]
        ]

    def staged(self) -> CacheUpdate:
        """A CacheUpdate holding the current fields (the starting point of a call)."""
        return CacheUpdate(*self.states(), offset=self.offset, pooled_len=self.pooled_len)

    def commit(self, u: CacheUpdate) -> None:
        (self.raw_keys, self.pooled, self.pooled_f32_t, self.keys, self.values) = (
            u.raw_keys,
            u.pooled,
            u.pooled_f32_t,
            u.keys,
            u.values,
        )
        self.offset, self.pooled_len = u.offset, u.pooled_len

    def __repr__(self) -> str:
        caps = "/".join(str(self.capacity(n)) for n in STATE_NAMES)
        return f"QSACache(offset={self.offset}, pooled_len={self.pooled_len}, caps={caps})"


def encode_shard_key(key: tuple) -> str:
    size, rank, kv_heads = key
    return f"{size}:{rank}:{','.join(str(h) for h in kv_heads)}"


def decode_shard_key(text: str) -> tuple:
    """`"size:rank:kv,kv,..."` → `(size, rank, (kv, ...))` (a `ShardLayout.key`)."""
    try:
        size, rank, heads = text.split(":")
        key = (int(size), int(rank), tuple(int(h) for h in heads.split(",")))
    except ValueError:
        key = None
    if key is None or not 0 <= key[1] < key[0] or min(key[2]) < 0:
        raise ValueError(
            f"meta_state: shard identity must be 'size:rank:kv,kv,...' with 0 <= rank < "
            f"size, got {text!r}"
        )
    return key


def _parse_meta(v: tuple[str, ...]) -> tuple[int, int, str, int, bool, int]:
    """(offset, pooled_len, presence bits, index head dim, has_indexer, ratio) of a
    meta_state; a 5-string one (saved before the ratio was stored) means ratio 4; a 7th
    string is a shard identity (decoded by the caller)."""
    if not isinstance(v, (tuple, list)) or len(v) not in (5, 6, 7):
        n = len(v) if isinstance(v, (tuple, list)) else type(v).__name__
        raise ValueError(f"meta_state: expected 5, 6 or 7 strings, got {n}")
    try:
        offset, pooled_len, index_head_dim = int(v[0]), int(v[1]), int(v[3])
        ratio = int(v[5]) if len(v) == 6 else 4
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta_state: expected integer strings, got {tuple(v)}") from e
    if ratio < 1:
        raise ValueError(f"meta_state: ratio must be >= 1, got {ratio}")
    return offset, pooled_len, str(v[2]), index_head_dim, v[4] == "1", ratio


def _check_states(full: tuple, d_i: int) -> None:
    raw, pooled, mirror, keys, values = full
    if (keys is None) != (values is None):
        raise ValueError("state: keys and values must be both present or both absent")
    if keys is not None and (keys.ndim != 4 or keys.shape != values.shape):
        raise ValueError(
            f"state: keys/values must be [1, H_kv, cap, d] of equal shape, got "
            f"{list(keys.shape)} and {list(values.shape)}"
        )
    for name, a in (("raw_keys", raw), ("pooled", pooled)):
        if a is not None and (a.ndim != 3 or a.shape[0] != 1 or a.shape[2] != d_i):
            raise ValueError(f"state: {name} must be [1, cap, {d_i}], got {list(a.shape)}")
    if mirror is not None:
        if pooled is None or tuple(mirror.shape) != (1, 1, d_i, pooled.shape[1]):
            raise ValueError(
                f"state: pooled_f32_t must be [1, 1, {d_i}, cap_pool], got {list(mirror.shape)}"
            )


# -- growth applied to staged backings (rules in plan.py) --------------------------------------


def kv_append(u: CacheUpdate, k: mx.array, v: mx.array, rows: mx.array) -> None:
    """Append K/V rows `[1, H_kv, S, d]` at `u.offset` with mlx-lm KVCache growth (step 256).

    `rows`: the rows' indices offset, ..., offset + S - 1 as an int32 array `[S]`, the one the
    call already made (every array made from host values costs host time per step)."""
    P, S = u.offset, k.shape[2]
    cap = u.keys.shape[2] if u.keys is not None else 0
    growth = plan.kv_growth(cap, P, S)
    if growth is not None:
        keep, new_cap = growth
        u.keys = grow_rows(u.keys, 2, keep, new_cap, (k.shape, k.dtype))
        u.values = grow_rows(u.values, 2, keep, new_cap, (v.shape, v.dtype))
    index = mx.broadcast_to(rows.reshape(1, 1, S, 1), k.shape)  # shared by both writes
    u.keys = write_rows(u.keys, k, index, 2)
    u.values = write_rows(u.values, v, index, 2)
    u.offset = P + S


def ensure_rows(backing: mx.array | None, new_cap: int, axis: int, like: tuple) -> mx.array:
    """Grow (copy + zero fill) a backing to exactly `new_cap` rows; never shrink."""
    cap = backing.shape[axis] if backing is not None else 0
    if backing is not None and cap >= new_cap:
        return backing
    return grow_rows(backing, axis, cap, new_cap, like)
