"""`turns.take_turns`: round-robin timing of a comparison's entries (pure Python)."""

from __future__ import annotations

import time

import pytest

from mlx_qsa.turns import take_turns


def _entries(order: list, names: str, result=lambda name, n: n):
    counts = dict.fromkeys(names, 0)

    def make(name):
        def one_round():
            order.append(name)
            counts[name] += 1
            return result(name, counts[name])

        return one_round

    return {name: make(name) for name in names}


def test_warm_rounds_then_timed_rounds_in_turns():
    order: list = []
    got = take_turns(_entries(order, "abc"), rounds=3, warm_rounds=2)
    assert order == list("abc") * 5  # 2 warm rounds, then 3 timed, each entry in turn
    # each entry's timed results are its own 3rd..5th calls, in order
    assert got == {"a": [3, 4, 5], "b": [3, 4, 5], "c": [3, 4, 5]}
    assert list(got) == list("abc")


def test_no_warm_rounds_times_from_the_first_call():
    order: list = []
    got = take_turns(_entries(order, "ab"), rounds=2, warm_rounds=0)
    assert order == list("ab") * 2 and got == {"a": [1, 2], "b": [1, 2]}


def test_settle_adds_whole_untimed_rounds_until_the_time_has_passed():
    order: list = []

    def slow(name, n):
        time.sleep(0.01)
        return n

    t0 = time.perf_counter()
    got = take_turns(_entries(order, "ab", slow), rounds=2, warm_rounds=1, settle_s=0.1)
    assert time.perf_counter() - t0 >= 0.1
    warm = order[:-4]
    assert len(warm) >= 2 * 5 and warm == list("ab") * (len(warm) // 2)  # whole rounds only
    n_warm = len(warm) // 2
    assert got == {"a": [n_warm + 1, n_warm + 2], "b": [n_warm + 1, n_warm + 2]}


@pytest.mark.parametrize(
    "kw", [{"rounds": -1}, {"rounds": 1, "warm_rounds": -1}, {"rounds": 1, "settle_s": -0.5}]
)
def test_negative_counts_are_refused(kw):
    with pytest.raises(ValueError, match="must be >= 0"):
        take_turns({"a": lambda: 0}, **kw)
