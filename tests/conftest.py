"""Shared test helpers: the per-dtype tolerance table and synthetic QSA layers.

Synthetic weights follow RUNTIME.md §9.1 (HF names, norm weights in the stored plain form);
`small` geometries reach the sparse regime at a few dozen tokens (budget 16, ratio 4).
Test modules import these with `from conftest import ...` (tests/ is on sys.path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import mlx_qsa.layer as layer_mod
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.indexer import IndexerGeometry, prepare_queries, split_qk_rows
from mlx_qsa.kernels._launch import env_switch
from mlx_qsa.layer import QSAAttention
from mlx_qsa.plan import Capabilities
from mlx_qsa.rope import rope_tables, text_positions

# Relative Frobenius error of outputs / states against the float64 oracle (issue 3).
TOLERANCES = {mx.bfloat16: 1e-2, mx.float32: 1e-4}


def small_config(mrope: bool = True, **changes: Any) -> QSAConfig:
    """hidden 32, 4 heads / 2 KV heads / head dim 32, d_r 16, indexer 2 × 16, budget 16."""
    base: dict[str, Any] = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        rope_theta=10_000.0,
        mrope_section=(3, 3, 2) if mrope else None,
        mrope_interleaved=mrope,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=4,
    )
    base.update(changes)
    return QSAConfig(**base)


def synthetic_weights(cfg: QSAConfig, dtype: mx.Dtype = mx.bfloat16, seed: int = 7) -> dict:
    """HF-named weights (keys relative to `self_attn.`), RUNTIME §9.1 style, in `dtype`."""
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    linears = {
        "q_proj": (cfg.q_proj_width, D),
        "k_proj": (cfg.kv_proj_width, D),
        "v_proj": (cfg.kv_proj_width, D),
        "o_proj": (D, H * d),
    }
    norms = {"q_norm": d, "k_norm": d}
    if cfg.has_indexer:
        linears["indexer.index_qk_proj"] = (cfg.index_proj_width, D)
        norms["indexer.q_layernorm"] = cfg.indexer_head_dim
        norms["indexer.k_layernorm"] = cfg.indexer_head_dim
    w: dict[str, mx.array] = {}
    for k, (name, shape) in enumerate(linears.items()):
        a = np.random.default_rng([seed, k]).standard_normal(shape, np.float32)
        w[f"{name}.weight"] = mx.array(a / np.sqrt(shape[1])).astype(dtype)
        if cfg.attention_bias and not name.startswith("indexer"):
            b = np.random.default_rng([seed, 9 + k]).standard_normal(shape[0], np.float32)
            w[f"{name}.bias"] = mx.array(0.1 * b).astype(dtype)
    for k, (name, n) in enumerate(norms.items()):
        a = np.random.default_rng([seed, 4 + k]).standard_normal(n, np.float32)
        w[f"{name}.weight"] = mx.array(1 + 0.1 * a).astype(dtype)
    return w


def build(
    cfg: QSAConfig,
    dtype: mx.Dtype = mx.bfloat16,
    fused: int = 4,
    options: QSAOptions | None = None,
    caps: Capabilities | None = None,
    seed: int = 7,
) -> tuple[QSAAttention, dict]:
    """A layer from HF-named synthetic weights; returns (layer, float64 HF weights)."""
    w = synthetic_weights(cfg, dtype, seed)
    layer = QSAAttention.from_hf(
        cfg.to_dict(),
        w,
        fused=fused,
        options=options or QSAOptions.trace(),
        zero_centered_norms=False,
        capabilities=caps,
    )
    return layer, {k: as_f64(v) for k, v in w.items()}


def layer_index_queries(layer: QSAAttention, x: mx.array, P: int) -> np.ndarray:
    """The rows' index queries as the layer forms them (bf16 or f32), `[S, H_I, d_I]`."""
    cfg = layer.config
    if layer.fused == 4:
        e = cfg.q_proj_width + 2 * cfg.kv_proj_width
        z = layer.qkvi_proj(x)[..., e:]
    else:
        z = layer.indexer.index_qk_proj(x)
    g = IndexerGeometry.of(cfg)
    q_raw, _ = split_qk_rows(z, g)
    cos, sin = rope_tables(text_positions(P, P + x.shape[1]), cfg)
    q = prepare_queries(q_raw, layer.indexer.q_layernorm.weight, cos, sin, g)
    return as_f64(q[0].transpose(1, 0, 2))


def hidden_rows(n: int, width: int, dtype: mx.Dtype = mx.bfloat16, seed: int = 11) -> mx.array:
    """`[1, n, width]` standard-normal rows rounded to `dtype`."""
    a = np.random.default_rng([seed, n, width]).standard_normal((1, n, width), np.float32)
    return mx.array(a).astype(dtype)


def as_f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def rel_err(actual: mx.array | np.ndarray, expected: np.ndarray) -> float:
    """Relative Frobenius error ‖a − e‖ / ‖e‖."""
    a = as_f64(actual) if isinstance(actual, mx.array) else np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


# -- observing what a layer attended ---------------------------------------------------


@dataclass
class Seen:
    """One consumer dispatch: the plan's chain and sdpa mask, the selection, the rows."""

    consumers: tuple[str, ...]
    sdpa_mask: str
    sel: object
    positions: np.ndarray
    T: int
    impl: str = "portable"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``QSA_FAIL_LOG`` set, each failure's report is appended to that file as soon as the
    test ends. The lent GPU stops a call at its time limit, before pytest prints its failure
    section at the end of the run; this keeps the reasons (benchmarks/decode_device.sh)."""
    path = os.environ.get("QSA_FAIL_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def _fresh_env_switches():
    """Environment switches are read once per process (`env_switch`): no test
    sees a value cached under another test's environment."""
    env_switch.cache_clear()
    yield
    env_switch.cache_clear()


@pytest.fixture
def set_switch(monkeypatch):
    """set_switch(name, value): set (None: unset) an environment switch for this test."""

    def set_(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        env_switch.cache_clear()

    return set_


@pytest.fixture
def spy(monkeypatch) -> list[Seen]:
    """Record every consumer dispatch (selection in the formats of RUNTIME §7)."""
    seen: list[Seen] = []
    real = layer_mod.dispatch

    def recording(
        cplan, q, keys, values, sel, positions, T, ratio, scale, impl="portable", gate=None
    ):
        seen.append(Seen(cplan.consumers, cplan.sdpa_mask, sel, np.array(positions), T, impl))
        return real(cplan, q, keys, values, sel, positions, T, ratio, scale, impl, gate=gate)

    monkeypatch.setattr(layer_mod, "dispatch", recording)
    return seen
