"""What the CUDA kernels need from the GPU, and what this GPU offers.

The decode, selector and prefill kernels use bf16 `mma.sync`, `ldmatrix` and `cp.async`
(sm_80 and newer); the GEMM families `wgmma`, `tma` and `tma_mc` use Hopper's warpgroup MMA,
TMA and `setmaxnreg` (sm_90a only). Shared memory per block differs by GPU (opt-in maximum:
227 KiB on sm_90 and sm_100, 163 KiB on sm_80 and sm_87, 99 KiB on sm_86, sm_89 and sm_120), and
a launch that asks for more fails. The rules here are pure (they take a `DeviceLimits`);
`current()` reads the limits of MLX's GPU once.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

KERNELS_MIN_CC = (8, 0)  # bf16 mma.sync m16n8k16, ldmatrix, cp.async
HOPPER_CC = (9, 0)  # wgmma, TMA tensor maps, setmaxnreg, clusters (sm_90a)
# CUdevice_attribute values (cuda.h)
_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


@dataclass(frozen=True)
class DeviceLimits:
    compute_capability: tuple[int, int]
    max_shared_memory: int  # dynamic shared memory one block may opt in to, bytes

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


# Opt-in shared memory per block by compute capability (CUDA programming guide), used when the
# driver cannot be asked.
OPT_IN_SHARED_MEMORY = {
    (8, 0): 166_912,
    (8, 6): 101_376,
    (8, 7): 166_912,
    (8, 9): 101_376,
    (9, 0): 232_448,
    (10, 0): 232_448,
    (12, 0): 101_376,
}
HOPPER = DeviceLimits(HOPPER_CC, OPT_IN_SHARED_MEMORY[HOPPER_CC])  # H100 / H200


def kernels_unsupported(limits: DeviceLimits) -> str | None:
    """Why the decode / selector / prefill kernels cannot run on this GPU, or None."""
    if limits.compute_capability < KERNELS_MIN_CC:
        return (
            f"the CUDA kernels need sm_80 or newer (bf16 mma.sync, cp.async); this GPU is "
            f"{limits.arch}"
        )
    return None


def hopper_unsupported(limits: DeviceLimits) -> str | None:
    """Why Hopper-only code (wgmma, TMA, setmaxnreg, clusters) cannot run here, or None."""
    if limits.compute_capability != HOPPER_CC:
        return f"needs sm_90a (Hopper: wgmma, TMA); this GPU is {limits.arch}"
    return None


def shared_memory_unsupported(limits: DeviceLimits, nbytes: int, what: str) -> str | None:
    """Why a block of `what` asking for `nbytes` of shared memory cannot launch here, or None."""
    if nbytes > limits.max_shared_memory:
        return (
            f"{what} needs {nbytes} bytes of shared memory per block; {limits.arch} allows "
            f"{limits.max_shared_memory}"
        )
    return None


MLX_OPT_IN_ABOVE = 48000  # MLX raises a kernel's dynamic shared memory limit only above this
DEFAULT_BLOCK_SMEM = 49152  # static + dynamic shared memory a block gets without that opt-in
STATIC_SMEM_BOUND = 4096  # above the static shared memory of every kernel of ours (kernel_ptx.py)


def dynamic_smem_request(nbytes: int) -> int:
    """The dynamic shared memory to ask MLX for when a kernel needs `nbytes`: `nbytes`, or just
    over MLX's opt-in threshold when `nbytes` plus the kernel's static shared memory would pass
    the 48 KiB default while `nbytes` alone stays under the threshold (the launch would fail)."""
    if nbytes <= MLX_OPT_IN_ABOVE and nbytes + STATIC_SMEM_BOUND > DEFAULT_BLOCK_SMEM:
        return MLX_OPT_IN_ABOVE + 16
    return nbytes


def resolve(limits: DeviceLimits | None) -> DeviceLimits | None:
    """`limits` when given, else this GPU's (None without MLX's CUDA backend)."""
    return limits if limits is not None else current()


@functools.cache
def current() -> DeviceLimits | None:
    """Limits of MLX's GPU (device 0), or None without MLX's CUDA backend."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return None
    info = mx.device_info(mx.gpu)
    cc = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
    try:
        smem = device_attribute(_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    except RuntimeError:
        smem = OPT_IN_SHARED_MEMORY.get(cc, min(OPT_IN_SHARED_MEMORY.values()))
    return DeviceLimits(cc, smem)


# ---- the CUDA driver (loaded on first use only) ---------------------------------------


@functools.cache
def driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise RuntimeError(
            f"reading CUDA device attributes needs the driver library libcuda.so.1: {err}"
        ) from err
    check_cu(lib.cuInit(0), "cuInit")
    return lib


def check_cu(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUresult {code}")


@functools.cache
def device_attribute(attribute: int, device: int = 0) -> int:
    """`cuDeviceGetAttribute(attribute)` of CUDA device `device`."""
    lib = driver()
    handle = ctypes.c_int()
    check_cu(lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), "cuDeviceGet")
    value = ctypes.c_int()
    check_cu(
        lib.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(attribute), handle),
        f"cuDeviceGetAttribute({attribute})",
    )
    return value.value


def sm_count(device: int = 0) -> int:
    """Streaming multiprocessors of CUDA device `device` (the persistent grid's size)."""
    return device_attribute(_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
