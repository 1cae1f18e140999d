"""Transient memory and time of one QSA layer decode step against the context, per
implementation: a step that copied the K/V cache would show a transient that grows with it.

    python3 benchmarks/layer_memory.py OUT.json [--contexts 8192,32768,131072] [--rows 1,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlx_qsa.bench import layer_rows, random_cache
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.layer import QSAAttention


def probe(layer: QSAAttention, T: int, rows: int) -> dict:
    cfg = layer.config
    cache = random_cache(layer, T, rows, seed=1)
    x = layer_rows(cfg, rows, seed=2)
    for _ in range(3):
        mx.eval(layer(x, cache=cache))
        cache.trim(rows)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(layer(x, cache=cache), cache.keys, cache.values)
    transient = mx.get_peak_memory() - base
    cache.trim(rows)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        mx.eval(layer(x, cache=cache))
        times.append((time.perf_counter() - t0) * 1e6)
        cache.trim(rows)
    return {
        "context": T,
        "rows": rows,
        "impl": layer.impl,
        "consumers": list(layer.last_call.consumers),
        "kv_bytes": cache.keys.nbytes + cache.values.nbytes,
        "transient_bytes": transient,
        "step_us_median": statistics.median(times),
        "step_us_min": min(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--rows", default="1,4")
    args = ap.parse_args()
    cfg = QSAConfig()
    mx.random.seed(0)
    base = QSAAttention(cfg, fused=4)
    base.set_dtype(mx.bfloat16)
    layers = []
    for kernels in ("auto", "portable"):
        lay = QSAAttention(cfg, options=QSAOptions(kernels=kernels), fused=4)
        lay.update(base.parameters())
        layers.append(lay)
    mx.eval(base.parameters())
    recs: list[dict] = []
    info = mx.device_info() if mx.default_device().type == mx.DeviceType.gpu else {}
    out = {
        "device": info.get("device_name", "cpu"),
        "mlx": mx.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python3 benchmarks/layer_memory.py "
        + " ".join([args.out, "--contexts", args.contexts, "--rows", args.rows]),
        "points": recs,
    }
    for T in [int(c) for c in args.contexts.split(",")]:
        for rows in [int(r) for r in args.rows.split(",")]:
            for lay in layers:
                rec = probe(lay, T, rows)
                print(json.dumps(rec))
                recs.append(rec)
                json.dump(out, open(args.out, "w"), indent=1)  # after every point: partial runs


if __name__ == "__main__":
    main()
