"""Does the masked-attention kernel pay at the layer? The whole CUDA layer on a chunk of rows after
each prefix (real geometry, as `mlx-qsa bench prefill` times `qsa_cuda_layer`: below 32K the chunk
routes to `sdpa` with the indexer's keep-mask) with the kernel (the default) and with
`MLX_QSA_SDPA_KERNEL=0` (MLX's SDPA), in turns over the same rotated caches, one `mx.eval` per
step. Also records each mode's consumers and how far the two modes' outputs are apart.

    python3 benchmarks/sdpa_layer_ab.py OUT.json [--prefixes 2048,8192,24576] [--rows 2048]
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

SWITCH = "MLX_QSA_SDPA_KERNEL"
MODES = {"kernel": None, "mlx_sdpa": "0"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--prefixes", type=bench._int_list, default=(2048, 8192, 24576))
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--sets", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    cfg = QSAConfig()
    S = a.rows
    mx.random.seed(0)
    layer = QSAAttention(cfg, options=QSAOptions(kernels="auto"), fused=4)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    doc = {
        "what": "CUDA layer on a chunk, masked-attention kernel vs MLX_QSA_SDPA_KERNEL=0, in turns",
        "environment": sweep.environment(sweep.backend_name()),
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "points": [],
    }
    for P in a.prefixes:
        caches = [bench.random_cache(layer, P + S, S, seed=i) for i in range(a.sets)]
        xs = [bench.layer_rows(cfg, S, seed=i) for i in range(a.sets)]

        def step(i: int, xs=xs, caches=caches) -> mx.array:
            y = layer(xs[i], cache=caches[i])
            caches[i].trim(S)
            return y

        rec = {"prefix": P, "rows": S, "consumers": {}}
        outs = {}
        for mode, value in MODES.items():
            bench.set_switch(SWITCH, value)
            y = step(0)
            mx.eval(y)
            rec["consumers"][mode] = list(layer.last_call.consumers)
            outs[mode] = np.array(y.astype(mx.float32))
        diff = np.linalg.norm(outs["kernel"] - outs["mlx_sdpa"])
        rec["rel_diff"] = float(diff / np.linalg.norm(outs["mlx_sdpa"]))
        passes = bench.switched_passes(step, a.sets, SWITCH, MODES)
        res = bench.time_in_turns(passes, a.warmup, a.repeats)
        rec["timings"] = {k: v["median_us"] for k, v in res.items()}
        rec["samples_us"] = {k: v["samples_us"] for k, v in res.items()}
        doc["points"].append(rec)
        t = rec["timings"]
        print(
            f"P={P} S={S} {rec['consumers']['kernel']} kernel {t['kernel']:.0f} us, MLX SDPA "
            f"{t['mlx_sdpa']:.0f} us ({t['mlx_sdpa'] / t['kernel']:.2f}x), rel diff "
            f"{rec['rel_diff']:.2e}",
            flush=True,
        )
    bench.set_switch(SWITCH, None)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
