"""Host cost of MLX primitives on this device: µs per `mx.eval` of a chain of n small ops.

Usage: python3 benchmarks/mlx_overhead.py OUT.json   (run once with MLX_USE_CUDA_GRAPHS=1 and
once with 0 to compare). The slope over n is the per-primitive cost a decode step pays: for an
elementwise op (`x + 1`, a kernel launch each), and for views (transposes, slices: no kernel,
only MLX's graph and evaluation work), which are 22 of the CUDA layer step's 49 primitives.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import mlx.core as mx


def chain(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x + 1
    return x


def transposes(x: mx.array, n: int) -> mx.array:
    y = x.reshape(16, 16)
    for _ in range(n):
        y = y.T
    return y.reshape(256) + 1  # one kernel at the end, as a view feeds a kernel in a step


def slices(x: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = x[1:]
    return x + 1


def per_eval_us(n: int, reps: int = 200, build=chain) -> float:
    x = mx.zeros((256,), mx.float32)
    mx.eval(x)
    for _ in range(20):
        mx.eval(build(x, n))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(build(x, n))
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(samples)


def time_us(fn, reps: int = 200) -> float:
    for _ in range(20):
        mx.eval(fn())
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(fn())
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(samples)


def kernel_costs() -> dict[str, float]:
    """µs per eval of one trivial `mx.fast.cuda_kernel` call: small source, the project's
    common header (a large source), `init_value` with four outputs, and a host-made input."""
    from pathlib import Path

    header = (Path(__file__).parent.parent / "src/mlx_qsa/kernels/common.cuh").read_text()
    body = "out[threadIdx.x] = inp[threadIdx.x] + 1.0f;"
    small = mx.fast.cuda_kernel(
        name="ovh_small", input_names=["inp"], output_names=["out"], source=body
    )
    big = mx.fast.cuda_kernel(
        name="ovh_big", input_names=["inp"], output_names=["out"], source=body, header=header
    )
    four = mx.fast.cuda_kernel(
        name="ovh_four", input_names=["inp"], output_names=["out", "a", "b", "c"], source=body
    )
    x = mx.zeros((256,), mx.float32)
    mx.eval(x)

    def call(k, n_out=1, **kw):
        return k(
            inputs=[x],
            grid=(256, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(256,)] * n_out,
            output_dtypes=[mx.float32] * n_out,
            **kw,
        )[0]

    return {
        "x_plus_1": time_us(lambda: x + 1),
        "kernel_small_source": time_us(lambda: call(small)),
        "kernel_common_header": time_us(lambda: call(big)),
        "kernel_four_outputs": time_us(lambda: call(four, 4)),
        "kernel_four_outputs_init_value": time_us(lambda: call(four, 4, init_value=0)),
        "host_array_plus_x": time_us(lambda: mx.array([5.0]) + x),
    }


def main() -> None:
    ns = (1, 2, 4, 8, 16, 32)
    doc: dict = {
        "MLX_USE_CUDA_GRAPHS": os.environ.get("MLX_USE_CUDA_GRAPHS", ""),
        "device": str(mx.default_device()),
    }
    for name, build in (("ops", chain), ("transposes", transposes), ("slices", slices)):
        rows = {n: per_eval_us(n, build=build) for n in ns}
        doc[f"us_per_eval_by_{name}"] = rows
        doc[f"us_per_{'primitive' if name == 'ops' else name[:-1]}"] = (rows[32] - rows[4]) / 28
    if mx.cuda.is_available():
        doc["us_per_eval_single_call"] = kernel_costs()
    print(json.dumps(doc))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
