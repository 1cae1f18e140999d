"""PTX of the decode/prefill kernels as `mx.fast.cuda_kernel` would build them, without a GPU:
the header (common.cuh, where the body uses it) and the sections of each `.cu`, behind MLX's
generated signature (a stand-in `Shape`/`Strides`), compiled by nvcc for sm_90a with comments
stripped. Two trees'
outputs compared line by line show whether a source change altered any kernel's code.

    python3 benchmarks/kernel_ptx.py OUT_DIR [JOB ...]  # then: diff -r OUT_A OUT_B

Each kernel's line also gives ptxas's registers and static shared memory (sm_90a), the figure
`device.STATIC_SMEM_BOUND` must stay above.

The kernels built with the fused output gate (`*_gate`) include two of MLX's device headers
(gate.cuh: its Sigmoid and Multiply functors). With `QSA_MLX_INCLUDE` naming a directory that
holds `mlx/backend/cuda/device/` (an MLX source tree) they compile against the real headers
behind MLX's real prelude; otherwise against stand-ins of those two functors written here
(`include_args`), which is enough for what this file checks: that the code compiles, its
registers and its static shared memory, not the gate's bits (the GPU tests check those).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

from mlx_qsa.kernels._launch import _CUDA_TYPES, constants, header_for, kernel_sections
from mlx_qsa.kernels.prefill_flash import FORMS
from mlx_qsa.kernels.sdpa import TILING, TILINGS

SDPA_T = (("STEP", TILING.step), ("NSTAGE", TILING.nstage))

_PRE = (
    "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n"
    "namespace mlx::core::cu {\n"
    "struct Shape {\n  int d[10];\n  __device__ int operator[](int i) const { return d[i]; }\n};\n"
    "struct Strides {\n  long long d[10];\n"
    "  __device__ long long operator[](int i) const { return d[i]; }\n};\n}\n"
)
BF = "__nv_bfloat16"
SEL_IN = [("index_q", BF), ("pooled", BF), ("pos", "int32_t")]
SEL_OUT = [("adj", "float"), ("summ", "uint32_t"), ("nbs", "int32_t")]
TK_OUT = [("ids", "int32_t"), ("valid", "bool"), ("scores", "float")]
ROWS = [("slots", "int32_t"), ("slot_valid", "bool")]
SEL_T = [("HI", 4), ("RATIO", 4), ("L", 8)]
TOPK_T = [("K", 512), ("CAP", 4096)]
FUSED = "#define QSA_FUSED\n"
GATE = "#define QSA_GATE\n"
# MLX's own prelude of a cuda_kernel (mlx/backend/cuda/custom_kernel.cpp), for the gated kernels
_MLX_PRE = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
_PTXAS_USE = r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?"
ROWS_IN = [("q", BF), ("keys", BF), ("values", BF), ("slots", "int32_t"), ("slot_valid", "bool"),
           ("ctr", "int32_t")]  # fmt: skip
FUSED_OUT = [("part_o", "float"), ("part_ml", "float"), ("out", BF)]
PF_IN = [("q", BF), ("keys", BF), ("values", BF), ("ids", "int32_t"), ("valid", "bool"),
         ("pos", "int32_t")]  # fmt: skip
PF_T = [("D", 256), ("G", 12), ("HKV", 2), ("K", 512), ("RATIO", 4), ("SCALE_BITS", 1031798784)]
JOBS = {
    "score": ("selector.cu", "score", SEL_IN, SEL_OUT, SEL_T + [("NT", 128)], ""),
    "topk": (
        "selector.cu", "topk+select",
        [("adj", "float"), ("summ", "uint32_t"), ("nbs", "int32_t"), ("pos", "int32_t")],
        TK_OUT, [("K", 512), ("RATIO", 4), ("L", 8), ("CAP", 4096), ("NT", 512)], "",
    ),
    "fused": (
        "selector.cu", "score+select", SEL_IN + [("ctr", "int32_t")], SEL_OUT + TK_OUT,
        SEL_T + [("NT", 256)] + TOPK_T, FUSED,
    ),
    "fused_rows": (
        "selector.cu", "score+select", SEL_IN + [("ctr", "int32_t")], SEL_OUT + TK_OUT + ROWS,
        SEL_T + [("NT", 256)] + TOPK_T, FUSED + "#define QSA_ROW_TOKENS\n",
    ),
    "fused_stamps": (
        "selector.cu", "score+select", SEL_IN + [("ctr", "int32_t")],
        SEL_OUT + TK_OUT + [("stamps", "int64_t")], SEL_T + [("NT", 256)] + TOPK_T,
        FUSED + "#define QSA_STAMPS\n",
    ),
    "fused_split_stamps": (
        "selector.cu", "score+select", SEL_IN + [("ctr", "int32_t")],
        SEL_OUT + TK_OUT + [("stamps", "int64_t")], SEL_T + [("NT", 512)] + TOPK_T,
        FUSED + "#define QSA_SPLIT_HEADS\n#define QSA_STAMPS\n",
    ),
    "topk_stamps": (
        "selector.cu", "topk+select",
        [("adj", "float"), ("summ", "uint32_t"), ("nbs", "int32_t"), ("pos", "int32_t")],
        TK_OUT + [("stamps", "int64_t")],
        [("K", 512), ("RATIO", 4), ("L", 8), ("CAP", 4096), ("NT", 512)], "#define QSA_STAMPS\n",
    ),
    "fused_split": (
        "selector.cu", "score+select", SEL_IN + [("ctr", "int32_t")], SEL_OUT + TK_OUT,
        SEL_T + [("NT", 512)] + TOPK_T, FUSED + "#define QSA_SPLIT_HEADS\n",
    ),
    "flash": (
        "flash_decode.cu", "partial",
        [("q", BF), ("keys", BF), ("values", BF), ("block_ids", "int32_t"),
         ("block_valid", "bool"), ("tlen", "int32_t"), ("ctr", "int32_t")],
        [("part_o", "float"), ("part_ml", "float"), ("out", BF)],
        [("D", 256), ("G", 12), ("TOK", 32), ("RATIO", 4), ("K", 512), ("NSPLIT", 65),
         ("SCALE_BITS", 1031798784), ("NT", 256), ("TOFF", 1)], FUSED,
    ),
    "flash_two": (
        "flash_decode.cu", "partial",
        [("q", BF), ("keys", BF), ("values", BF), ("block_ids", "int32_t"),
         ("block_valid", "bool"), ("tlen", "int32_t")],
        [("part_o", "float"), ("part_ml", "float")],
        [("D", 256), ("G", 12), ("TOK", 32), ("RATIO", 4), ("K", 512), ("NSPLIT", 65),
         ("SCALE_BITS", 1031798784), ("NT", 256), ("TOFF", 1)], "",
    ),
    "flash_merge": (
        "split_k_merge.cu", "merge", [("part_o", "float"), ("part_ml", "float")], [("out", BF)],
        [("D", 256), ("NSPLIT", 65), ("NT", 256)], "",
    ),
    "rows": (
        "rows_gather.cu", "partial", ROWS_IN, FUSED_OUT,
        [("D", 256), ("G", 12), ("TOK", 64), ("HKV", 2), ("W", 2052), ("NSPLIT", 33),
         ("SCALE_BITS", 1031798784), ("NT", 256)], FUSED,
    ),
    "rows_d64": (
        "rows_gather.cu", "partial", ROWS_IN, FUSED_OUT,
        [("D", 64), ("G", 3), ("TOK", 32), ("HKV", 2), ("W", 70), ("NSPLIT", 3),
         ("SCALE_BITS", 1031798784), ("NT", 256)], FUSED,
    ),
    "flash_gate": (
        "flash_decode.cu", "partial",
        [("q", BF), ("keys", BF), ("values", BF), ("block_ids", "int32_t"),
         ("block_valid", "bool"), ("tlen", "int32_t"), ("gate", BF), ("ctr", "int32_t")],
        [("part_o", "float"), ("part_ml", "float"), ("out", BF)],
        [("D", 256), ("G", 12), ("TOK", 32), ("RATIO", 4), ("K", 512), ("NSPLIT", 65),
         ("SCALE_BITS", 1031798784), ("NT", 256), ("TOFF", 1)], FUSED + GATE,
    ),
    "flash_merge_gate": (
        "split_k_merge.cu", "merge", [("part_o", "float"), ("part_ml", "float"), ("gate", BF)],
        [("out", BF)], [("D", 256), ("NSPLIT", 65), ("NT", 256)], GATE,
    ),
    "rows_gate": (
        "rows_gather.cu", "partial", ROWS_IN[:-1] + [("gate", BF), ("ctr", "int32_t")], FUSED_OUT,
        [("D", 256), ("G", 12), ("TOK", 64), ("HKV", 2), ("W", 2052), ("NSPLIT", 33),
         ("SCALE_BITS", 1031798784), ("NT", 256)], FUSED + GATE,
    ),
    "prefill_score": (
        "prefill_score.cu", "score", SEL_IN, SEL_OUT,
        [("RATIO", 4), ("L", 8), ("GB", 4), ("NW", 8)], "",
    ),
    "prefill_score_nw4": (
        "prefill_score.cu", "score", SEL_IN, SEL_OUT,
        [("RATIO", 4), ("L", 8), ("GB", 4), ("NW", 4)], "",
    ),
    "prefill_score_fdiv": (  # the score's division as __fdiv_rn (select_sweep's A/B form)
        "prefill_score.cu", "score", SEL_IN, SEL_OUT,
        [("RATIO", 4), ("L", 8), ("GB", 4), ("NW", 8)], "#define QSA_IEEE_DIV\n",
    ),
    "exact_div": (
        "exact_div.cu", "check", [("lo", "uint32_t")], [("bad", "uint32_t"), ("first", "uint32_t")],
        [("PER", 64)], "",
    ),
    "prefill_flash": ("prefill_flash.cu", "attend", PF_IN, [("out", BF)], PF_T, ""),
    "prefill_flash_skip": (
        "prefill_flash.cu", "attend", PF_IN + [("counts", "int32_t")], [("out", BF)],
        PF_T + [("LIMIT", 1024)], "#define QSA_TILE_SKIP\n",
    ),
    # the benchmarks' forms (prefill_flash_form_cuda: loads alone, math alone)
    **{f"prefill_flash_{name}": ("prefill_flash.cu", "attend", PF_IN, [("out", BF)], PF_T, prefix)
       for name, prefix in FORMS.items()},
    "tile_union": (
        "prefill_flash.cu", "union_pre+tile_union",
        [("ids", "int32_t"), ("valid", "bool"), ("pos", "int32_t"), ("keys", BF)],
        [("lists", "int32_t"), ("counts", "int32_t")],
        [("K", 512), ("RATIO", 4), ("NT", 512), ("NKEYS", 8192)], "",
    ),
    "tile_union_bitmap": (
        "prefill_flash.cu", "union_pre+tile_union_bitmap",
        [("ids", "int32_t"), ("valid", "bool"), ("pos", "int32_t"), ("keys", BF)],
        [("lists", "int32_t"), ("counts", "int32_t")],
        [("K", 512), ("RATIO", 4), ("NT", 512), ("NBMAX", 65536)], "",
    ),
    "sdpa_list": (
        "sdpa.cu", "attend",
        [("q", BF), ("keys", BF), ("values", BF), ("pos", "int32_t"), ("lists", "int32_t"),
         ("counts", "int32_t"), ("rowwise", BF)],
        [("out", BF)],
        [("D", 256), ("G", 12), ("HKV", 2), ("SCALE_BITS", 1031798784), *SDPA_T,
         ("LIMIT", 1024), ("RATIO", 4), ("NE", 4104)], "#define QSA_LIST\n",
    ),
    "sdpa_causal": (
        "sdpa.cu", "attend", [("q", BF), ("keys", BF), ("values", BF), ("pos", "int32_t")],
        [("out", BF)], [("D", 256), ("G", 12), ("HKV", 2), ("SCALE_BITS", 1031798784), *SDPA_T], "",
    ),
    "sdpa_mask": (
        "sdpa.cu", "attend",
        [("q", BF), ("keys", BF), ("values", BF), ("pos", "int32_t"), ("mask", "bool")],
        [("out", BF)], [("D", 256), ("G", 12), ("HKV", 2), ("SCALE_BITS", 1031798784), *SDPA_T],
        "#define QSA_MASK\n",
    ),
    "sdpa_split": (
        "sdpa.cu", "attend",
        [("q", BF), ("keys", BF), ("values", BF), ("pos", "int32_t"), ("mask", "bool")],
        [("part_o", "float"), ("part_ml", "float")],
        [("D", 256), ("G", 12), ("HKV", 2), ("SCALE_BITS", 1031798784), *SDPA_T, ("NSPLIT", 16)],
        "#define QSA_MASK\n#define QSA_SPLIT\n",
    ),
    "sdpa_mask_causal": (
        "sdpa.cu", "attend",
        [("q", BF), ("keys", BF), ("values", BF), ("pos", "int32_t"), ("mask", "bool")],
        [("out", BF)], [("D", 256), ("G", 12), ("HKV", 2), ("SCALE_BITS", 1031798784), *SDPA_T],
        "#define QSA_MASK\n#define QSA_MASK_CAUSAL\n",
    ),
    # the other tilings benchmarks/sdpa_ab.py times (kernels.sdpa.TILINGS)
    **{
        f"sdpa_mask_causal_{t.label}": (
            "sdpa.cu", "attend",
            [("q", BF), ("keys", BF), ("values", BF), ("pos", "int32_t"), ("mask", "bool")],
            [("out", BF)],
            [("D", 256), ("G", 12), ("HKV", 2), ("SCALE_BITS", 1031798784),
             ("STEP", t.step), ("NSTAGE", t.nstage)],
            "#define QSA_MASK\n#define QSA_MASK_CAUSAL\n"
            + ("#define QSA_KV_SPLIT\n" if t.kv_split else ""),
        )
        for t in TILINGS[1:]
    },
    "rope": (
        "rope.cu", "rope", [("x", BF), ("cos_t", "float"), ("sin_t", "float")], [("out", BF)],
        [("T", BF), ("RD", 64)], "",
    ),
    "rope_f32": (
        "rope.cu", "rope", [("x", "float"), ("cos_t", "float"), ("sin_t", "float")],
        [("out", "float")], [("T", "float"), ("RD", 64)], "",
    ),
    "rms_norm": (
        "rms_norm.cu", "norm_core+rows_in+rms_norm", [("x", BF), ("weight", BF)], [("out", BF)],
        [("T", BF), ("D", 256), ("EPS_BITS", 897988541)], "",
    ),
    "rms_norm_f16_d128": (
        "rms_norm.cu", "norm_core+rows_in+rms_norm", [("x", "__half"), ("weight", "float")],
        [("out", "__half")], [("T", "__half"), ("D", 128), ("EPS_BITS", 897988541)], "",
    ),
    "norm_rope": (
        "rms_norm.cu", "norm_core+rope_core+rows_in+norm_rope",
        [("x", BF), ("weight", BF), ("cos_t", "float"), ("sin_t", "float")], [("out", BF)],
        [("T", BF), ("D", 256), ("EPS_BITS", 897988541), ("RD", 64)], "",
    ),
    "pool_norm_rope": (
        "rms_norm.cu", "norm_core+rope_core+pool_norm_rope",
        [("raw", BF), ("start", "int32_t"), ("weight", BF), ("cos_t", "float"),
         ("sin_t", "float")], [("out", BF)],
        [("T", BF), ("D", 128), ("EPS_BITS", 897988541), ("RD", 64), ("R", 4)], "",
    ),
    "stamp": ("stamp.cu", "stamp", [("after", "float")], [("stamp", "uint64_t")], [], ""),
}  # fmt: skip


# Stand-ins of the two MLX device headers gate.cuh includes (not MLX's code: any sigmoid and
# product compile to the same registers and shared memory for this file's purpose).
_STANDINS = {
    "unary_ops.cuh": "#pragma once\nnamespace mlx::core::cu {\nstruct Sigmoid {\n"
    "  template <typename T> __device__ T operator()(T x) {\n"
    "    return T(1.f / (1.f + __expf(-static_cast<float>(x))));\n  }\n};\n}\n",
    "binary_ops.cuh": "#pragma once\nnamespace mlx::core::cu {\nstruct Multiply {\n"
    "  template <typename T> __device__ T operator()(T x, T y) { return x * y; }\n};\n}\n",
}


def mlx_headers_real() -> bool:
    return bool(os.environ.get("QSA_MLX_INCLUDE"))


def include_args() -> list[str]:
    """nvcc's include path for gate.cuh's MLX headers: `QSA_MLX_INCLUDE`, else the stand-ins."""
    real = os.environ.get("QSA_MLX_INCLUDE")
    if real:
        return [f"-I{real}"]
    root = os.path.join(tempfile.gettempdir(), f"qsa_mlx_standins_{os.getuid()}")
    dev = os.path.join(root, "mlx", "backend", "cuda", "device")
    os.makedirs(dev, exist_ok=True)
    for name, text in _STANDINS.items():
        path = os.path.join(dev, name)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
    return [f"-I{root}"]


def source(filename, section, inputs, outputs, template, prefix) -> str:
    sections = kernel_sections(filename)
    body = prefix + "".join(sections[p] for p in section.split("+"))
    params = []
    for n, t in inputs:
        params.append(f"const {t}* {n}")
        for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
            if n + suffix in body:
                params.append(f"const __grid_constant__ {kind} {n}{suffix}")
    params += [f"{t}* {n}" for n, t in outputs]
    # the launchers' declarations (`_launch.constants`); a type name stands for its dtype
    types = {v: k for k, v in _CUDA_TYPES.items()}
    consts = constants(tuple((k, types[v] if isinstance(v, str) else v) for k, v in template))
    pre = _MLX_PRE if GATE in prefix and mlx_headers_real() else _PRE
    return (
        pre + header_for(body) + "namespace mlx::core::cu {\n__global__ void kernel("
        + ", ".join(params) + ") {\n" + consts + body + "\n}\n}\n"
    )  # fmt: skip


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    inc = include_args()
    for name, job in JOBS.items():
        if sys.argv[2:] and name not in sys.argv[2:]:
            continue
        cu, ptx = f"{out}/{name}.cu", f"{out}/{name}.ptx"
        with open(cu, "w") as f:
            f.write(source(*job))
        r = subprocess.run(
            ["nvcc", "-arch=sm_90a", "-std=c++17", "-ptx", *inc, "-o", ptx, cu],
            capture_output=True, text=True,
        )  # fmt: skip
        if r.returncode:
            print(f"{name}: nvcc failed\n{r.stderr[-2000:]}")
            continue
        r = subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", "-o", os.devnull, ptx], capture_output=True, text=True
        )
        use = re.search(_PTXAS_USE, r.stderr)
        regs = f" {use.group(1)} registers, {use.group(2) or 0} bytes static smem" if use else ""
        with open(ptx) as f:
            lines = [line for line in f.read().splitlines() if not line.lstrip().startswith("//")]
        with open(ptx, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"{name}: {len(lines)} lines of PTX;{regs}")


if __name__ == "__main__":
    main()
