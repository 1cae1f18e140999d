"""Markdown tables of `mlx-qsa bench` JSON documents (for BENCHMARKS.md).

Usage: python3 benchmarks/summarize.py decode.json [prefill.json]
"""

from __future__ import annotations

import json
import sys


def decode_table(doc: dict) -> str:
    cols = [
        ("qsa_cuda", "CUDA"),
        ("qsa_cuda_async", "CUDA, queued"),
        ("qsa_portable", "portable"),
        ("mlx_gather_sdpa", "MLX gather+SDPA"),
        ("mlx_dense_sdpa", "MLX dense SDPA"),
        ("torch_dense_sdpa", "torch dense SDPA"),
        ("qsa_cuda_layer", "CUDA layer"),
    ]
    head = "| context | rows | " + " | ".join(c[1] for c in cols) + " | floor |"
    head += " torch ÷ CUDA | gather+SDPA ÷ CUDA | CUDA ÷ floor |"
    lines = [head, "|" + "---|" * (len(cols) + 6)]
    for p in doc["points"]:
        t = p["timings"]
        us = [f"{t[c]['median_us']:.0f}" if c in t else "–" for c, _ in cols]
        ours = t["qsa_cuda"]["median_us"]
        r_t = t["torch_dense_sdpa"]["median_us"] / ours if "torch_dense_sdpa" in t else None
        r_g = t["mlx_gather_sdpa"]["median_us"] / ours
        fl = p["floor"]["us"]
        lines.append(
            f"| {p['context'] // 1024}K | {p['rows']} | "
            + " | ".join(us)
            + f" | {fl:.1f} | {r_t:.2f} | {r_g:.2f} | {ours / fl:.0f} |"
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
