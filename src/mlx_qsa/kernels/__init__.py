"""CUDA kernels (``.cu`` sources beside their launchers) and the choice of implementation.

Routing (plan.py) picks algorithms; this module only decides which implementation of an
algorithm runs: the CUDA kernel on an NVIDIA GPU, the portable MLX code everywhere else.
"""

from __future__ import annotations

import mlx.core as mx

from ..config import KERNEL_CHOICES
from .device import DeviceLimits, current, kernels_unsupported


def resolve_impl(kernels: str = "auto") -> str:
    """ "cuda" when `kernels == "auto"` and MLX's default device is a CUDA GPU the kernels run
    on (sm_80 or newer), else "portable"."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels: expected one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "portable":
        return "portable"
    if mx.default_device().type != mx.DeviceType.gpu or not mx.cuda.is_available():
        return "portable"
    return impl_for(kernels, current())


def impl_for(kernels: str, limits: DeviceLimits | None) -> str:
    """The implementation for a CUDA GPU with `limits` (None: not a CUDA GPU)."""
    if kernels == "portable" or limits is None or kernels_unsupported(limits) is not None:
        return "portable"
    return "cuda"
