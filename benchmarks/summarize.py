"""Markdown tables of `mlx-qsa bench` JSON documents (for BENCHMARKS.md).

Usage: python3 benchmarks/summarize.py decode.json [prefill.json]
"""

from __future__ import annotations

import json
import sys


def _ratio(t: dict, peer: str, ours: str) -> str:
    """peer ÷ ours as text, or – where either entry is absent (older documents)."""
    if peer not in t or ours not in t:
        return "–"
    return f"{t[peer]['median_us'] / t[ours]['median_us']:.2f}"


def decode_table(doc: dict) -> str:
    """One row per point. Ratios compare like with like: an `mx.eval` (or torch synchronize)
    per step against the same, queued steps against queued steps (torch's queued entry is
    `torch_dense_sdpa`, CUDA events around the pass; its synchronized one `torch_dense_sdpa_sync`,
    absent from documents before 2026-12-04)."""
    cols = [
        ("qsa_cuda", "CUDA"),
        ("qsa_cuda_async", "CUDA, queued"),
        ("qsa_portable", "portable"),
        ("mlx_gather_sdpa", "MLX gather+SDPA"),
        ("mlx_dense_sdpa", "MLX dense SDPA"),
        ("torch_dense_sdpa_sync", "torch dense SDPA"),
        ("torch_dense_sdpa", "torch, queued"),
        ("qsa_cuda_layer", "CUDA layer"),
    ]
    head = "| context | rows | " + " | ".join(c[1] for c in cols) + " | floor |"
    head += " torch ÷ CUDA | queued: torch ÷ CUDA | gather+SDPA ÷ CUDA | CUDA ÷ floor |"
    lines = [head, "|" + "---|" * (len(cols) + 7)]
    for p in doc["points"]:
        t = p["timings"]
        us = [f"{t[c]['median_us']:.0f}" if c in t else "–" for c, _ in cols]
        ours = t["qsa_cuda"]["median_us"]
        fl = p["floor"]["us"]
        lines.append(
            f"| {p['context'] // 1024}K | {p['rows']} | "
            + " | ".join(us)
            + f" | {fl:.1f} | {_ratio(t, 'torch_dense_sdpa_sync', 'qsa_cuda')} | "
            + f"{_ratio(t, 'torch_dense_sdpa', 'qsa_cuda_async')} | "
            + f"{_ratio(t, 'mlx_gather_sdpa', 'qsa_cuda')} | {ours / fl:.0f} |"
        )
    return "\n".join(lines)


def prefill_table(doc: dict) -> str:
    lines = [
        "| prefix | rows | CUDA layer ms | portable layer ms | torch dense causal ms "
        "| torch ÷ CUDA |",
        "|---|---|---|---|---|---|",
    ]
    for p in doc["points"]:
        t = p["timings"]
        c = t["qsa_cuda_layer"]["median_us"] / 1e3
        po = t["qsa_portable_layer"]["median_us"] / 1e3
        to = t["torch_dense_causal_sdpa"]["median_us"] / 1e3
        cells = (f"{p['prefix'] // 1024}K", p["rows"], f"{c:.2f}", f"{po:.2f}", f"{to:.2f}")
        lines.append("| " + " | ".join(map(str, cells)) + f" | {to / c:.2f} |")
    return "\n".join(lines)


def main() -> None:
    for path in sys.argv[1:]:
        doc = json.load(open(path))
        print(f"{path}: {doc['device_name']}, {doc['date']}, `{doc['command']}`\n")
        print(decode_table(doc) if doc["bench"] == "decode" else prefill_table(doc))
        print()


if __name__ == "__main__":
    main()
