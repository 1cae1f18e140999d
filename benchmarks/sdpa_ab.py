"""The `sdpa` consumer on CUDA: the masked-attention kernel (kernels/sdpa.cu) against MLX's own
SDPA (the portable path, which materialises the scores at head_dim 256) and torch's dense
causal SDPA, in turns, at the real geometry (24 query heads, 2 KV heads, head_dim 256).

    python3 benchmarks/sdpa_ab.py OUT.json [--quick] [--tilings]

Points: chunks of S rows after P tokens, with the indexer's keep-mask (512 random 4-token
blocks of the visible ones per row plus its tail, `dense_keep_mask`) and causal. One `mx.eval`
per step; `--sets` rotated K/V sets. Also the kernel's outputs against MLX's on every point.
`--tilings`: also the kernel's other K/V streaming forms (`kernels.sdpa.TILINGS`), in the same
turns, each checked against MLX's outputs too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import mlx.core as mx
import numpy as np

from mlx_qsa import bench
from mlx_qsa.bench import mlx_pass, time_in_turns, torch_causal_pass
from mlx_qsa.consumers.sdpa import sdpa
from mlx_qsa.indexer import dense_keep_mask
from mlx_qsa.kernels.sdpa import TILING, TILINGS, sdpa_cuda

H, HKV, D, K, R = 24, 2, 256, 512, 4
SCALE = 1 / 16


def random_chunk(key: mx.array, S: int, T: int) -> tuple[mx.array, mx.array, mx.array]:
    """bf16 normal q `[1, H, S, D]` and K/V backings `[1, HKV, cap, D]` (T rounded up to 256)."""
    cap = -(-T // 256) * 256
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((1, H, S, D), key=k1).astype(mx.bfloat16)
    keys = mx.random.normal((1, HKV, cap, D), key=k2).astype(mx.bfloat16)
    values = mx.random.normal((1, HKV, cap, D), key=k3).astype(mx.bfloat16)
    return q, keys, values


def rel(x: mx.array, y: mx.array) -> float:
    """Relative distance of x from y (float32, Frobenius norm)."""
    x, y = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def keep_mask(rng, S: int, P: int) -> mx.array:
    T = P + S
    pos = np.arange(P, T)
    ids = np.zeros((S, K), np.int32)
    valid = np.zeros((S, K), bool)
    for r, p in enumerate(pos):
        nb = (p + 1) // R
        k = min(K, nb)
        ids[r, :k] = rng.choice(nb, k, replace=False) if nb > K else np.arange(k)
        valid[r, :k] = True
    width = -(-T // 4) * 4  # rows padded to 4 bytes, as consumers.dispatch makes them
    m = dense_keep_mask(mx.array(ids), mx.array(valid), mx.array(pos.astype(np.int32)), width, R)
    return m[None, None, :, :T]


def point(S: int, P: int, sets: int, warmup: int, repeats: int, torch, tilings: tuple = ()) -> dict:
    rng = np.random.default_rng([S, P])
    T = P + S
    data = []
    for i in range(sets):
        q, keys, values = random_chunk(mx.random.key(1000 * S + P + i), S, T)
        mask = keep_mask(rng, S, P)
        mx.eval(q, keys, values, mask)
        data.append((q, keys, values, mask))
    pos = mx.array(np.arange(P, T, dtype=np.int32))
    mx.eval(pos)
    rec: dict = {"rows": S, "prefix": P, "context": T}
    q, keys, values, mask = data[0]
    a = sdpa_cuda(q, keys, values, pos, scale=SCALE, mask=mask, context=T, within_causal=True)
    b = sdpa(q, keys, values, T, SCALE, mask=mask)
    c = sdpa_cuda(q, keys, values, pos, scale=SCALE, context=T)
    d = sdpa(q, keys, values, T, SCALE, mask="causal")

    rec["rel_diff_vs_mlx"] = {"mask": rel(a, b), "causal": rel(c, d)}
    for t in tilings:
        a = sdpa_cuda(
            q, keys, values, pos, scale=SCALE, mask=mask, context=T, within_causal=True, tiling=t
        )
        c = sdpa_cuda(q, keys, values, pos, scale=SCALE, context=T, tiling=t)
        rec["rel_diff_vs_mlx"][f"mask_{t.label}"] = rel(a, b)
        rec["rel_diff_vs_mlx"][f"causal_{t.label}"] = rel(c, d)
    rec["mask_density"] = float(np.array(mask).mean())
    passes = {
        "cuda_mask": mlx_pass(
            lambda i: sdpa_cuda(
                *data[i][:3], pos, scale=SCALE, mask=data[i][3], context=T, within_causal=True
            ),
            sets,
        ),
        "mlx_mask": mlx_pass(lambda i: sdpa(*data[i][:3], T, SCALE, mask=data[i][3]), sets),
        "cuda_causal": mlx_pass(
            lambda i: sdpa_cuda(*data[i][:3], pos, scale=SCALE, context=T), sets
        ),
        "mlx_causal": mlx_pass(lambda i: sdpa(*data[i][:3], T, SCALE, mask="causal"), sets),
    }
    for t in tilings:

        def mask_step(i, t=t):
            return sdpa_cuda(
                *data[i][:3], pos, scale=SCALE, mask=data[i][3], context=T, within_causal=True,
                tiling=t,
            )  # fmt: skip

        def causal_step(i, t=t):
            return sdpa_cuda(*data[i][:3], pos, scale=SCALE, context=T, tiling=t)

        passes[f"cuda_mask_{t.label}"] = mlx_pass(mask_step, sets)
        passes[f"cuda_causal_{t.label}"] = mlx_pass(causal_step, sets)
    if torch is not None:
        passes["torch_causal_sync"] = torch_causal_pass(H, D, S, T, sets, SCALE, sync_each=True)
    rec["timings"] = time_in_turns(passes, warmup, repeats)
    flops = 4 * H * D * sum(P + r + 1 for r in range(S))  # the causal region, dense
    rec["causal_flops"] = flops
    t = {k: v["median_us"] for k, v in rec["timings"].items()}
    rec["tflops_causal_region"] = {k: flops / (us * 1e6) for k, us in t.items()}
    rec["ratios"] = {
        "mlx_mask / cuda_mask": t["mlx_mask"] / t["cuda_mask"],
        "mlx_causal / cuda_causal": t["mlx_causal"] / t["cuda_causal"],
    }
    if "torch_causal_sync" in t:
        rec["ratios"]["torch_causal / cuda_mask"] = t["torch_causal_sync"] / t["cuda_mask"]
        rec["ratios"]["torch_causal / cuda_causal"] = t["torch_causal_sync"] / t["cuda_causal"]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--tilings", action="store_true", help="also kernels.sdpa.TILINGS")
    args = ap.parse_args()
    torch = bench._torch_cuda()
    big = [(2048, 2048), (2048, 8192), (2048, 30720)]
    small = [(2, 8192), (4, 2048), (4, 8192), (8, 8192), (16, 8192), (64, 8192), (256, 8192)]
    pts = big + ([] if args.quick else small)
    doc = {
        "bench": "sdpa_ab",
        "device_name": torch.cuda.get_device_name() if torch is not None else None,
        "command": " ".join(["python3"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"mlx": mx.__version__, "python": platform.python_version()},
        "geometry": {"H": H, "Hkv": HKV, "d": D, "K": K, "ratio": R},
        "points": [],
        "tiling": TILING.label,
    }
    if torch is not None:
        doc["versions"]["torch"] = torch.__version__
    for S, P in pts:
        others = tuple(t for t in TILINGS if t != TILING) if args.tilings else ()
        rec = point(S, P, args.sets, args.warmup, args.repeats, torch, others)
        doc["points"].append(rec)
        t = {k: round(v["median_us"], 1) for k, v in rec["timings"].items()}
        print(S, P, t, {k: round(v, 2) for k, v in rec["ratios"].items()},
              rec["rel_diff_vs_mlx"], flush=True)  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
