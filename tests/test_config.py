"""QSAConfig (HF names, QSA.md §2 validation), QSAOptions (RUNTIME §3), the RoPE tables."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlx_qsa.config import (
    INDEXER_KEYS,
    ROPE_FREQUENCY_BITS_1E7_64,
    TRACE_OPTION_KEYS,
    QSAConfig,
    QSAOptions,
    inv_frequencies,
    mrope_axes,
)

FIXTURE = Path(__file__).parent / "data" / "qsa_trace_m5pro.jsonl"


def first_record() -> dict:
    return json.loads(FIXTURE.read_text().split("\n", 1)[0])


def hf_text_config(**changes: Any) -> dict:
    """A Qwen4ExpTextConfig dictionary of Qwen3.8-Flash-Next (extra HF keys included)."""
    d: dict[str, Any] = {
        "model_type": "qwen4_exp_text",
        "architectures": None,
        "vocab_size": 248320,
        "hidden_size": 2560,
        "num_hidden_layers": 48,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "torch_dtype": "bfloat16",
    }
    d.update(changes)
    return d


# -- from_dict ------------------------------------------------------------------------------


def test_from_dict_reads_the_real_text_config():
    cfg = QSAConfig.from_dict(hf_text_config())
    assert cfg == QSAConfig()  # the class defaults are Qwen3.8-Flash-Next's
    assert (cfg.rotary_dim, cfg.gqa_group, cfg.block_topk, cfg.scale) == (64, 12, 512, 1 / 16)
    assert (cfg.index_proj_width, cfg.q_proj_width, cfg.kv_proj_width) == (640, 12288, 512)
    assert cfg.mrope_section == (11, 11, 10) and cfg.mrope_interleaved
    assert cfg.has_indexer and cfg.has_mrope_axes


def test_from_dict_reads_text_config_of_the_full_config():
    full = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "vision_config": {"hidden_size": 1152, "num_heads": 16, "head_dim": 72},
        "text_config": hf_text_config(hidden_size=64),
        "hidden_size": 9999,
    }
    assert QSAConfig.from_dict(full) == QSAConfig(hidden_size=64)


def test_from_dict_legacy_rope_scaling_and_top_level_keys():
    d = hf_text_config()
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope["rope_theta"]  # legacy: theta at the top level
    d["partial_rotary_factor"] = rope["partial_rotary_factor"]
    d["rope_scaling"] = {
        "type": "default",
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    assert QSAConfig.from_dict(d) == QSAConfig()


def test_from_dict_without_indexer_keys_is_a_no_indexer_layer():
    d = {k: v for k, v in hf_text_config().items() if k not in INDEXER_KEYS}
    cfg = QSAConfig.from_dict(d)
    assert not cfg.has_indexer and cfg.block_topk == 0 and cfg.index_proj_width == 0
    assert all(getattr(cfg, k) is None for k in INDEXER_KEYS)


def test_from_dict_derives_head_dim_and_defaults():
    d = hf_text_config(hidden_size=6144)
    del d["head_dim"], d["rms_norm_eps"], d["attention_bias"]
    cfg = QSAConfig.from_dict(d)
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.attention_bias) == (256, 1e-6, False)


@pytest.mark.parametrize(
    "cfg",
    [
        QSAConfig(),
        QSAConfig(hidden_size=64, attention_bias=True),
        QSAConfig(mrope_section=None, mrope_interleaved=False),
        QSAConfig().replace(**dict.fromkeys(INDEXER_KEYS)),
        QSAConfig(
            hidden_size=32, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5,
            rope_theta=10_000.0, mrope_section=(3, 3, 2), indexer_n_heads=2,
            indexer_head_dim=16, indexer_budget=16,
        ),
    ],
    ids=["real", "trace-biased", "rope1d", "no-indexer", "small"],
)  # fmt: skip
def test_to_dict_round_trips(cfg):
    assert QSAConfig.from_dict(cfg.to_dict()) == cfg
    assert QSAConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("bad", [None, [1, 2], "config"], ids=["none", "list", "str"])
def test_from_dict_needs_a_dict(bad):
    with pytest.raises(ValueError, match="^config: expected a dict"):
        QSAConfig.from_dict(bad)


def test_from_dict_rope_parameters_must_be_a_dict():
    with pytest.raises(ValueError, match="^rope_parameters"):
        QSAConfig.from_dict(hf_text_config(rope_parameters=[10000000, 0.25]))


# -- validation (QSA.md §2) -------------------------------------------------------------------

INVALID = [
    # id, changes to the HF text config, the field the message must start with
    ("rule1-partly-set", {"indexer_budget": None}, "indexer_budget"),
    ("rule1-zero-heads", {"indexer_n_heads": 0}, "indexer_n_heads"),
    ("rule1-negative-ratio", {"indexer_compress_ratio": -4}, "indexer_compress_ratio"),
    ("rule1-float-dim", {"indexer_head_dim": 128.0}, "indexer_head_dim"),
    ("rule2-kv-heads", {"indexer_kv_heads": 2}, "indexer_kv_heads"),
    ("rule3-budget-divisible", {"indexer_budget": 2046}, "indexer_budget"),
    ("rule4-rotary-fits", {"indexer_head_dim": 32}, "indexer_head_dim"),
    ("rule5-gqa-divides", {"num_key_value_heads": 5}, "num_key_value_heads"),
    ("rule5-rotary-odd", {"head_dim": 36, "_prf": 0.25, "_sec": None}, "partial_rotary_factor"),
    ("rule5-rotary-zero", {"head_dim": 2, "_prf": 0.25, "_sec": None}, "partial_rotary_factor"),
    ("rule6-mrope-sum", {"_sec": [11, 11, 11]}, "mrope_section"),
    ("rule6-mrope-len", {"_sec": [16, 16]}, "mrope_section"),
    ("factor-above-1", {"_prf": 1.5}, "partial_rotary_factor"),
    ("theta", {"_theta": 0}, "rope_theta"),
    ("eps", {"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ("hidden-size", {"hidden_size": 0}, "hidden_size"),
    ("heads-bool", {"num_attention_heads": True}, "num_attention_heads"),
]


@pytest.mark.parametrize("changes, field", [pytest.param(*c[1:], id=c[0]) for c in INVALID])
def test_invalid_config_names_the_field(changes, field):
    changes = dict(changes)
    d = hf_text_config(**{k: v for k, v in changes.items() if not k.startswith("_")})
    rope = dict(d["rope_parameters"])
    for key, name in (("_prf", "partial_rotary_factor"), ("_sec", "mrope_section"),
                      ("_theta", "rope_theta")):  # fmt: skip
        if key in changes:
            rope[name] = changes[key]
    d["rope_parameters"] = rope
    with pytest.raises(ValueError, match=f"^{field}:"):
        QSAConfig.from_dict(d)
    # The dataclass validates the same way.
    kw = {f: getattr(QSAConfig(), f) for f in QSAConfig.__dataclass_fields__}
    with pytest.raises(ValueError, match=f"^{field}:"):
        QSAConfig(**{**kw, **_dataclass_changes(changes)})


def _dataclass_changes(changes: dict) -> dict:
    names = {"_prf": "partial_rotary_factor", "_sec": "mrope_section", "_theta": "rope_theta"}
    return {names.get(k, k): v for k, v in changes.items()}


def test_valid_edge_configs_are_accepted():
    """HF accepts any budget divisible by the ratio; so does mlx_qsa (QSA.md §2)."""
    QSAConfig.from_dict(hf_text_config(indexer_budget=12, indexer_compress_ratio=3))
    QSAConfig.from_dict(hf_text_config(indexer_compress_ratio=1))
    QSAConfig.from_dict(hf_text_config(indexer_head_dim=64))  # d_r = 64 fits exactly
    cfg = QSAConfig.from_dict(
        hf_text_config(rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.25})
    )
    # No section: 1-D RoPE; the absent flag takes the dataclass default (and has no effect).
    assert cfg.mrope_section is None and cfg.mrope_interleaved
    assert mrope_axes(cfg) == [0] * 32
    d = {k: v for k, v in hf_text_config(head_dim=128).items() if k != "rope_parameters"}
    cfg = QSAConfig.from_dict(d)  # HF defaults: full rotary, theta 1e4
    assert (cfg.partial_rotary_factor, cfg.rope_theta, cfg.rotary_dim) == (1.0, 10_000.0, 128)


def test_unsupported_rope_type_is_not_implemented():
    d = hf_text_config()
    d["rope_parameters"] = {**d["rope_parameters"], "rope_type": "yarn", "factor": 4.0}
    with pytest.raises(NotImplementedError, match="^rope_type"):
        QSAConfig.from_dict(d)


# -- QSAOptions (RUNTIME §3) ------------------------------------------------------------------


def test_trace_options_equal_the_fixture_record():
    assert QSAOptions.trace().to_trace_dict() == first_record()["options"]
    assert tuple(QSAOptions().to_trace_dict()) == TRACE_OPTION_KEYS


def test_library_defaults_differ_from_the_trace_where_documented():
    lib, trace = QSAOptions(), QSAOptions.trace()
    differ = {k for k in QSAOptions.__dataclass_fields__ if getattr(lib, k) != getattr(trace, k)}
    assert differ == {"phase_prefill", "prefill_min_context", "gather_min_context"}
    assert (lib.flash_min, lib.prefill_gather, lib.vision_sparse) == (32768, True, False)


@pytest.mark.parametrize("value, effective", [(0, 2049), (2048, 2049), (2049, 2049), (5000, 5000)])
def test_prefill_min_context_is_raised_to_2049(value, effective):
    assert QSAOptions(prefill_min_context=value).effective_prefill_min_context == effective


BAD_OPTIONS = [
    ("fused", 1), ("compiled", "yes"), ("flash", None), ("vision_sparse", 0),
    ("prefill_min_rows", 0), ("prefill_compile_rows", 2048.0), ("prefill_workspace", 0),
    ("tile_rows", -1), ("gather_max_rows", 0), ("gather_min_context", -5), ("flash_min", True),
    ("prefill_min_context", -1),
]  # fmt: skip


@pytest.mark.parametrize("name, value", BAD_OPTIONS, ids=[f"{n}={v!r}" for n, v in BAD_OPTIONS])
def test_bad_option_names_the_option(name, value):
    with pytest.raises(ValueError, match=rf"^QSAOptions\.{name}:"):
        QSAOptions(**{name: value})
    with pytest.raises(ValueError, match=rf"^QSAOptions\.{name}:"):
        QSAOptions.trace().replace(**{name: value})


def test_replace_rejects_unknown_options():
    with pytest.raises(ValueError, match="unknown options"):
        QSAOptions().replace(flashh=False)


# -- RoPE frequencies and MRoPE axes (QSA.md §5) ----------------------------------------------


def test_frequency_table_equals_the_fixture():
    fx = first_record()["frequencies"]
    ours = inv_frequencies(QSAConfig())
    assert ours == fx and len(ours) == 32
    bits = [struct.unpack("<I", struct.pack("<f", f))[0] for f in ours]
    assert tuple(bits) == ROPE_FREQUENCY_BITS_1E7_64
    # The float64 formula rounded to float32 misses the table by up to 2 ulp (RUNTIME §10.1):
    # the table must be used verbatim, never recomputed.
    computed = np.float32(1e7 ** (-2.0 * np.arange(32) / 64))
    ulps = np.abs(computed - np.float32(ours)) / np.spacing(np.float32(ours))
    assert ulps.max() <= 2 and (ulps > 0).any()


def test_frequencies_of_other_geometries_are_float64_rounded():
    cfg = QSAConfig(
        hidden_size=32, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5,
        rope_theta=10_000.0, mrope_section=(3, 3, 2), indexer_n_heads=2, indexer_head_dim=16,
        indexer_budget=16,
    )  # fmt: skip
    expect = [float(np.float32(10_000.0 ** (-2.0 * i / 16))) for i in range(8)]
    assert inv_frequencies(cfg) == expect


def test_mrope_axes_of_the_real_section():
    axes = mrope_axes(QSAConfig())
    assert [i for i, a in enumerate(axes) if a == 1] == list(range(1, 32, 3))
    assert [i for i, a in enumerate(axes) if a == 2] == list(range(2, 30, 3))
    assert axes.count(0) == 32 - 11 - 10
    assert mrope_axes(QSAConfig(mrope_section=None)) == [0] * 32


def test_mrope_axes_short_sections_fall_back_to_t():
    cfg = QSAConfig(
        hidden_size=32, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5,
        mrope_section=(6, 1, 1), indexer_n_heads=2, indexer_head_dim=16, indexer_budget=16,
    )  # fmt: skip
    assert mrope_axes(cfg) == [0, 1, 2, 0, 0, 0, 0, 0]


# -- MRoPE layouts: interleaved (the model's) and chunked (`mrope_interleaved=False`) ---------


def _small_mrope(interleaved: bool, section: tuple[int, int, int] = (3, 3, 2)) -> QSAConfig:
    return QSAConfig(
        hidden_size=32, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5,
        rope_theta=10_000.0, mrope_section=section, mrope_interleaved=interleaved,
        indexer_n_heads=2, indexer_head_dim=16, indexer_budget=16,
    )  # fmt: skip


def _numpy_mrope_angles(pos: np.ndarray, cfg: QSAConfig, interleaved: bool) -> np.ndarray:
    """Per-pair float32 angles `[n, d_r/2]` built directly, the way HF builds them.

    Every axis gets its full frequency table; interleaved overwrites the H/W pairs in strides
    of 3 (Qwen3-VL), chunked concatenates contiguous section slices of T, H, W (Qwen2-VL).
    """
    freqs = np.asarray(inv_frequencies(cfg), np.float32)
    per_axis = pos.astype(np.float32)[:, :, None] * freqs[None, None, :]  # [3, n, d_r/2]
    sec = cfg.mrope_section
    if interleaved:
        out = per_axis[0].copy()
        for axis in (1, 2):
            cols = slice(axis, 3 * sec[axis], 3)
            out[:, cols] = per_axis[axis][:, cols]
        return out
    bounds = np.cumsum([0, *sec])
    return np.concatenate([per_axis[a][:, bounds[a] : bounds[a + 1]] for a in range(3)], axis=-1)


def test_mrope_axes_chunked_layout():
    assert mrope_axes(_small_mrope(False)) == [0, 0, 0, 1, 1, 1, 2, 2]
    assert mrope_axes(_small_mrope(True)) == [0, 1, 2, 0, 1, 2, 0, 1]
    real = mrope_axes(QSAConfig(mrope_interleaved=False))
    assert real == [0] * 11 + [1] * 11 + [2] * 10
    assert mrope_axes(QSAConfig(mrope_section=None, mrope_interleaved=False)) == [0] * 32


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "chunked"])
@pytest.mark.parametrize("section", [(3, 3, 2), (2, 2, 4), (6, 1, 1)])
def test_rope_tables_match_a_direct_numpy_construction(interleaved, section):
    import mlx.core as mx

    from mlx_qsa.rope import rope_tables

    cfg = _small_mrope(interleaved, section)
    t = np.arange(40, dtype=np.int32)
    pos = np.stack([t, 1000 + 3 * t, 2000 + 7 * t])  # three axes, all distinct
    want = _numpy_mrope_angles(pos, cfg, interleaved)
    cos, sin = rope_tables(mx.array(pos), cfg)
    np.testing.assert_allclose(np.array(cos), np.cos(want.astype(np.float64)), atol=2e-6)
    np.testing.assert_allclose(np.array(sin), np.sin(want.astype(np.float64)), atol=2e-6)
    # The other layout gives other angles for each of these sections: the flag is honoured.
    other_cfg = cfg.replace(mrope_interleaved=not interleaved)
    other_cos, _ = rope_tables(mx.array(pos), other_cfg)
    assert mrope_axes(cfg) != mrope_axes(other_cfg)
    assert not np.array_equal(np.array(cos), np.array(other_cos))


def test_from_dict_mrope_interleaved_defaults_to_the_dataclass():
    """An absent key means interleaved, as the dataclass default does; false is honoured."""
    assert QSAConfig.__dataclass_fields__["mrope_interleaved"].default is True
    rope = dict(hf_text_config()["rope_parameters"])
    del rope["mrope_interleaved"]
    cfg = QSAConfig.from_dict(hf_text_config(rope_parameters=rope))
    assert cfg.mrope_interleaved is True and cfg == QSAConfig()
    chunked = QSAConfig.from_dict(
        hf_text_config(rope_parameters={**rope, "mrope_interleaved": False})
    )
    assert chunked.mrope_interleaved is False and chunked == QSAConfig(mrope_interleaved=False)
    assert QSAConfig.from_dict(chunked.to_dict()) == chunked
    legacy = hf_text_config()
    del legacy["rope_parameters"]
    legacy["rope_scaling"] = {**rope, "type": "default", "mrope_interleaved": False}
    assert QSAConfig.from_dict(legacy).mrope_interleaved is False


@pytest.mark.parametrize("value", ["false", 0, None])
def test_mrope_interleaved_must_be_a_bool(value):
    with pytest.raises(ValueError, match="^mrope_interleaved:"):
        QSAConfig(mrope_interleaved=value)
    if value is not None:  # None in rope_parameters means "unset" (the default applies)
        rope = {**hf_text_config()["rope_parameters"], "mrope_interleaved": value}
        with pytest.raises(ValueError, match="^mrope_interleaved:"):
            QSAConfig.from_dict(hf_text_config(rope_parameters=rope))
