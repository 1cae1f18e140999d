"""Does fusing the output gate into the decode kernels' merge pay? The whole CUDA layer decode step
(real geometry, as `mlx-qsa bench decode` times `qsa_cuda_layer`) with the gate fused (the
default) and with `MLX_QSA_FUSE_GATE=0` (MLX's sigmoid and multiply after the kernel), both
timed in turns over the same rotated caches, one `mx.eval` per step and queued. Also records each
mode's primitive count and checks that the two modes' outputs are the same bits.

    python3 benchmarks/gate_ab.py OUT.json [--contexts 8k,128k] [--rows 1,4] [--sets 8]
        [--switch MLX_QSA_COMPILE_DECODE]   # another switch, timed the same way (modes on / off)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

from mlx_qsa import bench, sweep
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.layer import QSAAttention

SWITCH = "MLX_QSA_FUSE_GATE"
# `--switch` names another of the library's on-by-default MLX_QSA_* switches to time the same way
# (e.g. MLX_QSA_COMPILE_DECODE: the decode consumers' launches compiled or not); modes on / off
NAMES = {"MLX_QSA_FUSE_GATE": ("fused", "unfused")}


def modes_of(switch: str) -> dict[str, str | None]:
    on, off = NAMES.get(switch, ("on", "off"))
    return {on: None, off: "0"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--contexts", type=bench._int_list, default=(8192, 131072))
    p.add_argument("--rows", type=bench._int_list, default=(1, 4))
    p.add_argument("--sets", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settle", type=float, default=1.0)
    p.add_argument("--switch", default=SWITCH)
    a = p.parse_args()
    modes = modes_of(a.switch)
    on, off = modes
    cfg = QSAConfig()
    mx.random.seed(0)
    layer = QSAAttention(cfg, options=QSAOptions(kernels="auto"), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    doc = {
        "what": f"CUDA layer decode step, {a.switch} unset vs {a.switch}=0, in turns",
        "environment": sweep.environment(sweep.backend_name()),
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mlx": mx.__version__,
        "host_calibration": bench.host_calibration(),
        "points": [],
    }
    for T in a.contexts:
        for rows in a.rows:
            caches = [bench.random_cache(layer, T, rows, seed=i) for i in range(a.sets)]
            xs = [bench.layer_rows(cfg, rows, seed=i) for i in range(a.sets)]
            rec = {"context": T, "rows": rows, "primitives": {}, "timings": {}}
            outs = {}
            step = bench.decode_layer_step(layer, xs, caches, rows)
            for mode, value in modes.items():
                bench.set_switch(a.switch, value)
                mx.eval(step(0))
                y = step(0)  # counted before it runs: the second call on this cache, as timed
                rec["primitives"][mode] = bench.primitive_counts(y)["total"]
                rec["consumers"] = list(layer.last_call.consumers)
                outs[mode] = np.array(y.view(mx.uint16))
            rec["same_bits"] = bool(np.array_equal(outs[on], outs[off]))
            passes = bench.switched_passes(step, a.sets, a.switch, modes, queued=True)
            res = bench.time_in_turns(passes, a.warmup, a.repeats, a.settle)
            rec["timings"] = {k: v["median_us"] for k, v in res.items()}
            rec["samples_us"] = {k: v["samples_us"] for k, v in res.items()}
            doc["points"].append(rec)
            t = rec["timings"]
            print(
                f"T={T} rows={rows} {rec['consumers']} primitives {rec['primitives']} "
                f"same bits {rec['same_bits']} | sync {on} {t[on]:.1f} {off} "
                f"{t[off]:.1f} us | queued {on} {t[on + '_queued']:.1f} {off} "
                f"{t[off + '_queued']:.1f} us",
                flush=True,
            )
    bench.set_switch(a.switch, None)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
