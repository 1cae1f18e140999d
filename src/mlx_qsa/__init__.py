"""mlx-qsa: QSA (Qwen sparse attention) for MLX.

Public names: the layer and its cache, configuration and options, capability profiles,
weight conversion and the vision RoPE state.
"""

from .cache import QSACache
from .config import QSAConfig, QSAOptions
from .layer import CallInfo, QSAAttention, VisionState
from .plan import Capabilities
from .weights import sanitize

__all__ = [
    "CallInfo",
    "Capabilities",
    "QSAAttention",
    "QSACache",
    "QSAConfig",
    "QSAOptions",
    "VisionState",
    "sanitize",
]
__version__ = "0.1.0"
