"""Where the decode selector's time goes, on the GPU (issue 5: the selector is ~35 of the ~51 µs
of kernel time in a 128K one-row step).

Two measures, over `--sets` rotated DecodeSets per point:
- **phases**: each form's selector built with `QSA_STAMPS` (selector.cu), whose top-k CTA
  records its SM clock at each phase end: its own scoring and the wait for the other CTAs (both
  0 in the two-launch form, whose top-k is a kernel of its own), the lower bound u from the
  summaries, the candidate scan, the radix select, the tie select, the bitmap, the offsets, the
  writes; and the candidate count. Medians in cycles and in µs at the SM clock given by `--mhz`
  (the lent H100s run at 1980 MHz).
- **forms on the GPU clock** (`bench.mlx_gpu_pass`, in turns): the selector as the library runs
  it, the two-launch form (``MLX_QSA_SELECT_ONE_LAUNCH=0``), the split-heads form
  (``MLX_QSA_SELECT_SPLIT_HEADS=1``) and `--extra` forms named by switches; each form's
  selection is checked bit for bit against the default's.

    python3 benchmarks/select_phases.py OUT.json [--points 8192x1,32768x1,131072x1,131072x4]
        [--sets 8] [--repeats 7] [--mhz 1980] [--extra NAME=VALUE,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import mlx.core as mx

from mlx_qsa import bench
from mlx_qsa.config import QSAConfig
from mlx_qsa.kernels import _launch, selector

# stamp slots (selector.cu QSA_STAMP) -> phase names, as consecutive differences
PHASES = ("own_scoring", "wait_for_others", "bound_u", "candidate_scan", "radix_select",
          "tie_select", "bitmap", "offsets", "writes")  # fmt: skip
FORMS = {
    "default": {},
    "two_launch": {"MLX_QSA_SELECT_ONE_LAUNCH": "0"},
    "split_heads": {"MLX_QSA_SELECT_SPLIT_HEADS": "1"},
}


def phase_cycles(row: list[int]) -> dict[str, int] | None:
    """One row's stamps (selector.cu QSA_STAMP: clocks in slots 0..9, the candidate count in
    slot 10) as cycles per phase, with `total` and `candidates`; None for a dense row (at most
    K visible blocks: its select writes 0 candidates and returns before the phases) or clocks
    out of order (slots never written)."""
    clocks, ncand = row[:10], row[10]
    if ncand <= 0 or any(b < a for a, b in itertools.pairwise(clocks)):
        return None
    out = {p: clocks[i + 1] - clocks[i] for i, p in enumerate(PHASES)}
    out["total"] = clocks[9] - clocks[0]
    out["candidates"] = ncand
    return out


def switches(values: dict[str, str]) -> None:
    for name in {n for f in FORMS.values() for n in f}:
        bench.set_switch(name, values.get(name))


def select(cfg: QSAConfig, s: bench.DecodeSet) -> tuple[mx.array, ...]:
    mode = "blocks" if s.rows == 1 else "row_tokens"
    return selector.select_blocks_cuda(
        s.index_q, s.pooled, s.positions, block_topk=cfg.block_topk,
        ratio=cfg.indexer_compress_ratio, mode=mode,
    )  # fmt: skip


def same_bits(got: tuple[mx.array, ...], want: tuple[mx.array, ...]) -> bool:
    return all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


def phases(
    cfg: QSAConfig, sets: list, ref: list, repeats: int, mhz: float, form: dict[str, str]
) -> dict:
    """Phase clocks of the selector that `form`'s switches give, over the sets (medians), and
    whether its selections are the default's bits (`ref`, one per set)."""
    s0 = sets[0]
    mode = "blocks" if s0.rows == 1 else "row_tokens"
    switches(form)
    run = selector._plan(
        "select_phases", s0.index_q, s0.pooled, s0.positions, cfg.block_topk,
        cfg.indexer_compress_ratio, mode, selector.select_one_launch_env(), stamps=True,
    )  # fmt: skip
    switches({})
    # Nothing is read on the host until every launch has run: MLX moves a device buffer that the
    # host reads into managed memory and later hands it, cached, to a kernel's output, whose
    # first writes then fault its pages back (~50 µs landed in whichever phase wrote first).
    # Clearing the cache first keeps earlier host reads' buffers out of these launches.
    mx.clear_cache()
    outs = []
    for _ in range(repeats):
        for s in sets:
            outs.append(run(s.index_q, s.pooled, s.positions, _launch.counter_slot()))
            mx.eval(outs[-1])
    same = all(
        same_bits(out[:-1], want)
        for out, want in zip(outs, itertools.cycle(ref))  # outs: repeats x sets, in set order
    )
    deltas: dict[str, list[int]] = {p: [] for p in (*PHASES, "total", "candidates")}
    for out in outs:
        for row in out[-1].tolist():
            ph = phase_cycles(row)
            for p, v in (ph or {}).items():
                deltas[p].append(v)
    ncand = deltas.pop("candidates")
    med = {p: statistics.median(v) for p, v in deltas.items() if v}
    top_k = [p for p in PHASES[2:] if p in med]
    return {
        "same_bits_as_default": same,
        "cycles": med,
        "us_at_mhz": {p: c / mhz for p, c in med.items()},
        "top_k_us": sum(med[p] for p in top_k) / mhz if top_k else None,
        "candidates_median": statistics.median(ncand) if ncand else None,
        "samples": len(ncand),
    }


