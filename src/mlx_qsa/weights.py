"""HF weight conversion: `sanitize(weights) -> weights` for a QSAAttention of a fusion level.

Input keys are HF names relative to `self_attn.` (`q_proj.weight`, ...,
`indexer.index_qk_proj.weight`); output keys are the layer's parameter names. Fused levels
concatenate rows segment by segment: [q; k; v] (3) and [q; k; v; index_qk] (4).
"""

from __future__ import annotations

import mlx.core as mx

from .config import QSAConfig

NORMS = (
    "q_norm.weight",
    "k_norm.weight",
    "indexer.q_layernorm.weight",
    "indexer.k_layernorm.weight",
)


def expected_keys(cfg: QSAConfig) -> list[str]:
    keys = [
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
        "q_norm.weight",
        "k_norm.weight",
    ]
    if cfg.attention_bias:
        keys += ["q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"]
    if cfg.has_indexer:
        keys += [
            "indexer.index_qk_proj.weight",
            "indexer.q_layernorm.weight",
            "indexer.k_layernorm.weight",
        ]
    return keys


def _check_shapes(w: dict[str, mx.array], cfg: QSAConfig) -> None:
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    want = {
        "q_proj.weight": (cfg.q_proj_width, D),
        "k_proj.weight": (cfg.kv_proj_width, D),
        "v_proj.weight": (cfg.kv_proj_width, D),
        "o_proj.weight": (D, H * d),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "q_proj.bias": (cfg.q_proj_width,),
        "k_proj.bias": (cfg.kv_proj_width,),
        "v_proj.bias": (cfg.kv_proj_width,),
        "o_proj.bias": (D,),
    }
    if cfg.has_indexer:
        want.update(
            {
                "indexer.index_qk_proj.weight": (cfg.index_proj_width, D),
                "indexer.q_layernorm.weight": (cfg.indexer_head_dim,),
                "indexer.k_layernorm.weight": (cfg.indexer_head_dim,),
            }
        )
    for k, shape in want.items():
        if k in w and tuple(w[k].shape) != shape:
            raise ValueError(
                f"weights[{k!r}]: expected shape {list(shape)}, got {list(w[k].shape)}"
            )


def sanitize(
    weights: dict[str, mx.array], cfg: QSAConfig, fused: int = 0, zero_centered_norms: bool = True
) -> dict[str, mx.array]:
    """Convert HF-named tensors to this library's parameters for fusion level `fused`.

    Zero-centred norm weights (`RMSNorm(v) * (1 + w)`) become the stored plain form
    `bf16(1 + w)` when `zero_centered_norms` (QSA.md §3). Pure: the input is not modified.
    A `self_attn.` prefix on keys is stripped.
    """
    w = {k.removeprefix("self_attn."): v for k, v in weights.items()}
    missing = [k for k in expected_keys(cfg) if k not in w]
    if missing:
        raise ValueError(f"weights: missing {missing}")
    _check_shapes(w, cfg)
    out = dict(w)
    if zero_centered_norms:
        for k in NORMS:
            if k in out:
                v = out[k]
                out[k] = (1.0 + v.astype(mx.float32)).astype(v.dtype)
    if fused == 0:
        return out
    parts = [out.pop("q_proj.weight"), out.pop("k_proj.weight"), out.pop("v_proj.weight")]
    if fused == 3:
        out["qkv_proj.weight"] = mx.concatenate(parts, axis=0)
    elif fused == 4:
        parts.append(out.pop("indexer.index_qk_proj.weight"))
        out["qkvi_proj.weight"] = mx.concatenate(parts, axis=0)
    else:
        raise ValueError(f"fused: expected 0, 3 or 4, got {fused!r}")
    return out
