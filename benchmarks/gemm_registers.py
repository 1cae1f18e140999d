"""Registers per thread of the custom GEMM kernels as NVRTC compiles them, without a GPU.

Builds each plan's kernel the way `mx.fast.cuda_kernel` does (the header and body from
`kernels.gemm.kernel_text`, MLX's signature with `Shape` arguments by value, its NVRTC options
`--device-as-default-execution-space --gpu-architecture=sm_90a`), asks ptxas for its resource
report, and says whether the block's warps fit the register file (64K registers in four
sub-partitions of 16K; warp w runs on sub-partition w % 4). MLX's own device
header is replaced by a stand-in `Shape`; the kernels use nothing else from it.

Needs libnvrtc (pip install nvidia-cuda-nvrtc) and the CUDA headers (cuda_bf16.h):

    python3 benchmarks/gemm_registers.py [--nvrtc PATH] [--include DIR] [TILE/WARPS/FAMILY ...]
    e.g. 192x192x64/8/tma 128x256x64/8/auto
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import re
import sys
from pathlib import Path

from mlx_qsa.kernels.gemm import GemmPlan, kernel_text, plan_gemm

REGISTER_FILE = 65536
DEFAULT = [
    "128x256x64/8/tma",
    "256x128x64/8/tma",
    "192x192x64/8/tma",
    "128x192x64/8/tma",
    "128x128x64/4/tma",
    "64x256x64/4/tma",
    "128x256x64/8/auto",
    "64x128x256/4/auto",
    "128x128x128/8/mma",
]


def kernel_source(plan: GemmPlan) -> str:
    header, body = kernel_text(plan)
    params = []
    for name in ["x", "w", "b"] + (["tmaps"] if plan.tma else []):
        params.append(f"const {'uint64_t' if name == 'tmaps' else '__nv_bfloat16'}* {name}")
        if name in ("x", "w"):
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params += ["__nv_bfloat16* y"] + (["uint8_t* scratch"] if plan.tma else [])
    return (
        "#include <cuda_bf16.h>\n#include <cuda/std/cstdint>\n"
        "using cuda::std::uint64_t;\nusing cuda::std::uint8_t;\n"
        "namespace mlx::core::cu {\nstruct Shape {\n  int d[8];\n"
        "  __device__ int operator[](int i) const { return d[i]; }\n};\n}\n"
        + header
        + "namespace mlx::core::cu {\n__global__ void qsa_kernel("
        + ", ".join(params)
        + ") {\n"
        + body
        + "\n}\n}\n"
    )


def ptxas_report(lib: ctypes.CDLL, source: str, includes: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [
        b"--device-as-default-execution-space",
        b"--gpu-architecture=sm_90a",
        b"--ptxas-options=-v",
        *(f"--include-path={d}".encode() for d in includes),
    ]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def parse_config(text: str) -> tuple[tuple[int, int, int], int, str]:
    tile, warps, family = text.split("/")
    tm, tn, tk = (int(v) for v in tile.lower().split("x"))
    return (tm, tn, tk), int(warps), family


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=DEFAULT, help="TMxTNxTK/WARPS/FAMILY")
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (default: the pip package's)")
    ap.add_argument("--include", action="append", help="CUDA include directory (repeatable)")
    args = ap.parse_args(argv)
    pattern = f"{sys.prefix}/lib/python3*/site-packages/nvidia/cu1*/lib/libnvrtc.so.1*"
    path = args.nvrtc or next(iter(sorted(glob.glob(pattern))), None)
    if path is None:
        print("gemm_registers: no libnvrtc found; pip install nvidia-cuda-nvrtc or pass --nvrtc")
        return 2
    # NVRTC dlopens its builtins library by soname: load it first from the same directory.
    for builtins in sorted(glob.glob(str(Path(path).parent / "libnvrtc-builtins.so.*"))):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    includes = args.include or ["/usr/local/cuda/include", "/usr/local/cuda/include/cccl"]
    worst = 0
    for text in args.configs:
        tile, warps, family = parse_config(text)
        plan = plan_gemm(tile, warps, 8, family=family)
        rc, log = ptxas_report(lib, kernel_source(plan), includes)
        if rc:
            print(f"{plan.label:<34} compile failed:\n{log[-1500:]}")
            worst = 1
            continue
        regs = int(re.findall(r"Used (\d+) registers", log)[-1])
        spill = int(re.findall(r"(\d+) bytes spill stores", log)[-1])
        per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
        # Each of the SM's four sub-partitions holds a quarter of the file; warp w runs on w % 4.
        fits = per_warp * -(-(plan.threads // 32) // 4) <= REGISTER_FILE // 4
        worst |= not fits
        print(
            f"{plan.label:<34} threads {plan.threads:>3}  registers {regs:>3}  "
            f"spill stores {spill:>4} B  {'fits' if fits else 'DOES NOT FIT'}"
        )
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
