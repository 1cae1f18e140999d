"""The compiled indexer core: no retrace when positions move, receipt bookkeeping, and
compiled == eager (states and selections) on the same inputs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_qsa import Capabilities, QSAAttention, QSAConfig, QSAOptions

SMALL = QSAConfig(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    partial_rotary_factor=0.5, mrope_section=(3, 3, 2), indexer_n_heads=2,
    indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
)  # fmt: skip


def _layer(fused: int, caps: Capabilities, seed: int = 0) -> QSAAttention:
    mx.random.seed(seed)
    layer = QSAAttention(SMALL, QSAOptions.trace(), fused=fused, capabilities=caps)
    layer.set_dtype(mx.bfloat16)  # compiled only when input and norm dtypes agree (§5.3)
    mx.eval(layer.parameters())
    return layer


def _rows(rng: np.random.Generator, S: int) -> mx.array:
    return mx.array(rng.standard_normal((1, S, SMALL.hidden_size), np.float32)).astype(mx.bfloat16)


@pytest.mark.parametrize("fused", [3, 4])
def test_decode_never_retraces(fused):
    rng = np.random.default_rng(1)
    layer = _layer(fused, Capabilities.reference())
    cache = layer.make_cache()
    layer.prefill_state(_rows(rng, 23), cache)  # state-only prefill into the sparse regime
    for _ in range(60):
        mx.eval(layer(_rows(rng, 1), cache=cache))
        assert layer.last_call.compiled and layer.last_call.mode == "blocks"
    core = layer.core
    assert core.entry_count == 1
    assert core.python_traces == 1  # 60 calls at 60 positions, one trace
    d = core.to_dict(QSAOptions.trace().prefill_workspace)
    assert d["calls"] == 60 and d["traces"] == 1 and d["modes"]["blocks"] == 60
    assert d["selector_dispatches"] == 60 and d["capacity_transitions"] == 0


def test_each_compiled_call_takes_its_own_counter_slot(monkeypatch):
    """The one-launch selector's hand-off counter is an input of the compiled graph, a fresh
    slot per call: replays of one graph that MLX runs concurrently never share one (a constant
    captured at trace time would be shared by every replay)."""
    import mlx_qsa.core as core_module
    from mlx_qsa.kernels import _launch

    rng = np.random.default_rng(3)
    layer = _layer(4, Capabilities.reference())
    cache = layer.make_cache()
    layer.prefill_state(_rows(rng, 23), cache)
    seen = []

    def spy():
        seen.append(_launch.counter_slot())
        return seen[-1]

    monkeypatch.setattr(core_module, "counter_slot", spy)
    for _ in range(5):
        mx.eval(layer(_rows(rng, 1), cache=cache))
        assert layer.last_call.compiled
    assert layer.core.python_traces == 1  # the new input does not retrace
    assert len(seen) == 5 and len({id(c) for c in seen}) == 5


def test_bucket_growth_adds_keys_logarithmically():
    rng = np.random.default_rng(2)
    layer = _layer(4, Capabilities.reference())
    cache = layer.make_cache()
    layer.prefill_state(_rows(rng, 21), cache)
    for _ in range(520):  # crosses raw bucket 256 -> 512 -> 1024 (T from 22 to 541)
        layer(_rows(rng, 1), cache=cache)
        mx.eval(cache.state)
    core = layer.core
    assert cache.capacity("raw_keys") == 1024
    assert core.entry_count == 3 == core.python_traces
    assert core.receipt.capacity_transitions == 2


def test_compiled_and_eager_agree_bit_for_bit():
    """Same weights, same inputs: the compiled core (fused 4) and the eager oracle path
    (portable capabilities) write identical raw/pooled keys and K/V, and select the same."""
    rng = np.random.default_rng(3)
    comp = _layer(4, Capabilities.reference(), seed=5)
    eager = QSAAttention(SMALL, QSAOptions.trace(), fused=0, capabilities=Capabilities.portable())
    w = dict(_flat(comp.parameters()))
    qw, kvw = SMALL.q_proj_width, SMALL.kv_proj_width
    big = w.pop("qkvi_proj.weight")
    w["q_proj.weight"], w["k_proj.weight"] = big[:qw], big[qw : qw + kvw]
    w["v_proj.weight"], w["indexer.index_qk_proj.weight"] = (
        big[qw + kvw : qw + 2 * kvw], big[qw + 2 * kvw :])  # fmt: skip
    eager.set_dtype(mx.bfloat16)
    eager.load_weights(list(w.items()))
    c1, c2 = comp.make_cache(), eager.make_cache()
    for S in (23, 1, 1, 3, 1, 2, 1, 1, 1, 1):
        x = _rows(rng, S)
        y1, y2 = comp(x, cache=c1), eager(x, cache=c2)
        mx.eval(y1, y2)
        n = c1.offset
        assert mx.array_equal(c1.raw_keys[:, :n], c2.raw_keys[:, :n])
        pl = c1.pooled_len
        assert pl == c2.pooled_len == n // 4
        assert mx.array_equal(c1.pooled[:, :pl], c2.pooled[:, :pl])
        assert mx.array_equal(c1.keys[:, :, :n], c2.keys[:, :, :n])
        assert mx.array_equal(c1.values[:, :, :n], c2.values[:, :, :n])
        if S > 1 and comp.last_call.consumers == eager.last_call.consumers == ("rows_gather",):
            assert mx.array_equal(y1, y2)
    assert comp.core is not None and comp.core.receipt.calls > 0
    assert eager.core is None


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def test_compile_disabled_reads_the_variable_as_mlx_does(set_switch) -> None:
    from mlx_qsa.core import compile_disabled

    set_switch("MLX_DISABLE_COMPILE", None)
    assert not compile_disabled()
    for value in ("1", "0", ""):  # MLX disables compilation when the variable is set at all
        set_switch("MLX_DISABLE_COMPILE", value)
        assert compile_disabled()
