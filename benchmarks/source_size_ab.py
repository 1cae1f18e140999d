"""Host time of one `mx.fast.cuda_kernel` call against the size of its source (issue 5's step is
host-bound). MLX 0.32 rebuilds header + body on every call and hashes the result on every
evaluation, so the same trivial kernel is timed with `common.cuh` as the library hands it to MLX
(an `#include` line, `_launch.include`), as its compacted text (`_launch.compact`) and as the
commented file, interleaved, in rounds:

    python3 benchmarks/source_size_ab.py [OUT.json]

build: graph construction of N calls (no evaluation); step: build + `mx.eval` of each call.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx

from mlx_qsa.kernels import _launch

BODY = "if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = inp[0] + 1.0f;\n"


def kernel(header: str, tag: str):
    return mx.fast.cuda_kernel(
        name=f"qsa_source_size_{tag}",
        input_names=["inp"],
        output_names=["out"],
        source=BODY,
        header=header,
    )


def main() -> None:
    full = _launch._text("common.cuh")
    headers = {
        "include": _launch.include("common.cuh"),
        "compact": _launch.compact(full),
        "full": full,
    }
    kernels = {tag: kernel(h, tag) for tag, h in headers.items()}
    x = mx.arange(16, dtype=mx.float32)
    mx.eval(x)

    def call(k):
        return k(
            inputs=[x], template=[("A", 1), ("B", 2)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(16,)], output_dtypes=[mx.float32],
        )[0]  # fmt: skip

    for k in kernels.values():
        mx.eval(call(k))
    n = 200
    res: dict[str, dict[str, list[float]]] = {t: {"build": [], "step": []} for t in kernels}
    for _ in range(15):
        for tag, k in kernels.items():
            t0 = time.perf_counter()
            outs = [call(k) for _ in range(n)]
            res[tag]["build"].append((time.perf_counter() - t0) / n * 1e6)
            mx.eval(outs)
            t0 = time.perf_counter()
            for _ in range(n):
                mx.eval(call(k))
            res[tag]["step"].append((time.perf_counter() - t0) / n * 1e6)
    summary = {
        tag: {
            "header_bytes": len(headers[tag]),
            **{f"{m}_us_median": statistics.median(v) for m, v in r.items()},
            **{f"{m}_us_min": min(v) for m, v in r.items()},
        }
        for tag, r in res.items()
    }
    for tag, s in summary.items():
        print(tag, {k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()})
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"mlx": mx.__version__, "summary": summary, "samples": res}, f, indent=1)


if __name__ == "__main__":
    main()
