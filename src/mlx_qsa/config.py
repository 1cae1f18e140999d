"""Layer configuration (HF `Qwen4ExpTextConfig` names) and runtime options.

Pure Python: no MLX import, so routing code and tests can use it without arrays.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any

INDEXER_KEYS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


def field_hash(self: Any) -> int:
    """A frozen dataclass's hash of its fields, computed once per object. Configs, options and
    compiled keys are hashed on every layer call (``lru_cache`` keys, table lookups); the
    generated ``__hash__`` rebuilds the tuple of every field each time."""
    h = self.__dict__.get("_field_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        self.__dict__["_field_hash"] = h  # not a field: equality, repr and replace ignore it
    return h


@dataclass(frozen=True)
class QSAConfig:
    """Geometry of one QSA layer. Defaults are Qwen3.8-Flash-Next's (QSA.md §2)."""

    __hash__ = field_hash

    hidden_size: int = 2560
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rope_type: str = "default"
    mrope_section: tuple[int, ...] | None = (11, 11, 10)
    mrope_interleaved: bool = True
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    indexer_n_heads: int | None = 4
    indexer_kv_heads: int | None = 1
    indexer_head_dim: int | None = 128
    indexer_budget: int | None = 2048
    indexer_compress_ratio: int | None = 4
    max_position_embeddings: int = 262_144

    def __post_init__(self) -> None:
        if self.mrope_section is not None and not isinstance(self.mrope_section, tuple):
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        validate(self)

    # -- derived geometry -------------------------------------------------------------
    @property
    def has_indexer(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def block_topk(self) -> int:
        """K_b = B / r, blocks kept by the top-k (0 without an indexer)."""
        if not self.has_indexer:
            return 0
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def has_mrope_axes(self) -> bool:
        return self.mrope_section is not None

    @property
    def index_proj_width(self) -> int:
        if not self.has_indexer:
            return 0
        return (self.indexer_n_heads + self.indexer_kv_heads) * self.indexer_head_dim

    @property
    def q_proj_width(self) -> int:
        """Gated q_proj: per head a query slab then a gate slab (QSA.md §4)."""
        return 2 * self.num_attention_heads * self.head_dim

    @property
    def kv_proj_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def replace(self, **changes: Any) -> QSAConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QSAConfig:
        """Build from an HF `Qwen4ExpTextConfig` dictionary (or a full config with `text_config`).

        RoPE fields are read from nested `rope_parameters` (or legacy `rope_scaling`) with
        top-level keys as a fallback. Unknown keys are ignored, as HF configs carry many.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config: expected a dict, got {type(d).__name__}")
        if "text_config" in d and isinstance(d["text_config"], dict):
            d = d["text_config"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters: expected a dict, got {type(rope).__name__}")

        def pick(key: str, default: Any) -> Any:
            if key in rope and rope[key] is not None:
                return rope[key]
            return d.get(key, default)

        base = cls.__dataclass_fields__
        kw: dict[str, Any] = {}
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "attention_bias",
            "max_position_embeddings",
        ):
            if name in d:
                kw[name] = d[name]
        kw["head_dim"] = d.get(
            "head_dim",
            kw.get("hidden_size", base["hidden_size"].default)
            // kw.get("num_attention_heads", base["num_attention_heads"].default),
        )
        for name in INDEXER_KEYS:
            kw[name] = d.get(name)
        kw["partial_rotary_factor"] = pick("partial_rotary_factor", 1.0)
        kw["rope_theta"] = pick("rope_theta", 10_000.0)
        kw["rope_type"] = pick("rope_type", pick("type", "default"))
        section = pick("mrope_section", None)
        kw["mrope_section"] = tuple(section) if section is not None else None
        # An absent key means the interleaved layout, the dataclass default: QSA.md §5 gives
        # the interleaved axis rule as the model's MRoPE (Qwen3-VL lineage, whose HF rotary
        # embedding interleaves unconditionally); an explicit false selects the chunked one.
        kw["mrope_interleaved"] = pick("mrope_interleaved", base["mrope_interleaved"].default)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """HF-style dictionary (round-trips through `from_dict`)."""
        d = {
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {
                "rope_type": self.rope_type,
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_interleaved": self.mrope_interleaved,
            },
        }
        if self.mrope_section is not None:
            d["rope_parameters"]["mrope_section"] = list(self.mrope_section)
        for name in INDEXER_KEYS:
            d[name] = getattr(self, name)
        return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(cfg: QSAConfig) -> None:
    """QSA.md §2 validation; raises ValueError naming the offending key."""
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        v = getattr(cfg, name)
        if not _is_int(v) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if not isinstance(cfg.rms_norm_eps, (int, float)) or not cfg.rms_norm_eps > 0:
        raise ValueError(f"rms_norm_eps: expected a positive float, got {cfg.rms_norm_eps!r}")
    if not isinstance(cfg.rope_theta, (int, float)) or not cfg.rope_theta > 0:
        raise ValueError(f"rope_theta: expected a positive number, got {cfg.rope_theta!r}")
    prf = cfg.partial_rotary_factor
    if not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        raise ValueError(f"partial_rotary_factor: expected a number in (0, 1], got {prf!r}")
    if cfg.rope_type != "default":
        raise NotImplementedError(
            f"rope_type: only 'default' RoPE is implemented, got {cfg.rope_type!r}"
        )

    present = [k for k in INDEXER_KEYS if getattr(cfg, k) is not None]
    if present and len(present) != len(INDEXER_KEYS):
        missing = [k for k in INDEXER_KEYS if getattr(cfg, k) is None]
        raise ValueError(
            f"{missing[0]}: the indexer keys must be all set or all unset; "
            f"set {present}, unset {missing}"
        )
    if present:
        for k in INDEXER_KEYS:
            v = getattr(cfg, k)
            if not _is_int(v) or v <= 0:
                raise ValueError(f"{k}: expected a positive int, got {v!r}")
        if cfg.indexer_kv_heads != 1:
            raise ValueError(f"indexer_kv_heads: expected 1, got {cfg.indexer_kv_heads}")
        if cfg.indexer_budget % cfg.indexer_compress_ratio != 0:
            raise ValueError(
                f"indexer_budget: must be divisible by indexer_compress_ratio="
                f"{cfg.indexer_compress_ratio}, got {cfg.indexer_budget}"
            )
        if cfg.rotary_dim > cfg.indexer_head_dim:
            raise ValueError(
                f"indexer_head_dim: must be >= the rotary dim int(head_dim * "
                f"partial_rotary_factor)={cfg.rotary_dim}, got {cfg.indexer_head_dim}"
            )

    if cfg.num_attention_heads % cfg.num_key_value_heads != 0:
        raise ValueError(
            f"num_key_value_heads: must divide num_attention_heads={cfg.num_attention_heads}, "
            f"got {cfg.num_key_value_heads}"
        )
    d_r = cfg.rotary_dim
    if d_r <= 0 or d_r % 2 != 0 or d_r > cfg.head_dim:
        raise ValueError(
            f"partial_rotary_factor: rotary dim int(head_dim * factor) must be even and in "
            f"[2, head_dim={cfg.head_dim}], got {d_r}"
        )
    if not isinstance(cfg.mrope_interleaved, bool):
        raise ValueError(f"mrope_interleaved: expected a bool, got {cfg.mrope_interleaved!r}")
    if cfg.mrope_section is not None:
        sec = cfg.mrope_section
        if len(sec) != 3 or not all(_is_int(s) and s >= 0 for s in sec):
            raise ValueError(f"mrope_section: expected 3 non-negative ints, got {list(sec)}")
        if sum(sec) != d_r // 2:
            raise ValueError(
                f"mrope_section: must sum to rotary_dim / 2 = {d_r // 2}, got sum {sum(sec)}"
            )


# ------------------------------------------------------------------------------------
# Runtime options (RUNTIME.md §3)

# The 15 options of the trace record, in table order.
TRACE_OPTION_KEYS = (
    "fused",
    "compiled",
    "prefill",
    "phase_prefill",
    "prefill_min_rows",
    "prefill_compile_rows",
    "prefill_min_context",
    "prefill_workspace",
    "tile_rows",
    "flash",
    "gather_decode",
    "gather",
    "gather_max_rows",
    "gather_min_context",
    "tf32",
)

KERNEL_CHOICES = ("auto", "portable")

_BOOL_OPTIONS = (
    "fused",
    "compiled",
    "prefill",
    "phase_prefill",
    "flash",
    "gather_decode",
    "gather",
    "tf32",
    "prefill_gather",
    "vision_sparse",
)
_INT_OPTIONS = (
    ("prefill_min_rows", 1),
    ("prefill_compile_rows", 1),
    ("prefill_min_context", 0),
    ("prefill_workspace", 1),
    ("tile_rows", 0),
    ("gather_max_rows", 1),
    ("gather_min_context", 0),
    ("flash_min", 0),
)


@dataclass(frozen=True)
class QSAOptions:
    """Every runtime knob of RUNTIME.md §3. Defaults are the library defaults.

    `QSAOptions.trace()` gives the trace defaults (differences: `phase_prefill`,
    `prefill_min_context`, `gather_min_context`). `prefill_min_context` below 2049 is raised
    to 2049 when used (see `effective_prefill_min_context`). `tf32` records the process's
    `MLX_ENABLE_TF32`; it never changes a result.
    """

    __hash__ = field_hash

    fused: bool = True
    compiled: bool = True
    prefill: bool = True
    phase_prefill: bool = False
    prefill_min_rows: int = 32
    prefill_compile_rows: int = 2048
    prefill_min_context: int = 32768
    prefill_workspace: int = 134_217_728
    tile_rows: int = 0
    flash: bool = True
    gather_decode: bool = False
    gather: bool = True
    gather_max_rows: int = 8
    gather_min_context: int = 16384
    tf32: bool = True
    # Record-level knobs (not part of the trace's `options` object).
    flash_min: int = 32768
    prefill_gather: bool = True
    vision_sparse: bool = False
    # Implementation choice, never a routing input: "auto" runs the CUDA kernels where MLX
    # runs on an NVIDIA GPU and the kernel supports the shapes; "portable" forces portable MLX.
    kernels: str = "auto"

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(
                f"QSAOptions.kernels: expected one of {KERNEL_CHOICES}, got {self.kernels!r}"
            )
        for name in _BOOL_OPTIONS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"QSAOptions.{name}: expected a bool, got {v!r}")
        for name, low in _INT_OPTIONS:
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise ValueError(f"QSAOptions.{name}: expected an int >= {low}, got {v!r}")

    @classmethod
    def trace(cls, **changes: Any) -> QSAOptions:
        """The trace defaults of RUNTIME.md §3 (with `changes` applied)."""
        base = dict(phase_prefill=True, prefill_min_context=2049, gather_min_context=0)
        base.update(changes)
        return cls(**base)

    @property
    def effective_prefill_min_context(self) -> int:
        return max(2049, self.prefill_min_context)

    def replace(self, **changes: Any) -> QSAOptions:
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"QSAOptions: unknown options {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_trace_dict(self) -> dict[str, Any]:
        """The trace record's `options` object (15 keys, table order)."""
        return {k: getattr(self, k) for k in TRACE_OPTION_KEYS}


# ------------------------------------------------------------------------------------
# RoPE inverse frequencies (QSA.md §5, RUNTIME.md §9.1 / §10.1)

# float32 bits of f_i = theta^(-2i/d_r) for theta = 1e7, d_r = 64, used verbatim.
ROPE_FREQUENCY_BITS_1E7_64 = (
    0x3F800000, 0x3F1AB32B, 0x3EBAF81A, 0x3E61F835, 0x3E088D77, 0x3DA50956, 0x3D47763E, 0x3CF11177,
    0x3C91AD39, 0x3C301051, 0x3BD4CA14, 0x3B80967D, 0x3B1B690D, 0x3ABBD3ED, 0x3A6301E0, 0x3A092E02,
    0x39A5CB60, 0x394860C1, 0x38F22CE2, 0x3892587E, 0x3830DF51, 0x37D5C441, 0x37812DAB, 0x371C1FC3,
    0x36BCB0C1, 0x36640CC6, 0x3609CF4A, 0x35A68E4B, 0x35494C57, 0x34F3499B, 0x3493048D, 0x3431AF43,
)  # fmt: skip


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def inv_frequencies(cfg: QSAConfig) -> list[float]:
    """The d_r/2 inverse frequencies as float32 values (Python floats, exactly representable).

    The fixed table for theta = 1e7, d_r = 64; otherwise computed in float64 and rounded.
    """
    d_r = cfg.rotary_dim
    if cfg.rope_theta == 10_000_000.0 and d_r == 64:
        return [struct.unpack("<f", struct.pack("<I", b))[0] for b in ROPE_FREQUENCY_BITS_1E7_64]
    return [_f32(float(cfg.rope_theta) ** (-2.0 * i / d_r)) for i in range(d_r // 2)]


def mrope_axes(cfg: QSAConfig) -> list[int]:
    """Axis (0 = T, 1 = H, 2 = W) that drives each frequency pair i (QSA.md §5).

    Interleaved (`mrope_interleaved`, the model's layout): pair i takes H if `i % 3 == 1`
    and `i < 3·sec_H`, W if `i % 3 == 2` and `i < 3·sec_W`, else T. Chunked
    (`mrope_interleaved=False`, the Qwen2-VL layout): contiguous runs, pairs
    `[0, sec_T)` take T, the next sec_H take H, the last sec_W take W.
    Without `mrope_section` every pair uses axis T (1-D RoPE).
    """
    n = cfg.rotary_dim // 2
    if cfg.mrope_section is None:
        return [0] * n
    sec_t, sec_h, sec_w = cfg.mrope_section
    if not cfg.mrope_interleaved:
        return [0] * sec_t + [1] * sec_h + [2] * sec_w  # validate: the sections sum to n
    axes = []
    for i in range(n):
        if i % 3 == 1 and i < 3 * sec_h:
            axes.append(1)
        elif i % 3 == 2 and i < 3 * sec_w:
            axes.append(2)
        else:
            axes.append(0)
    return axes
