"""mlx-qsa: QSA (Qwen sparse attention) for MLX.

Public names are loaded lazily so that `mlx_qsa.cli` / `mlx_qsa.sweep` can set MLX's
environment variables (e.g. MLX_ENABLE_TF32) before MLX itself is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CallInfo": "layer",
    "Capabilities": "plan",
    "QSAAttention": "layer",
    "QSACache": "cache",
    "QSAConfig": "config",
    "QSAOptions": "config",
    "VisionState": "layer",
    "sanitize": "weights",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'mlx_qsa' has no attribute {name!r}")
