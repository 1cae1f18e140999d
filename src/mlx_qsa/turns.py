"""Timing in turns: every entry of a comparison runs one round, then the next entry, and so on.

The lent GPUs run back-to-back heavy work at their 700 W power cap, where the SM clock falls
from ~1980 to ~1500–1600 MHz; an entry timed in a phase of its own after lighter work runs
faster than the same calls taken among the others, so phase-by-phase ratios depend on the
order of the phases (BENCHMARKS.md, the GEMM sweep's eleventh session). Taken in turns, every
entry sees the same mix of clocks. Pure Python: no arrays, no MLX.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def take_turns(
    entries: Mapping[str, Callable[[], T]],
    rounds: int,
    warm_rounds: int = 1,
    settle_s: float = 0.0,
) -> dict[str, list[T]]:
    """`rounds` timed rounds of every entry, round-robin in the mapping's order; each call of
    an entry is one round and returns its measure of it.

    First `warm_rounds` untimed rounds of each entry (compiles, graph captures, allocator
    growth), then more untimed rounds until `settle_s` seconds have passed since the start, so
    the clocks have settled under the mix before any round is timed.
    """
    if rounds < 0 or warm_rounds < 0 or settle_s < 0:
        raise ValueError(
            f"take_turns: rounds={rounds}, warm_rounds={warm_rounds} and settle_s={settle_s} "
            "must be >= 0"
        )
    settled = time.perf_counter() + settle_s
    done = 0
    while done < warm_rounds or time.perf_counter() < settled:
        for one_round in entries.values():
            one_round()
        done += 1
    out: dict[str, list[T]] = {name: [] for name in entries}
    for _ in range(rounds):
        for name, one_round in entries.items():
            out[name].append(one_round())
    return out
