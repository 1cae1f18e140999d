"""`prefill_flash` on CUDA per row against over shared tiles (issue 6; PERFORMANCE.md §3), in
turns, with torch's dense causal SDPA over the same context, at the real geometry (24 query
heads, 2 KV heads, head_dim 256, top-512 of 4-token blocks).

    python3 benchmarks/prefill_shared_ab.py OUT.json [--prefixes 32768] [--overlaps 0,0.5,0.9]

Selections drift from row to row: each row keeps a fraction `overlap` of the previous row's
blocks and draws the rest anew from its visible blocks (0: independent random rows, as `mlx-qsa
bench prefill` has them; real models' adjacent queries sit in between). Entries per point:
`per_row` (the gather kernel), `shared` (tiles whose union holds at most `tile_limit` blocks over
shared tiles, the others per row: what `shared=True` does), `all_tiles` (every tile over shared
tiles, the limit lifted: the tile form's own cost; `--tilings`: also in 32-token stages),
torch. Records each point's mean union size per 8-row tile, the share of tiles under the limit,
and the outputs' distance to `per_row`.
One `mx.eval` per step; `--sets` rotated K/V sets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from unittest import mock

import mlx.core as mx
import numpy as np
from sdpa_ab import HKV, SCALE, D, H, K, R, random_chunk, rel

from mlx_qsa import bench
from mlx_qsa.bench import mlx_pass, time_in_turns, torch_causal_pass
from mlx_qsa.kernels import prefill_flash as pf
from mlx_qsa.kernels import sdpa

S = 2048  # rows of the chunk


def drifting_selection(rng, P: int, overlap: float) -> tuple[np.ndarray, np.ndarray]:
    """ids / valid [S, K]: row r's K blocks of its visible ones, keeping `overlap` of row
    r - 1's."""
    ids = np.zeros((S, K), np.int32)
    prev = None
    for r in range(S):
        nb = (P + r + 1) // R
        if prev is None or overlap == 0:
            cur = rng.choice(nb, K, replace=False)
        else:
            keep = rng.choice(prev, int(overlap * K), replace=False)
            fresh = rng.choice(nb, min(nb, 2 * K), replace=False)
            fresh = fresh[~np.isin(fresh, keep)][: K - len(keep)]
            cur = np.concatenate([keep, fresh])
        ids[r] = rng.permutation(cur)
        prev = cur
    return ids, np.ones((S, K), bool)


def point(
    P: int, overlap: float, sets: int, warmup: int, repeats: int, torch, tilings: tuple = ()
) -> dict:
    rng = np.random.default_rng([P, int(overlap * 1000)])
    T = P + S
    pos = mx.array(np.arange(P, T, dtype=np.int32))
    data = []
    for i in range(sets):
        q, keys, values = random_chunk(mx.random.key(7 * P + i), S, T)
        ids, valid = (mx.array(a) for a in drifting_selection(rng, P, overlap))
        mx.eval(q, keys, values, ids, valid)
        data.append((q, keys, values, ids, valid))
    mx.eval(pos)
    lifted = pf.RT * K + pf.RT

    def run(i, shared, limit=None, tiling=sdpa.TILING):
        q, keys, values, ids, valid = data[i]
        if limit is None:
            return pf.prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=SCALE,
                                         shared=shared)  # fmt: skip
        with (
            mock.patch.object(pf, "tile_limit", lambda k: limit),
            mock.patch.object(sdpa, "TILING", tiling),
        ):
            return pf.prefill_flash_cuda(q, keys, values, ids, valid, pos, scale=SCALE,
                                         shared=True)  # fmt: skip

    def run_sort(i):  # the union by sorting, where the table form would fit
        with mock.patch.object(pf, "UNION_TABLE", False):
            return run(i, True)

    q, keys, values, ids, valid = data[0]
    _, counts = pf.tile_union_cuda(ids, valid, pos, keys, ratio=R)
    c = np.array(counts)
    a, b, f = run(0, False), run(0, True), run(0, True, lifted)

    rec = {
        "prefix": P,
        "rows": S,
        "overlap": overlap,
        "union_blocks_mean": float(c.mean()),
        "union_fraction_of_rows_blocks": float(c.mean() / (pf.RT * K)),
        "tiles_under_limit": float((c <= pf.tile_limit(K)).mean()),
        "tile_limit": pf.tile_limit(K),
        "rel_diff_vs_per_row": {"shared": rel(b, a), "all_tiles": rel(f, a)},
    }
    passes = {
        "per_row": mlx_pass(lambda i: run(i, False), sets),
        "shared": mlx_pass(lambda i: run(i, True), sets),
        "shared_sort": mlx_pass(run_sort, sets),
        "all_tiles": mlx_pass(lambda i: run(i, True, lifted), sets),
    }
    for t in tilings:  # the list form's other K/V streaming forms
        passes[f"all_tiles_{t.label}"] = mlx_pass(lambda i, t=t: run(i, True, lifted, t), sets)
    if torch is not None:
        passes["torch_causal"] = torch_causal_pass(H, D, S, T, sets, SCALE, sync_each=True)
    rec["timings"] = time_in_turns(passes, warmup, repeats)
    t = {k: v["median_us"] for k, v in rec["timings"].items()}
    rec["ratios"] = {
        "per_row / shared": t["per_row"] / t["shared"],
        "per_row / shared_sort": t["per_row"] / t["shared_sort"],
        "per_row / all_tiles": t["per_row"] / t["all_tiles"],
    }
    if "torch_causal" in t:
        rec["ratios"]["torch / per_row"] = t["torch_causal"] / t["per_row"]
        rec["ratios"]["torch / shared"] = t["torch_causal"] / t["shared"]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prefixes", type=bench._int_list, default=(32768,))
    ap.add_argument("--overlaps", default="0,0.5,0.75,0.9,0.97")
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tilings", action="store_true", help="also the list form in other tilings")
    args = ap.parse_args()
    torch = bench._torch_cuda()
    doc = {
        "bench": "prefill_shared_ab",
        "device_name": torch.cuda.get_device_name() if torch is not None else None,
        "command": " ".join(["python3"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"mlx": mx.__version__, "python": platform.python_version()},
        "geometry": {"H": H, "Hkv": HKV, "d": D, "K": K, "ratio": R, "rows": S},
        "points": [],
    }
    if torch is not None:
        doc["versions"]["torch"] = torch.__version__
    for P in args.prefixes:
        for ov in (float(x) for x in args.overlaps.split(",")):
            others = (sdpa.Tiling(32, 3), sdpa.Tiling(32, 4)) if args.tilings else ()
            rec = point(P, ov, args.sets, args.warmup, args.repeats, torch, others)
            doc["points"].append(rec)
            t = {k: round(v["median_us"], 1) for k, v in rec["timings"].items()}
            print(P, ov, round(rec["union_blocks_mean"]), rec["tiles_under_limit"], t,
                  {k: round(v, 2) for k, v in rec["ratios"].items()},
                  rec["rel_diff_vs_per_row"], flush=True)  # fmt: skip
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
