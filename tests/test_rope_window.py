"""Text RoPE tables as views of a shared window (`rope.text_rope`, `rope.rope_window`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa.config import QSAConfig
from mlx_qsa.rope import (
    ROPE_WINDOW,
    rope_tables,
    rope_window,
    text_positions,
    text_rope,
    window_span,
)


def test_window_span_is_the_window_holding_the_range():
    W = ROPE_WINDOW
    assert window_span(0, 1, 1) == (0, 0, 1)
    assert window_span(W + 5, W + 6, 1) == (W, 5, 1)
    assert window_span(2 * W - 2, 2 * W, 1) == (W, W - 2, 2)
    assert window_span(2 * W - 1, 2 * W + 1, 1) is None  # straddles two windows
    assert window_span(0, W + 1, 1) is None  # longer than a window: a prefill chunk
    # Block positions (step r): windows of W blocks, of positions start mod r.
    assert window_span(40, 48, 4) == (0, 10, 2)
    assert window_span(4 * W + 8, 4 * W + 12, 4) == (4 * W, 2, 1)
    assert window_span(4 * W + 9, 4 * W + 13, 4) == (4 * W + 1, 2, 1)
    assert window_span(5, 5, 1) is None and window_span(-1, 1, 1) is None
    for start in range(0, 300, 7):
        for n in (1, 2, 3, 5):
            for step in (1, 4):
                span = window_span(start, start + n * step, step)
                if span is None:
                    continue
                base, first, m = span
                assert m == n and 0 <= first and first + n <= W and base >= 0
                assert base + first * step == start


@pytest.mark.parametrize("step", [1, 4])
def test_window_rows_have_the_bits_of_their_own_tables(step):
    # Each element is cast, multiplied and passed through cos / sin on its own, so a window
    # row equals the table made for that position alone, bit for bit.
    cfg = QSAConfig()
    text_rope.cache_clear()
    rope_window.cache_clear()
    starts = [0, 1, 7, ROPE_WINDOW - 1, ROPE_WINDOW, 3 * ROPE_WINDOW + 13, 130_000, 262_143]
    for start in starts:
        for n in (1, 2, 3):
            start_ = start * step
            pos, cos, sin = text_rope(cfg, start_, start_ + n * step, step)
            own_pos = text_positions(start_, start_ + n * step, step)
            own_cos, own_sin = rope_tables(own_pos, cfg)
            assert pos.shape == (n,) and pos.dtype == mx.int32
            assert np.array_equal(np.array(pos), np.array(own_pos))
            for a, b in ((cos, own_cos), (sin, own_sin)):
                assert a.shape == b.shape and a.dtype == b.dtype == mx.float32
                assert np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


def test_decode_steps_share_one_window():
    cfg = QSAConfig()
    text_rope.cache_clear()
    rope_window.cache_clear()
    for p in range(1000, 1000 + 10):
        text_rope(cfg, p, p + 1)
    info = rope_window.cache_info()
    assert (info.misses, info.currsize) == (1, 1)  # 1000..1009 lie in one window of 64
    # A chunk longer than a window is made directly.
    pos, cos, _ = text_rope(cfg, 0, 3 * ROPE_WINDOW)
    assert cos.shape[0] == 3 * ROPE_WINDOW and rope_window.cache_info().currsize == 1
