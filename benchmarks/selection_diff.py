"""Rows whose CUDA prefill selection differs from the portable path's, and why (on the GPU).

`mlx-qsa bench prefill` checks the chunk's CUDA selection against the portable one on the same
inputs (set 0 of each point). Both compute QSA.md §8.2's scores in float32 from bf16 operands,
but they sum each dot product's 128 exact products in different orders (the score producer's
tiles; MLX's GEMM), so two scores can round one ulp apart. Where a row's K-th and (K+1)-th
blocks lie that close, the two paths may pick different blocks. For every differing row this
prints both paths' float32 scores of the blocks only one of them picked, their float64 value
(the exact dot products, summed in float64), and how far the row's K-th and (K+1)-th float64
scores lie apart in float32 ulps.

    python3 benchmarks/selection_diff.py [--prefixes 16384] [--chunk 2048] [--sets 1] [--out F]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from mlx_qsa.bench import DecodeSet, prefill_steps
from mlx_qsa.config import QSAConfig, QSAOptions
from mlx_qsa.indexer import SQRT_128_F32


def float64_scores(s: DecodeSet, row: int, n_blocks: int) -> np.ndarray:
    """Adjusted scores of `row` over blocks 0..n_blocks-1 in float64 (the products are exact;
    the sums are float64), with QSA.md §8.2's division and penalty."""
    q = np.array(s.index_q[0, :, row].astype(mx.float32), dtype=np.float64)  # [H_I, d_I]
    k = np.array(s.pooled[0, :n_blocks].astype(mx.float32), dtype=np.float64)  # [N, d_I]
    dots = q @ k.T  # [H_I, N]
    score = np.maximum(dots, 0.0).sum(axis=0) / float(SQRT_128_F32)
    return score - np.arange(n_blocks, dtype=np.float64) * 1e-12


def ulps_apart(a: float, b: float) -> float:
    """|a - b| in float32 ulps at the larger magnitude."""
    m = max(abs(a), abs(b))
    ulp = float(np.spacing(np.float32(m))) if m > 0 else float(np.spacing(np.float32(0)))
    return abs(a - b) / ulp


def diff_rows(
    cfg: QSAConfig, P: int, S: int, seed_set: int, impls: tuple[str, str] = ("cuda", "portable")
) -> dict:
    T = P + S
    s = DecodeSet(cfg, T, S, seed=7 * T + seed_set)  # the bench's set `seed_set` at this point
    routing = QSAOptions(prefill_min_context=2049, flash_min=2049)
    _, _, (sel_c, _) = prefill_steps(cfg, [s], impls[0], routing)
    _, _, (sel_p, _) = prefill_steps(cfg, [s], impls[1], routing)
    ids_c, ids_p = np.array(sel_c.ids), np.array(sel_p.ids)
    ok_c, ok_p = np.array(sel_c.valid), np.array(sel_p.valid)
    sc_c, sc_p = np.array(sel_c.scores), np.array(sel_p.scores)
    pos = np.array(s.positions)
    K, r = cfg.block_topk, cfg.indexer_compress_ratio
    rows = []
    for i in np.nonzero((ids_c != ids_p).any(axis=1) | (ok_c != ok_p).any(axis=1))[0]:
        nb = int(pos[i] + 1) // r
        exact = float64_scores(s, int(i), nb)
        order = np.lexsort((np.arange(nb), -exact))  # (adj desc, id asc) in float64
        kth, next_ = exact[order[K - 1]], exact[order[K]]
        only_c = sorted(set(ids_c[i][ok_c[i]].tolist()) - set(ids_p[i][ok_p[i]].tolist()))
        only_p = sorted(set(ids_p[i][ok_p[i]].tolist()) - set(ids_c[i][ok_c[i]].tolist()))

        def info(b: int, i=i, exact=exact) -> dict:
            where_c = np.nonzero(ids_c[i] == b)[0]
            where_p = np.nonzero(ids_p[i] == b)[0]
            return {
                "block": b,
                "cuda_f32": float(sc_c[i][where_c[0]]) if len(where_c) else None,
                "portable_f32": float(sc_p[i][where_p[0]]) if len(where_p) else None,
                "float64": float(exact[b]),
            }

        rows.append({
            "row": int(i), "position": int(pos[i]), "visible_blocks": nb,
            "kth_float64": float(kth), "next_float64": float(next_),
            "kth_next_ulps": ulps_apart(kth, next_),
            "only_cuda": [info(b) for b in only_c], "only_portable": [info(b) for b in only_p],
        })  # fmt: skip
    return {"prefix": P, "rows": S, "set": seed_set, "differing_rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", default="16384")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--sets", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--impls", default="cuda,portable", help="the two paths compared")
    a = ap.parse_args()
    cfg = QSAConfig()
    out = []
    for P in (int(x) for x in a.prefixes.split(",")):
        for i in range(a.sets):
            rec = diff_rows(cfg, P, a.chunk, i, tuple(a.impls.split(",")))
            out.append(rec)
            print(f"prefix {P} set {i}: {len(rec['differing_rows'])} differing rows", flush=True)
            for d in rec["differing_rows"]:
                print(json.dumps(d), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
