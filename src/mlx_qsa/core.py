"""The compiled indexer core (RUNTIME.md §6): one `mx.compile`d graph per structural key.

A graph performs the whole indexer step of a call — (for the `hidden` source) the indexer
projection, query prep, the raw-row write, staging-window pooling, scoring, exact top-k and
the mode's output format. Every value that moves between calls (rows' positions, the window
start) is an array input, so calls with equal shapes never retrace; backings are
power-of-two buckets so the number of keys stays logarithmic in the context. RoPE tables
and the score penalty are computed eagerly and passed in (RUNTIME §10: the eager and the
compiled paths must produce identical bits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from . import plan
from .cache import write_rows
from .indexer import (
    IndexerGeometry,
    dense_keep_mask,
    pool_blocks,
    prepare_queries,
    select_row_tokens,
    select_rows,
    split_qk_rows,
)
from .kernels._launch import counter_slot, env_switch


@dataclass
class CoreInputs:
    """Arrays of one compiled dispatch (backings already reserved to the key's buckets)."""

    source: mx.array  # [1, S, D] hidden or [1, S, (H_I+1)·d_I] qk_rows
    proj_w: mx.array | None  # index_qk_proj weight for the hidden source
    q_norm_w: mx.array
    k_norm_w: mx.array
    raw: mx.array  # [1, cap_raw, d_I]
    pooled: mx.array  # [1, cap_pool, d_I]
    cos_rows: mx.array  # [S, d_r/2] at the rows' (index) positions
    sin_rows: mx.array
    cos_win: mx.array  # [m, d_r/2] at the window blocks' first tokens
    sin_win: mx.array
    positions: mx.array  # int32 [S], the rows' absolute positions (= their raw-key rows)
    win_start: mx.array  # int32 [1], first block of the staging window
    penalty: mx.array  # float32 [cap_pool]


def _graph(
    key: plan.CompiledKey,
    g: IndexerGeometry,
    m: int,
    on_trace: Callable[[], None],
    impl: str = "portable",
) -> Callable:
    """The traced function of one key; all structure comes from the key (Python constants).

    `on_trace` runs each time MLX traces the Python function (a retrace would show here).
    """
    chunk, mode = key.selector_chunk_rows, key.mode
    hidden_source = key.source == "hidden"

    def run(
        source,
        proj_w,
        q_norm_w,
        k_norm_w,
        raw,
        pooled,
        cos_rows,
        sin_rows,
        cos_win,
        sin_win,
        positions,
        win_start,
        penalty,
        ctr,
    ):
        on_trace()
        z = source @ proj_w.T if hidden_source else source
        q_raw, k_raw = split_qk_rows(z, g)
        raw = write_rows(raw, k_raw, positions, 1)
        window = pool_blocks(raw, win_start, m, k_norm_w, cos_win, sin_win, g, impl)
        pooled = write_rows(pooled, window, win_start + mx.arange(m, dtype=mx.int32), 1)
        if mode == "update_only":
            return raw, pooled
        q = prepare_queries(q_raw, q_norm_w, cos_rows, sin_rows, g, impl)
        keys_t = pooled[0].astype(mx.float32).T
        if mode == "row_tokens":
            slots, slot_valid = select_row_tokens(
                q, keys_t, penalty, positions, g.ratio, g.block_topk, chunk, pooled, impl, ctr
            )
            return raw, pooled, slots, slot_valid
        ids, valid, scores = select_rows(
            q, keys_t, penalty, positions, g.ratio, g.block_topk, chunk, pooled, impl, ctr=ctr
        )
        if mode in ("blocks", "prefill_blocks"):
            return raw, pooled, ids, valid, scores
        mask = dense_keep_mask(ids, valid, positions, key.dense_output_tokens, g.ratio)
        return raw, pooled, mask

    return run


class IndexerCore:
    """One layer's compiled core: graphs by key label, and its cumulative receipt."""

    def __init__(self, geometry: IndexerGeometry) -> None:
        self.geometry = geometry
        self.receipt = plan.CoreReceipt()
        self._graphs: dict[tuple[str, str], Callable] = {}
        self.python_traces = 0  # times MLX traced a graph function (== entry_count if no retrace)

    @property
    def entry_count(self) -> int:
        return len(self._graphs)

    def dispatch(
        self, key: plan.CompiledKey, m: int, inputs: CoreInputs, impl: str = "portable"
    ) -> tuple[mx.array, ...]:
        """Run the graph of `key` (`impl`: "portable" or "cuda" selector); returns
        (raw, pooled, *mode outputs)."""
        fn = self._graphs.get((key.label, impl))
        if fn is None:
            fn = mx.compile(_graph(key, self.geometry, m, self._count_trace, impl))
        proj_w = inputs.proj_w if inputs.proj_w is not None else _no_projection()
        out = fn(
            inputs.source,
            proj_w,
            inputs.q_norm_w,
            inputs.k_norm_w,
            inputs.raw,
            inputs.pooled,
            inputs.cos_rows,
            inputs.sin_rows,
            inputs.cos_win,
            inputs.sin_win,
            inputs.positions,
            inputs.win_start,
            inputs.penalty,
            # the one-launch CUDA selector's hand-off counter: a fresh slot per call, passed as an
            # input (a constant of the trace would be shared by concurrent replays of the graph)
            counter_slot(),
        )
        # Account only once the graph has been built without error.
        self._graphs[(key.label, impl)] = fn
        self.receipt.record(key, compiled=not compile_disabled())
        return tuple(out)

    def _count_trace(self) -> None:
        self.python_traces += 1

    def to_dict(self, prefill_workspace: int) -> dict:
        return self.receipt.to_dict(prefill_workspace)


@functools.cache
def _no_projection() -> mx.array:
    """The placeholder projection weight of a fused-level-4 layer (its graph never reads it),
    made once instead of a fresh `mx.zeros` array (host time) at every step."""
    w = mx.zeros((1, 1), mx.bfloat16)
    mx.eval(w)
    return w


def compile_disabled() -> bool:
    """MLX_DISABLE_COMPILE as MLX 0.32 reads it (`mlx/compile.cpp`): once per process, and set
    at all (any value, "0" too) disables compilation."""
    return env_switch("MLX_DISABLE_COMPILE") is not None
