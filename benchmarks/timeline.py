"""Where a step's wall time goes, on the GPU machine (MLX with CUDA, torch for its profiler).

`mlx-qsa bench` times a decode step (selection + attention, 1 row, 128K) at ~216 µs with one
`mx.eval` each, against ~51 µs of kernel time; a prefill chunk's selection at 0.62-0.68 ms
against ~0.31 ms of kernel time. This script records a CUPTI timeline of such steps with
torch.profiler (CUPTI sees every kernel and CUDA API call of the process, MLX's included) and
splits each step into: Python graph build, `mx.eval`, the CUDA API calls made inside them (by
name: count and µs), the kernels the step ran (device µs each) and the GPU's idle time within
the step.

    python3 benchmarks/timeline.py OUT [--steps 8] [--sets 8] [--only decode,spin,layer,prefill]

`spin` is the decode step waited for by `mx.async_eval` + `mx.synchronize` instead of `mx.eval`.

OUT/<case>.json.gz is each case's Chrome trace (chrome://tracing, Perfetto); OUT/timeline.json
the per-step split; the table printed last is its median over the steps.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_qsa import bench
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.layer import QSAAttention


def steps_of(trace: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Per `prefix:i` annotation: wall, build and eval µs, API calls by name inside it, the
    kernels launched inside it, GPU busy and idle µs between the step's first launch and its
    end. Kernels are tied to their launch call (a graph launch: all its kernels) by CUPTI's
    correlation id."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ann = [e for e in ev if e.get("cat") == "user_annotation"]
    api = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kern: dict[Any, list[dict[str, Any]]] = defaultdict(list)  # a graph launch runs several
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kern[e["args"].get("correlation")].append(e)
    out = []
    for a in sorted((e for e in ann if e["name"].startswith(prefix + ":")), key=lambda e: e["ts"]):
        t0, t1 = a["ts"], a["ts"] + a["dur"]
        inner = {
            e["name"]: e["dur"] for e in ann if t0 <= e["ts"] <= t1 and e is not a
            and e["name"] in ("build", "eval")
        }  # fmt: skip
        calls: dict[str, list[float]] = defaultdict(list)
        ks = []
        for e in api:
            if t0 <= e["ts"] <= t1:
                calls[e["name"]].append(e["dur"])
                ks += kern.get(e["args"].get("correlation"), [])
        ks.sort(key=lambda k: k["ts"])
        busy = sum(k["dur"] for k in ks)  # graph nodes may overlap: busy can exceed the span
        end = max((k["ts"] + k["dur"] for k in ks), default=None)
        out.append({
            "wall_us": a["dur"],
            "build_us": inner.get("build", 0.0),
            "eval_us": inner.get("eval", 0.0),
            "first_launch_after_us": (ks[0]["ts"] - t0) if ks else None,
            "last_kernel_end_before_us": (t1 - end) if ks else None,
            "gpu_busy_us": busy,
            "gpu_span_us": (end - ks[0]["ts"]) if ks else 0.0,
            "kernels": [(k["name"][:60], round(k["dur"], 2)) for k in ks],
            "api": {n: (len(v), round(sum(v), 2)) for n, v in sorted(calls.items())},
        })  # fmt: skip
    return out


def profile_case(
    name: str, step: Callable[[int], None], n_sets: int, steps: int, out: Path
) -> list[dict[str, Any]]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    for i in range(2 * n_sets):  # warm: kernels built, buffers cached
        step(i % n_sets)
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"{name}:{i}"):
                step(i % n_sets)
        torch.cuda.synchronize()
        mx.synchronize()
    raw = out / f"{name}.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(out / f"{name}.json.gz", "wt") as f:
        json.dump(trace, f)
    raw.unlink()
    return steps_of(trace, name)


def annotated(build: Callable[[int], Any], spin: bool = False) -> Callable[[int], None]:
    """The step with its build and its wait annotated; `spin`: the wait is `mx.async_eval` +
    `mx.synchronize` (`cudaStreamSynchronize`, then MLX's worker-thread hand-off) instead of
    `mx.eval`'s blocking event (the "eval" range covers either)."""
    from torch.profiler import record_function

    def step(i: int) -> None:
        with record_function("build"):
            y = build(i)
        with record_function("eval"):
            if spin:
                mx.async_eval(y)
                mx.synchronize()
            else:
                mx.eval(y)

    return step


def decode_case(cfg: QSAConfig, T: int, n: int, spin: bool = False) -> Callable[[int], None]:
    sets = [bench.DecodeSet(cfg, T, 1, seed=i) for i in range(n)]
    return annotated(lambda i: bench.qsa_step(cfg, sets[i], "cuda")[0], spin)


def layer_case(cfg: QSAConfig, T: int, n: int) -> Callable[[int], None]:
    mx.random.seed(0)
    layer = QSAAttention(cfg, options=QSAOptions(kernels="auto"), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    caches = [bench.random_cache(layer, T, 1, seed=i) for i in range(n)]
    xs = [bench.layer_rows(cfg, 1, seed=i) for i in range(n)]
    return annotated(bench.decode_layer_step(layer, xs, caches, 1))


def prefill_cases(cfg: QSAConfig, P: int, n: int) -> dict[str, Callable[[int], None]]:
    """The bench's prefill selection and attention steps (`bench.prefill_steps`, CUDA) of a
    2048-row chunk after P tokens."""
    S = 2048
    sets = [bench.DecodeSet(cfg, P + S, S, seed=i) for i in range(n)]
    steps, _, _ = bench.prefill_steps(cfg, sets, "cuda")
    return {
        f"prefill_select_{P // 1024}k": annotated(steps["selection"]),
        f"prefill_attend_{P // 1024}k": annotated(steps["attention"]),
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("wall_us", "build_us", "eval_us", "first_launch_after_us",
            "last_kernel_end_before_us", "gpu_busy_us", "gpu_span_us")  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows if r[k] is not None) for k in keys}
    api: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for nm, (_, us) in r["api"].items():
            api[nm].append(us)
    med["api_median_us"] = {nm: round(statistics.median(v), 1) for nm, v in api.items()}
    med["kernels"] = rows[len(rows) // 2]["kernels"]
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--only", default="decode,spin,layer,prefill")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = QSAConfig()
    which = set(a.only.split(","))
    cases: dict[str, tuple[Callable[[int], None], int]] = {}  # step, sets it rotates over
    if "decode" in which:
        cases["decode_128k"] = decode_case(cfg, 131072, a.sets), a.sets
    if "spin" in which:  # the same step waited for by mx.synchronize
        cases["decode_128k_spin"] = decode_case(cfg, 131072, a.sets, spin=True), a.sets
    if "layer" in which:
        cases["layer_128k"] = layer_case(cfg, 131072, a.sets), a.sets
    if "prefill" in which:
        n = min(a.sets, 2)
        cases.update({k: (f, n) for k, f in prefill_cases(cfg, 32768, n).items()})
    result = {}
    for name, (step, n) in cases.items():
        rows = profile_case(name, step, n, a.steps, a.out)
        result[name] = {"steps": rows, "median": median_row(rows)}
        (a.out / "timeline.json").write_text(json.dumps(result, indent=1))
        m = result[name]["median"]
        print(f"\n== {name}: medians over {len(rows)} steps (µs)")
        for k in ("wall_us", "build_us", "eval_us", "first_launch_after_us",
                  "last_kernel_end_before_us", "gpu_busy_us", "gpu_span_us"):  # fmt: skip
            print(f"  {k:28s} {m[k]:9.1f}")
        for nm, us in sorted(m["api_median_us"].items(), key=lambda t: -t[1])[:12]:
            print(f"  api {nm:40s} {us:9.1f}")
        for kn, us in m["kernels"]:
            print(f"  kernel {kn:60s} {us:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
