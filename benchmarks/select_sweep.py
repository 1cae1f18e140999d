"""Prefill selection's two kernels under other launch shapes, on the GPU machine (issue 6).

A 2048-row chunk's selection at 32K is ~0.31 ms of GPU time (timeline.py, H100): the `mpp`
score producer ~176 µs and the top-k ~132 µs, against ~75 µs to write and read its float32
plane once. This times, on the GPU's clock (`bench.mlx_gpu_pass`) and in turns:
- the producer with NW (warps per CTA: 4 run both halves of each key tile, 8 one each), and
  with its score division as `__fdiv_rn` itself (`score_nw8_fdiv_rn`) instead of common.cuh's
  `div_sqrt128`;
- with `--gbs`, the producer with other GB (key tiles per CTA; with 8 warps and `div_sqrt128`,
  2 / 8 / 16 were within 5 % of 4, 2026-12-07 r3 of div_2026-12-07);
- the top-k with NT threads and CAP candidates per row's CTA, (128, 2048), (256, 2048),
  (256, 4096), (512, 4096), on planes made beforehand ((128, 4096) was slower);
and checks that every variant's selection (ids, valid, scores) is the default's, bit for bit.

    python3 benchmarks/select_sweep.py OUT.json [--prefixes 32k,128k] [--sets 4] [--repeats 5]
        [--gbs 2,8] [--producers-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_qsa import bench, plan
from mlx_qsa.config import QSAConfig
from mlx_qsa.kernels import prefill_score, selector
from mlx_qsa.sweep import backend_name, environment
from mlx_qsa.turns import take_turns

NWS = (4, 8)
TOPKS = ((128, 2048), (256, 2048), (256, 4096), (512, 4096))  # (threads, candidates)


def use(
    nw: int, shape: tuple[int, int] | None, gb: int | None = None, ieee_div: bool = False
) -> None:
    """The launchers read these module values at each call; the top-k's plans are cached.
    shape None: the launcher's own (`selector.topk_shape`); gb None: the default; ieee_div: the
    score's division as `__fdiv_rn` (common.cuh `QSA_IEEE_DIV`) instead of `div_sqrt128`."""
    prefill_score._NW = nw
    prefill_score._GB = _GB if gb is None else gb
    prefill_score._IEEE_DIV = ieee_div
    selector._plan_top_k.cache_clear()
    selector.topk_shape = (lambda rows: shape) if shape is not None else _topk_shape


_topk_shape = selector.topk_shape
_GB = prefill_score._GB


def measure(cfg: QSAConfig, P: int, a: argparse.Namespace) -> dict:
    S, r, K = 2048, cfg.indexer_compress_ratio, cfg.block_topk
    sets = [bench.DecodeSet(cfg, P + S, S, seed=i) for i in range(a.sets)]
    cap = sets[0].pooled.shape[1]
    chunk = plan.selector_chunk_rows("prefill_blocks", S, cap, producer="mpp")
    npad = -(-cap // prefill_score._TB) * prefill_score._TB
    pieces = [(r0, min(S, r0 + chunk)) for r0 in range(0, S, chunk)]
    nw0 = prefill_score._NW

    def produce(i: int) -> list:
        s = sets[i]
        return [
            prefill_score.prefill_scores_cuda(s.index_q[:, :, r0:r1], s.pooled, s.positions[r0:r1])
            for r0, r1 in pieces
        ]

    def top_k(i: int, planes: list) -> list:
        return [
            selector.top_k_from_plane(
                *planes[j], sets[i].positions[r0:r1], block_topk=K, ratio=r, npad=npad
            )
            for j, (r0, r1) in enumerate(pieces)
        ]

    def joined(parts: list) -> list[np.ndarray]:
        """ids, valid, scores of the whole chunk from its pieces' top-k outputs."""
        return [np.array(mx.concatenate([p[f] for p in parts])) for f in range(3)]

    def same_as_base(parts_of: Callable[[int], list]) -> bool:
        return all(
            all(np.array_equal(x, y) for x, y in zip(joined(parts_of(i)), base[i], strict=True))
            for i in range(a.sets)
        )

    use(nw0, None)
    base = [joined(top_k(i, produce(i))) for i in range(a.sets)]
    planes = [produce(i) for i in range(a.sets)]
    mx.eval(planes)
    passes: dict[str, Callable[[], float]] = {}
    same: dict[str, bool] = {}
    # the producer: its warps, its division as __fdiv_rn, then (--gbs) its key tiles per CTA
    # with the default warps
    producers = [(f"score_nw{nw}", nw, None, False) for nw in NWS]
    producers += [(f"score_nw{nw0}_fdiv_rn", nw0, None, True)]
    producers += [(f"score_gb{gb}", nw0, gb, False) for gb in a.gbs]
    for name, nw, gb, ieee in producers:
        use(nw, None, gb, ieee)
        same[name] = same_as_base(lambda i: top_k(i, produce(i)))
        one = bench.mlx_gpu_pass(lambda i: [p[0] for p in produce(i)], a.sets)
        passes[name] = lambda one=one, nw=nw, gb=gb, ieee=ieee: (use(nw, None, gb, ieee), one())[1]
    for shape in () if a.producers_only else TOPKS:  # the top-k on the default producer's planes
        use(nw0, shape)
        name = f"topk_nt{shape[0]}_cap{shape[1]}"
        same[name] = same_as_base(lambda i: top_k(i, planes[i]))
        one = bench.mlx_gpu_pass(lambda i: [p[0] for p in top_k(i, planes[i])], a.sets)
        passes[name] = lambda one=one, shape=shape: (use(nw0, shape), one())[1]
    samples = take_turns(passes, a.repeats, warm_rounds=1, settle_s=a.settle)
    use(nw0, None)
    t = {k: bench.summary(v) for k, v in samples.items()}
    line = ", ".join(f"{k} {v['median_us']:.1f}" for k, v in t.items())
    print(f"prefix {P}: chunk {chunk} x{len(pieces)} (GPU clock, µs): {line}", flush=True)
    print(f"  same selection as the defaults' (NW {nw0}): {same}", flush=True)
    return {"prefix": P, "rows": S, "chunk_rows": chunk, "timings": t, "selection_equal": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--prefixes", default="32k,128k")
    p.add_argument("--sets", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--settle", type=float, default=1.0)
    p.add_argument("--gbs", type=bench._int_list, default=(), help="producer GB values, e.g. 2,8")
    p.add_argument("--producers-only", action="store_true", help="no top-k forms")
    a = p.parse_args()
    cfg = QSAConfig()
    doc = {
        "device": environment(backend_name()),
        "defaults": {
            "GB": prefill_score._GB,
            "NW": prefill_score._NW,
            "topk_shape_2048_rows": list(selector.topk_shape(2048)),
        },
        "points": [measure(cfg, P, a) for P in bench._int_list(a.prefixes)],
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
