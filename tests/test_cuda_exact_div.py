"""The score kernels' division (`qsa::div_sqrt128`) gives `__fdiv_rn`'s bits for every float32."""

from __future__ import annotations

import pytest
from test_cuda_decode import needs_cuda

from mlx_qsa.kernels.exact_div import div_sqrt128_mismatches


@pytest.mark.parametrize(("lo", "count"), [(1, 1 << 30), (0, 1000), (3 << 30, 2 << 30), (0, 0)])
def test_pattern_range_must_be_whole_launches_within_float32(lo: int, count: int) -> None:
    with pytest.raises(ValueError, match=rf"lo={lo}, count={count}"):
        div_sqrt128_mismatches(lo, count)


@needs_cuda
def test_div_sqrt128_equals_fdiv_rn_for_every_float32() -> None:
    n_bad, first = div_sqrt128_mismatches()
    assert (n_bad, first) == (0, None), f"{n_bad} patterns differ, the first {first:#010x}"
