"""HF weight conversion (`weights.sanitize`, `QSAAttention.from_hf`): the +1 norm fold happens
exactly once (QSA.md §3), and sanitizing sanitized weights changes nothing (STYLE.md)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import hidden_rows, small_config, synthetic_weights

from mlx_qsa import QSAAttention, sanitize
from mlx_qsa.weights import NORMS, SanitizedWeights, layer_keys, sanitized_level

BF16, F32 = mx.bfloat16, mx.float32


def checkpoint(cfg, seed: int = 7) -> dict[str, mx.array]:
    """HF-form weights: zero-centred norms (stored w of `1 + w`), bf16."""
    plain = synthetic_weights(cfg, BF16, seed)
    return {k: (v.astype(F32) - 1).astype(BF16) if "norm" in k else v for k, v in plain.items()}


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == BF16 else a)


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(bits(a[k]), bits(b[k]), err_msg=k)


@pytest.mark.parametrize("fused", [0, 3, 4])
def test_sanitize_twice_folds_once(fused):
    cfg = small_config(True)
    hf = checkpoint(cfg)
    once = sanitize(hf, cfg, fused=fused)
    assert isinstance(once, SanitizedWeights) and once.fused == fused
    assert sorted(once) == sorted(layer_keys(cfg, fused))
    for k in NORMS:  # folded: dtype(1 + w), exactly once
        np.testing.assert_array_equal(bits(once[k]), bits((1 + hf[k].astype(F32)).astype(BF16)))
    twice = sanitize(once, cfg, fused=fused)
    assert isinstance(twice, SanitizedWeights) and twice.fused == fused
    assert_same(twice, once)
    assert_same(sanitize(twice, cfg, fused=fused, zero_centered_norms=False), once)


@pytest.mark.parametrize("fused", [3, 4])
def test_fused_sets_are_recognised_after_a_file_round_trip(fused, tmp_path):
    """The marker type is lost in a file, but fused keys never occur in a checkpoint."""
    cfg = small_config(True)
    once = sanitize(checkpoint(cfg), cfg, fused=fused)
    path = str(tmp_path / "layer.safetensors")
    mx.save_safetensors(path, dict(once))
    loaded = mx.load(path)
    assert not isinstance(loaded, SanitizedWeights) and sanitized_level(loaded) == fused
    assert_same(sanitize(loaded, cfg, fused=fused), once)
    prefixed = {f"self_attn.{k}": v for k, v in loaded.items()}
    assert sanitized_level(prefixed) == fused
    assert_same(sanitize(prefixed, cfg, fused=fused), once)


def test_level_0_set_from_a_file_is_loaded_with_plain_norms():
    """Level 0 has the checkpoint's names: from a file it reads as HF form (documented), so
    it is reloaded with `zero_centered_norms=False` (or `layer.load_weights`)."""
    cfg = small_config(True)
    once = sanitize(checkpoint(cfg), cfg)
    plain = dict(once)
    assert sanitized_level(plain) is None
    assert_same(sanitize(plain, cfg, zero_centered_norms=False), once)


def test_explicit_checkpoint_flag_on_sanitized_weights_raises():
    cfg = small_config(True)
    once = sanitize(checkpoint(cfg), cfg, fused=4)
    with pytest.raises(ValueError, match="^zero_centered_norms: the weights are already sanitized"):
        sanitize(once, cfg, fused=4, zero_centered_norms=True)
    with pytest.raises(ValueError, match="^zero_centered_norms: the weights are already"):
        sanitize(dict(once), cfg, fused=4, zero_centered_norms=True)
    with pytest.raises(ValueError, match="^zero_centered_norms: expected True, False or None"):
        sanitize(checkpoint(cfg), cfg, zero_centered_norms="yes")


def test_sanitized_set_of_another_level_or_incomplete_raises():
    cfg = small_config(True)
    three = sanitize(checkpoint(cfg), cfg, fused=3)
    with pytest.raises(ValueError, match="^fused: the weights are already sanitized for fusion"):
        sanitize(three, cfg, fused=4)
    with pytest.raises(ValueError, match=r"^weights: missing \['o_proj.weight'\]"):
        sanitize({k: v for k, v in three.items() if k != "o_proj.weight"}, cfg, fused=3)
    bad = {**three, "qkv_proj.weight": three["qkv_proj.weight"][1:]}
    with pytest.raises(ValueError, match=r"^weights\['qkv_proj.weight'\]: expected shape"):
        sanitize(bad, cfg, fused=3)
    with pytest.raises(ValueError, match="^fused: expected 0, 3 or 4"):
        sanitize(checkpoint(cfg), cfg, fused=2)


def test_sanitize_is_pure():
    cfg = small_config(True)
    hf = checkpoint(cfg)
    before = {k: mx.array(v) for k, v in hf.items()}
    once = sanitize(hf, cfg, fused=4)
    sanitize(once, cfg, fused=4)
    assert_same(hf, before)
    assert type(hf) is dict


@pytest.mark.parametrize("fused", [0, 3, 4])
def test_from_hf_of_sanitized_weights_equals_from_hf_of_the_checkpoint(fused):
    """from_hf folds a checkpoint by default, and takes sanitize's output without folding."""
    cfg = small_config(True)
    hf = checkpoint(cfg)
    a = QSAAttention.from_hf(cfg.to_dict(), hf, fused=fused)
    b = QSAAttention.from_hf(cfg.to_dict(), sanitize(hf, cfg, fused=fused), fused=fused)
    want = (1 + hf["q_norm.weight"].astype(F32)).astype(BF16)
    for layer in (a, b):
        np.testing.assert_array_equal(bits(layer.q_norm.weight), bits(want))
    x = hidden_rows(9, cfg.hidden_size, BF16, seed=130)
    assert mx.array_equal(a(x), b(x)).item()
    with pytest.raises(ValueError, match="already sanitized"):
        QSAAttention.from_hf(
            cfg.to_dict(), sanitize(hf, cfg, fused=fused), fused=fused, zero_centered_norms=True
        )
