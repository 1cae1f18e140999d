"""What a kernel pays for reading a small array from MLX's managed memory (MLX 0.32 on CUDA;
`mlx_qsa.device_arrays`). Same kernels, same values; only where the small operand lives:

- `host4`: made on the host, 4 bytes (MLX's 8-byte managed pool, as `mx.array(2.0)`);
- `python`: a Python float (MLX makes a host scalar per call);
- `device`: `device_arrays.device_constant` (a GPU-made 12-byte buffer).

For each, an elementwise multiply `x * s` (x float32, 4K and 4M elements) and a custom kernel
that reads one int32 `pos[0]` per block before writing (256 blocks, like the selector's score
pass). Interleaved rounds; per-op microseconds of N ops queued (`async`) and of one op per
`mx.eval` (`eval`):

    python3 benchmarks/managed_read_ab.py [OUT.json]
    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/managed_read_ab.py --ncu > ncu.csv   # each case's kernel, 3 times
    python3 benchmarks/managed_read_ab.py --ncu-report ncu.csv
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx

from mlx_qsa.device_arrays import device_constant, int_arange

N_OPS = 100
ROUNDS = 9

POS_KERNEL = """
__shared__ int p_s;
if (threadIdx.x == 0) p_s = pos[0];
__syncthreads();
const int i = blockIdx.x * blockDim.x + threadIdx.x;
if (i < N) out[i] = p_s + i;  // N: template (outputs have no shape argument)
"""


def ncu_report(path: str) -> None:
    """Kernel µs per case from the `--ncu` run's CSV (the launches after warm-up, 3 per case)."""
    from ncu_summary import durations  # this folder is on sys.path

    names = [ln.split()[1] for ln in open(path) if ln.startswith("cases ")][0].split(",")
    vals = [v for _, v in durations(path)][-3 * len(names) :]
    for i, name in enumerate(names):
        print(f"{name:>20}: kernel {' / '.join(f'{v:6.2f}' for v in vals[3 * i : 3 * i + 3])} us")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--ncu-report":
        ncu_report(sys.argv[2])
        return
    scalars = {
        "host4": mx.array(2.0, dtype=mx.float32),
        "python": 2.0,
        "device": device_constant(mx.array(2.0, dtype=mx.float32)),
    }
    positions = {
        "host4": mx.array([131071], dtype=mx.int32),
        "device": int_arange(131071, 131072),
    }
    mx.eval(*[s for s in scalars.values() if isinstance(s, mx.array)], *positions.values())
    xs = {n: mx.random.normal((n,)) for n in (4096, 1 << 22)}
    mx.eval(*xs.values())
    kern = mx.fast.cuda_kernel(
        name="qsa_managed_read_pos", input_names=["pos"], output_names=["out"], source=POS_KERNEL
    )

    def pos_op(p):
        return kern(
            inputs=[p], template=[("N", 256 * 256)], grid=(256 * 256, 1, 1),
            threadgroup=(256, 1, 1), output_shapes=[(256 * 256,)], output_dtypes=[mx.int32],
        )[0]  # fmt: skip

    cases = {}
    for n, x in xs.items():
        for tag, s in scalars.items():
            cases[f"mul{n}_{tag}"] = lambda x=x, s=s: x * s
    for tag, p in positions.items():
        cases[f"pos_{tag}"] = lambda p=p: pos_op(p)
    for f in cases.values():
        mx.eval(f())
    if "--ncu" in sys.argv:  # three launches per case, in order, for the profiler
        mx.synchronize()
        print("cases", ",".join(cases), flush=True)
        for f in cases.values():
            for _ in range(3):
                mx.eval(f())
        return
    samples: dict[str, dict[str, list[float]]] = {c: {"async": [], "eval": []} for c in cases}
    for _ in range(ROUNDS):
        for name, f in cases.items():
            mx.synchronize()
            t0 = time.perf_counter()
            outs = [f() for _ in range(N_OPS)]
            mx.async_eval(outs)
            mx.synchronize()
            samples[name]["async"].append((time.perf_counter() - t0) / N_OPS * 1e6)
            t0 = time.perf_counter()
            for _ in range(N_OPS // 4):
                mx.eval(f())
            samples[name]["eval"].append((time.perf_counter() - t0) / (N_OPS // 4) * 1e6)
    summary = {
        c: {m: round(statistics.median(v), 2) for m, v in s.items()} for c, s in samples.items()
    }
    for c, s in summary.items():
        print(f"{c:>20}: async {s['async']:8.2f} us/op   eval {s['eval']:8.2f} us/op")
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):
        with open(sys.argv[1], "w") as f:
            json.dump({"mlx": mx.__version__, "summary": summary, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
