"""HF weight conversion: `sanitize(weights) -> weights` for a QSAAttention of a fusion level.

Input keys are HF names relative to `self_attn.` (`q_proj.weight`, ...,
`indexer.index_qk_proj.weight`); output keys are the layer's parameter names. Fused levels
concatenate rows segment by segment: [q; k; v] (3) and [q; k; v; index_qk] (4).

Idempotent (STYLE.md: converting twice must not shift the norms twice). The output is a
`SanitizedWeights` (a dict that remembers its fusion level), and a fused output is also
recognisable by its keys (`qkv_proj.weight` / `qkvi_proj.weight`, never in a checkpoint).
Input in either form is already in the layer's form: it is checked and returned as is,
without a second `+1` fold (QSA.md §3 folds once, when an HF checkpoint is loaded).
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


FUSED_NAMES = {3: "qkv_proj.weight", 4: "qkvi_proj.weight"}


class SanitizedWeights(dict):
    """`sanitize`'s output: the layer's parameter names, plain norms, fused for `fused`.

    The type is the in-memory marker that makes a second `sanitize` a no-op; it does not
    survive a round trip through a file (a saved level-0 set looks like a checkpoint there,
    so reload it with `layer.load_weights` or `zero_centered_norms=False`).
    """

    def __init__(self, items: dict[str, mx.array], fused: int) -> None:
        super().__init__(items)
        self.fused = fused


def sanitized_level(weights: dict[str, mx.array]) -> int | None:
    """The fusion level of weights already in the layer's form, or None for HF form."""
    if isinstance(weights, SanitizedWeights):
        return weights.fused
    keys = {k.removeprefix("self_attn.") for k in weights}
    for level, name in FUSED_NAMES.items():
        if name in keys:
            return level
    return None


def layer_keys(cfg: QSAConfig, fused: int) -> list[str]:
    """Parameter names of a layer of fusion level `fused` (what `sanitize` returns)."""
    keys = expected_keys(cfg)
    if fused == 0:
        return keys
    merged = {"q_proj.weight", "k_proj.weight", "v_proj.weight"}
    if fused == 4:
        merged.add("indexer.index_qk_proj.weight")
    return [FUSED_NAMES[fused]] + [k for k in keys if k not in merged]


def sanitize(
    weights: dict[str, mx.array],
    cfg: QSAConfig,
    fused: int = 0,
    zero_centered_norms: bool | None = None,
) -> SanitizedWeights:
    """Convert HF-named tensors to this library's parameters for fusion level `fused`.

    `zero_centered_norms` says what form the norm weights are in:
    - None (default): from the source format. HF-form input is a checkpoint, whose
      zero-centred norm weights (`RMSNorm(v) * (1 + w)`) become the stored plain form
      `dtype(1 + w)` (QSA.md §3); input already in the layer's form (a `SanitizedWeights`, or
      fused keys) is returned unchanged, so `sanitize(sanitize(w)) == sanitize(w)`.
    - True: the input is a checkpoint; already-sanitized input raises ValueError instead of
      being folded a second time.
    - False: the norms are already plain (e.g. RUNTIME §9.1 synthetic weights): no fold.
    Pure: the input is not modified. A `self_attn.` prefix on keys is stripped.
    """
    if fused not in (0, 3, 4):
        raise ValueError(f"fused: expected 0, 3 or 4, got {fused!r}")
    if zero_centered_norms is not None and not isinstance(zero_centered_norms, bool):
        raise ValueError(
            f"zero_centered_norms: expected True, False or None, got {zero_centered_norms!r}"
        )
    level = sanitized_level(weights)
    w = {k.removeprefix("self_attn."): v for k, v in weights.items()}
    if level is not None:
        return _already_sanitized(w, cfg, fused, level, zero_centered_norms)
    missing = [k for k in expected_keys(cfg) if k not in w]
    if missing:
        raise ValueError(f"weights: missing {missing}")
    _check_shapes(w, cfg)
    out = dict(w)
    if zero_centered_norms is not False:
        for k in NORMS:
            if k in out:
                v = out[k]
                out[k] = (1.0 + v.astype(mx.float32)).astype(v.dtype)
    if fused == 0:
        return SanitizedWeights(out, 0)
    parts = [out.pop("q_proj.weight"), out.pop("k_proj.weight"), out.pop("v_proj.weight")]
    if fused == 4:
        parts.append(out.pop("indexer.index_qk_proj.weight"))
    out[FUSED_NAMES[fused]] = mx.concatenate(parts, axis=0)
    return SanitizedWeights(out, fused)


def _already_sanitized(
    w: dict[str, mx.array], cfg: QSAConfig, fused: int, level: int, zero_centered: bool | None
) -> SanitizedWeights:
    """Input in the layer's form: check it and hand it back (no second fold)."""
    if zero_centered:
        raise ValueError(
            "zero_centered_norms: the weights are already sanitized (the layer's form, "
            f"fusion level {level}, norms plain); folding +1 again would shift the norms "
            "twice. Pass zero_centered_norms=None (detect) or False"
        )
    if level != fused:
        raise ValueError(
            f"fused: the weights are already sanitized for fusion level {level}, this layer "
            f"is level {fused}; sanitize the HF checkpoint for level {fused} instead"
        )
    missing = [k for k in layer_keys(cfg, fused) if k not in w]
    if missing:
        raise ValueError(f"weights: missing {missing}")
    _check_shapes(w, cfg)
    if fused:
        width = cfg.q_proj_width + 2 * cfg.kv_proj_width
        width += cfg.index_proj_width if fused == 4 else 0
        shape = (width, cfg.hidden_size)
        name = FUSED_NAMES[fused]
        if tuple(w[name].shape) != shape:
            raise ValueError(
                f"weights[{name!r}]: expected shape {list(shape)}, got {list(w[name].shape)}"
            )
    return SanitizedWeights(w, fused)