def forms(cfg: QSAConfig, sets: list, ref: list, repeats: int) -> dict:
    """Each form on the GPU clock, in turns, and whether its selections are `ref`'s bits."""
    checks, passes = {}, {}
    for name, values in FORMS.items():
        switches(values)
        got = [select(cfg, s) for s in sets]
        mx.eval(got)
        checks[name] = all(same_bits(g, r) for g, r in zip(got, ref, strict=True))
        one = bench.mlx_gpu_pass(lambda i: select(cfg, sets[i]), len(sets))

        def timed(one=one, values=values) -> float:
            switches(values)
            return one()

        passes[name] = timed
    timings = bench.time_in_turns(passes, 2, repeats, 1.0)
    switches({})
    return {"checks": checks, "gpu_us": {k: v["median_us"] for k, v in timings.items()},
            "timings": timings}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--points", default="8192x1,32768x1,131072x1,131072x4")
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--mhz", type=float, default=1980.0)
    ap.add_argument("--extra", default="", help="more forms: NAME=VALUE[;NAME=VALUE],... ")
    a = ap.parse_args()
    if not mx.cuda.is_available():
        print("select_phases: needs MLX's CUDA backend", file=sys.stderr)
        return 2
    for i, spec in enumerate(x for x in a.extra.split(",") if x):
        FORMS[f"extra{i}"] = dict(kv.split("=", 1) for kv in spec.split(";"))
    cfg = QSAConfig()
    doc = {"environment": bench.environment("cuda"), "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "mhz": a.mhz,
           "forms": FORMS, "points": []}  # fmt: skip
    ok = True
    for spec in a.points.split(","):
        T, rows = (int(v) for v in spec.split("x"))
        sets = [bench.DecodeSet(cfg, T, rows, seed) for seed in range(a.sets)]
        switches({})
        ref = [select(cfg, s) for s in sets]  # the default form's selections
        mx.eval(ref)
        rec = {"context": T, "rows": rows, "phases": {}}
        rec.update(forms(cfg, sets, ref, a.repeats))
        print(f"T={T} rows={rows} gpu_us={ {k: round(v, 1) for k, v in rec['gpu_us'].items()} } "
              f"checks={rec['checks']}", flush=True)  # fmt: skip
        for name, form in FORMS.items():
            ph = rec["phases"][name] = phases(cfg, sets, ref, 3, a.mhz, form)
            ok = ok and ph["same_bits_as_default"]
            print(f"  {name}: same bits {ph['same_bits_as_default']}, candidates "
                  f"{ph['candidates_median']}, top-k {ph['top_k_us']} us; "
                  + ", ".join(f"{k}={v:.2f}" for k, v in ph["us_at_mhz"].items()),
                  flush=True)  # fmt: skip
        ok = ok and all(rec["checks"].values())
        doc["points"].append(rec)
        del sets, ref
        bench.release_device_memory()
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
