"""Host cost of MLX primitives on this device: µs per `mx.eval` of a chain of n small ops.

Usage: python3 benchmarks/mlx_overhead.py OUT.json   (run once with MLX_USE_CUDA_GRAPHS=1 and
once with 0 to compare). The slope over n is the per-primitive cost a decode step pays.
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


def per_eval_us(n: int, reps: int = 200) -> float:
    x = mx.zeros((256,), mx.float32)
    mx.eval(x)
    for _ in range(20):
        mx.eval(chain(x, n))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(chain(x, n))
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(samples)


def main() -> None:
    rows = {n: per_eval_us(n) for n in (1, 2, 4, 8, 16, 32)}
    slope = (rows[32] - rows[4]) / 28
    doc = {
        "MLX_USE_CUDA_GRAPHS": os.environ.get("MLX_USE_CUDA_GRAPHS", ""),
        "device": str(mx.default_device()),
        "us_per_eval_by_ops": rows,
        "us_per_primitive": slope,
    }
    print(json.dumps(doc))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
