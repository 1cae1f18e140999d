"""The CUDA decode step (selection + attention, `bench.qsa_step`) eager against `mx.compile`d,
in turns, on the GPU: does a compiled step cut the host work per step (issue 5: the 1-row step
is bound by MLX's host work)?

Entries, each by eval per step (`mlx_pass`) and queued on the GPU's clock (`mlx_gpu_pass`):
- `eager`: the selection and attention of `bench.qsa_step`, both launchers called directly
  (``MLX_QSA_COMPILE_DECODE=0``: Python launchers, two `cuda_kernel` calls a step);
- `compiled_select`: the selection in one compiled function (as the layer's compiled core runs
  it), the attention's launcher eager (``MLX_QSA_COMPILE_DECODE=0``);
- `compiled_two`: `bench.qsa_step` itself: its compiled selection, then the attention through
  `consumers.decode_launch`'s compiled function (the library default);
- `compiled_step`: selection and attention in one compiled function.
The one-launch kernels' counter slots are inputs of the compiled functions (a fresh slot per
call, as eager calls take them), so queued replays never share one. Outputs and selections are
compared bit for bit with the eager step's. Also the graph build alone (the call, no eval), µs.

    python3 benchmarks/compile_ab.py OUT.json [--points 131072x1,131072x4,8192x1] [--sets 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import mlx.core as mx

from mlx_qsa import bench
from mlx_qsa.config import QSAConfig
from mlx_qsa.kernels import _launch

SWITCH = "MLX_QSA_COMPILE_DECODE"


@contextlib.contextmanager
def slots_from(ctrs: list[mx.array]):
    """`_launch.counter_slot` hands out `ctrs` in order (the compiled function's inputs)."""
    it = iter(ctrs)
    orig = _launch.counter_slot
    _launch.counter_slot = lambda: next(it)
    try:
        yield
    finally:
        _launch.counter_slot = orig


def sel_arrays(sel) -> list[mx.array]:
    if sel.kind == "blocks":
        return [sel.ids, sel.valid, sel.scores]
    return [sel.slots, sel.slot_valid]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--points", default="131072x1,131072x4,8192x1")
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--build-steps", type=int, default=200)
    args = ap.parse_args()
    if not mx.cuda.is_available():
        print("compile_ab: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    cfg = QSAConfig()
    doc = {"environment": bench.environment("cuda"), "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "points": []}  # fmt: skip
    for spec in args.points.split(","):
        T, rows = (int(v) for v in spec.split("x"))
        doc["points"].append(run_point(cfg, T, rows, args))
        bench.release_device_memory()
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0 if all(all(p["checks"].values()) for p in doc["points"]) else 1


def run_point(cfg: QSAConfig, T: int, rows: int, args: argparse.Namespace) -> dict:
    sets = [bench.DecodeSet(cfg, T, rows, seed) for seed in range(args.sets)]
    s0 = sets[0]

    def eager(s):
        sel = sel_arrays(_select(cfg, s))
        return [_attend(cfg, s, sel), *sel]

    def library(s):
        o, sel = bench.qsa_step(cfg, s, "cuda")
        return [o, *sel_arrays(sel)]

    def select_only(index_q, pooled, positions, ctr):
        s = _View(s0, index_q=index_q, pooled=pooled, positions=positions)
        with slots_from([ctr]):
            sel = _select(cfg, s)
        return sel_arrays(sel)

    def whole(index_q, pooled, positions, q, keys, values, ctr1, ctr2):
        s = _View(s0, index_q=index_q, pooled=pooled, positions=positions, q=q, keys=keys,
                  values=values)  # fmt: skip
        with slots_from([ctr1, ctr2]):
            sel = sel_arrays(_select(cfg, s))
            return [_attend(cfg, s, sel), *sel]

    c_select = mx.compile(select_only)
    c_whole = mx.compile(whole)

    def compiled_select(s):
        sel = c_select(s.index_q, s.pooled, s.positions, _launch.counter_slot())
        return [_attend(cfg, s, sel), *sel]

    def compiled_step(s):
        return c_whole(s.index_q, s.pooled, s.positions, s.q, s.keys, s.values,
                       _launch.counter_slot(), _launch.counter_slot())  # fmt: skip

    # form: (step, MLX_QSA_COMPILE_DECODE while it runs: "0" = the attention's launcher eager)
    forms = {
        "eager": (eager, "0"),  # the bench's step before decode_launch
        "compiled_select": (compiled_select, "0"),  # the layer before: its core compiled
        "compiled_two": (library, None),  # bench.qsa_step now: its selector compiled, as the
        # layer's core runs it, and the attention through decode_launch
        "compiled_step": (compiled_step, "0"),  # one compiled function of both
    }
    rec = {"context": T, "rows": rows, "checks": {}, "build_us": {}}
    bench.set_switch(SWITCH, "0")
    ref = [eager(s) for s in sets]
    mx.eval(ref)
    for name, (f, value) in forms.items():
        bench.set_switch(SWITCH, value)
        got = [f(s) for s in sets]
        mx.eval(got)
        rec["checks"][name] = all(
            mx.array_equal(a, b).item()
            for g, r in zip(got, ref, strict=True)
            for a, b in zip(g, r, strict=True)
        )
    for name, (f, value) in forms.items():
        bench.set_switch(SWITCH, value)
        ts = []
        for i in range(args.build_steps):
            t0 = time.perf_counter()
            out = f(sets[i % len(sets)])
            ts.append(time.perf_counter() - t0)
            mx.eval(out)
        rec["build_us"][name] = statistics.median(ts) * 1e6
    passes = {}
    for name, (f, value) in forms.items():

        def step(i: int, f=f):
            return f(sets[i])

        for key, one in ((name, bench.mlx_pass(step, len(sets))),
                         (f"{name}_gpu", bench.mlx_gpu_pass(step, len(sets)))):  # fmt: skip

            def timed(one=one, value=value) -> float:
                bench.set_switch(SWITCH, value)
                return one()

            passes[key] = timed
    rec["timings"] = bench.time_in_turns(passes, 2, args.repeats, 1.0)
    bench.set_switch(SWITCH, None)
    line = " ".join(f"{k}={v['median_us']:.1f}" for k, v in rec["timings"].items())
    print(f"T={T} rows={rows} build={rec['build_us']} checks={rec['checks']} {line}", flush=True)
    return rec


class _View:
    """A DecodeSet with some arrays replaced (the compiled functions' tracers)."""

    def __init__(self, base, **arrays) -> None:
        self.__dict__.update(base.__dict__)
        self.__dict__.update(arrays)


def _select(cfg: QSAConfig, s):
    """The selection half of `bench.qsa_step`, its CUDA selector called directly."""
    r, K = cfg.indexer_compress_ratio, cfg.block_topk
    args = (s.index_q, None, None, s.positions, r, K, s.rows, s.pooled, "cuda")
    return bench.step_selection(cfg, s, bench.step_selector(s.rows)(*args))


def _attend(cfg: QSAConfig, s, sel_list: list[mx.array]) -> mx.array:
    """The attention half of `bench.qsa_step`, from the selection's arrays."""
    return bench.step_attention(cfg, s, bench.step_selection(cfg, s, sel_list), "cuda")


if __name__ == "__main__":
    sys.exit(main())
