"""PTX of the custom GEMM kernels, without a GPU: each plan's source as `gemm_registers.py`
builds it (MLX's signature, the plan's header and body), compiled by nvcc for sm_90a. Two
trees' outputs compared file by file show whether a source change altered any kernel's code.

    python3 benchmarks/gemm_ptx.py OUT_DIR [TILE/WARPS/FAMILY ...]    # then: diff -r A B

The default plans use every wgmma N extent that gemm.cuh wraps (64, 96, 128, 192, 256), both
TMA and cp.async families, and the mma.sync family.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gemm_registers import kernel_source, parse_config

from mlx_qsa.kernels.gemm import plan_gemm, wgmma_n

DEFAULT = [
    "128x64x64/4/tma",
    "128x96x64/4/tma",
    "128x128x64/4/tma",
    "64x192x64/4/tma",
    "64x256x64/4/tma",
    "192x192x64/8/tma",
    "192x192x64/12/tma",
    "128x256x64/8/auto",
    "128x128x64/4/wgmma",
    "128x128x128/8/mma",
]


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for text in argv[1:] or DEFAULT:
        tile, warps, family = parse_config(text)
        plan = plan_gemm(tile, warps, 8, family=family)
        name = text.replace("/", "_")
        src = out / f"{name}.cu"
        src.write_text(kernel_source(plan))
        # nvcc in place of NVRTC: MLX's sources rely on NVRTC's device-default functions only
        # through constexpr helpers, which --expt-relaxed-constexpr admits.
        cmd = ["nvcc", "-ptx", "-arch=sm_90a", "-std=c++17", "--expt-relaxed-constexpr"]
        r = subprocess.run([*cmd, "-o", str(out / f"{name}.ptx"), str(src)], capture_output=True)
        failed |= r.returncode != 0
        status = "ok" if r.returncode == 0 else r.stderr.decode()[-600:]
        print(f"{text:<22} wgmma N {wgmma_n(plan)}: {status}")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
