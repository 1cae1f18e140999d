"""Prefill kernels one at a time (issue 6), GPU machine only: where a 2048-row chunk's time goes.

    python3 benchmarks/prefill_parts.py OUT.json [--prefixes 32k,128k] [--rows 2048]

For each prefix it times, on the same rotated inputs (`bench.DecodeSet`, real geometry):
the `mpp` score producer alone over the chunk's RUNTIME §6.3 pieces, the top-k kernel alone on
planes made beforehand, the whole selection (`select_prefill_cuda`) and `prefill_flash` alone;
then, in turns on the GPU clock, `prefill_flash` against its forms (`prefill_flash_form_cuda`:
its K/V loads without the math, its math without the loads).
It also counts the bytes `prefill_flash` must read (each row's selected K/V tokens, every KV
head) against the copy bandwidth measured in the same run, and how much adjacent rows'
selections overlap (the union of a tile of consecutive rows against the sum of its rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_qsa import bench, plan
from mlx_qsa.config import QSAConfig
from mlx_qsa.kernels.prefill_flash import (
    FORMS,
    prefill_flash_cuda,
    prefill_flash_form_cuda,
)
from mlx_qsa.kernels.prefill_score import _TB, prefill_scores_cuda, select_prefill_cuda
from mlx_qsa.kernels.selector import top_k_from_plane
from mlx_qsa.sweep import backend_name, environment


def overlap(ids: np.ndarray, valid: np.ndarray, tile: int) -> float:
    """Mean over tiles of `tile` consecutive rows: |union of their blocks| / sum of counts."""
    fr = []
    for r0 in range(0, ids.shape[0] - tile + 1, tile):
        blocks = [set(ids[r][valid[r]].tolist()) for r in range(r0, r0 + tile)]
        total = sum(len(b) for b in blocks)
        if total:
            fr.append(len(set().union(*blocks)) / total)
    return float(np.mean(fr)) if fr else float("nan")


def measure(cfg: QSAConfig, T0: int, S: int, a: argparse.Namespace, bw: float) -> dict:
    """One prefix: the four timings, the bytes floor, the overlap."""
    r, K = cfg.indexer_compress_ratio, cfg.block_topk
    T = T0 + S
    sets = [bench.DecodeSet(cfg, T, S, seed=i) for i in range(a.sets)]
    cap = sets[0].pooled.shape[1]
    chunk = plan.selector_chunk_rows("prefill_blocks", S, cap, producer="mpp")
    npad = -(-cap // _TB) * _TB
    pieces = [(r0, min(S, r0 + chunk)) for r0 in range(0, S, chunk)]

    def produce(s, pieces=pieces):
        return [
            prefill_scores_cuda(s.index_q[:, :, r0:r1], s.pooled, s.positions[r0:r1])
            for r0, r1 in pieces
        ]

    planes = [produce(s) for s in sets]
    mx.eval(planes)

    def topk(i, pieces=pieces, npad=npad):
        return [
            top_k_from_plane(
                *planes[i][j], sets[i].positions[r0:r1], block_topk=K, ratio=r, npad=npad
            )[0]
            for j, (r0, r1) in enumerate(pieces)
        ]

    def select(s, chunk=chunk):
        return select_prefill_cuda(s.index_q, s.pooled, s.positions, chunk=chunk)

    sels = [select(s) for s in sets]
    mx.eval(sels)

    def attend(i):
        s, (ids, valid, _) = sets[i], sels[i]
        return prefill_flash_cuda(
            s.q, s.keys, s.values, ids, valid, s.positions, scale=cfg.scale, ratio=r
        )

    w, k, n = a.warmup, a.repeats, a.sets
    t = {
        "producer": bench.time_mlx(lambda i: [x[0] for x in produce(sets[i])], n, w, k),
        "topk": bench.time_mlx(topk, n, w, k),
        "selection": bench.time_mlx(lambda i: select(sets[i])[0], n, w, k),
        "prefill_flash": bench.time_mlx(attend, n, w, k),
    }

    def form(name):
        def run(i):
            s, (ids, valid, _) = sets[i], sels[i]
            return prefill_flash_form_cuda(
                s.q, s.keys, s.values, ids, valid, s.positions, form=name, scale=cfg.scale,
                ratio=r,
            )  # fmt: skip

        return run

    # The kernel and its halves on the GPU clock, in turns (loads alone, math alone): it costs
    # at least the larger, which bounds what speeding up the other can gain.
    forms = {"prefill_flash_gpu": bench.mlx_gpu_pass(attend, n)}
    forms |= {f"{name}_gpu": bench.mlx_gpu_pass(form(name), n) for name in FORMS}
    t.update(bench.time_in_turns(forms, w, k))
    ids, valid = (np.array(x) for x in sels[0][:2])
    tokens = int(valid.sum()) * r + sum((p + 1) % r for p in range(T - S, T))
    kv_bytes = tokens * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    rec = {
        "prefix": T0,
        "stream_kv_gbps": kv_bytes / (t["stream_gpu"]["median_us"] * 1e-6) / 1e9,
        "rows": S,
        "chunk_rows": chunk,
        "pieces": len(pieces),
        "timings": t,
        "prefill_flash_kv_bytes": kv_bytes,
        "prefill_flash_floor_us": kv_bytes / bw * 1e6,
        "kv_backing_bytes_per_head": int(sets[0].keys.nbytes // cfg.num_key_value_heads) * 2,
        "union_over_sum": {str(g): overlap(ids, valid, g) for g in (2, 4, 16, 64)},
    }
    print(
        f"prefix {T0}: chunk {chunk} x{len(pieces)}; "
        + ", ".join(f"{name} {v['median_us']:.0f} us" for name, v in t.items())
        + f"; flash floor {rec['prefill_flash_floor_us']:.0f} us"
        + f"; union/sum {rec['union_over_sum']}",
        flush=True,
    )
    return rec


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--prefixes", default="32k,128k")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--sets", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    cfg = QSAConfig()
    copy = bench.copy_bandwidth()
    bw = copy["gbps"] * 1e9
    doc = {"device": environment(backend_name()), "copy_bandwidth": copy, "points": []}
    for T0 in bench._int_list(a.prefixes):
        doc["points"].append(measure(cfg, T0, a.rows, a, bw))
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
