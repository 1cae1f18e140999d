"""Markdown tables of `mlx-qsa bench` JSON documents (for BENCHMARKS.md).

Usage: python3 benchmarks/summarize.py decode.json [prefill.json] [prompt.json]
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
        ("qsa_cuda_gpu", "CUDA, GPU clock"),
        ("qsa_cuda_spin", "CUDA, spin wait"),
        ("qsa_portable", "portable"),
        ("mlx_gather_sdpa", "MLX gather+SDPA"),
        ("mlx_dense_sdpa", "MLX dense SDPA"),
        ("torch_dense_sdpa_sync", "torch dense SDPA"),
        ("torch_dense_sdpa", "torch, queued"),
        ("qsa_cuda_layer", "CUDA layer"),
        ("mlx_one_kernel_gpu", "MLX one-kernel step, GPU clock"),
    ]
    head = "| context | rows | " + " | ".join(c[1] for c in cols) + " | floor |"
    head += " torch ÷ CUDA | queued: torch ÷ CUDA | GPU clock: torch ÷ CUDA |"
    head += " GPU clock: torch ÷ MLX one-kernel step |"
    head += " spin wait: torch ÷ CUDA | gather+SDPA ÷ CUDA | CUDA ÷ floor |"
    lines = [head, "|" + "---|" * (len(cols) + 10)]
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
            + f"{_ratio(t, 'torch_dense_sdpa', 'qsa_cuda_gpu')} | "
            + f"{_ratio(t, 'torch_dense_sdpa', 'mlx_one_kernel_gpu')} | "
            + f"{_ratio(t, 'torch_dense_sdpa_sync', 'qsa_cuda_spin')} | "
            + f"{_ratio(t, 'mlx_gather_sdpa', 'qsa_cuda')} | {ours / fl:.0f} |"
        )
    return "\n".join(lines)


def prefill_table(doc: dict) -> str:
    """One row per prefix, ms. Ratios compare like with like: our `_gpu` entries (queued passes
    on the GPU's clock, documents from 2026-12-07 on) against torch's CUDA events, our
    `mx.eval`-per-step entries and its `_spin` one (a step at a time, waited for by
    `mx.synchronize`, which spins in `cudaStreamSynchronize` but then still waits on MLX's worker
    thread: benchmarks/results/spin_2026-12-07) against torch's
    synchronize-per-step wall clock (`torch_dense_causal_sdpa_sync`, from the same date); –
    where a document lacks an entry."""
    cols = [
        ("qsa_cuda_selection_attention", "CUDA sel + attn"),
        ("qsa_cuda_selection_attention_gpu", "CUDA sel + attn, GPU clock"),
        ("qsa_cuda_selection_attention_spin", "CUDA sel + attn, spin wait"),
        ("qsa_cuda_layer", "CUDA layer"),
        ("qsa_cuda_layer_gpu", "CUDA layer, GPU clock"),
        ("qsa_portable_layer", "portable layer"),
        ("torch_dense_causal_sdpa", "torch dense causal (events)"),
        ("torch_dense_causal_sdpa_sync", "torch, synchronized"),
    ]
    head = "| prefix | rows | " + " | ".join(c[1] for c in cols)
    head += " | torch ÷ sel + attn (GPU clock / eval / spin wait)"
    head += " | torch ÷ layer (GPU clock / eval) |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for p in doc["points"]:
        t = p["timings"]
        ms = [f"{t[c]['median_us'] / 1e3:.2f}" if c in t else "–" for c, _ in cols]
        ev, sy = cols[6][0], cols[7][0]
        sel = " / ".join(_ratio(t, peer, cols[i][0]) for peer, i in ((ev, 1), (sy, 0), (sy, 2)))
        lay = f"{_ratio(t, ev, cols[4][0])} / {_ratio(t, sy, cols[3][0])}"
        lines.append(
            f"| {p['prefix'] // 1024}K | {p['rows']} | " + " | ".join(ms) + f" | {sel} | {lay} |"
        )
    if any("qsa_cuda_layer_large" in p["timings"] for p in doc["points"]):
        lines += ["", large_table(doc)]
    return "\n".join(lines)


def _lane_cols(entry: str, ours: str, torch: str) -> list[tuple[str, str]]:
    """The columns of a defaults-against-large-lane table: our `entry` with the library
    defaults and with the large-prefill lane (`_large`), each on the GPU clock and with an
    eval, then torch's dense causal SDPA (labelled `torch`)."""
    return [
        (f"{entry}_gpu", f"{ours}defaults, GPU clock"),
        (f"{entry}_large_gpu", f"{ours}large lane, GPU clock"),
        (entry, "defaults, eval"),
        (f"{entry}_large", "large lane, eval"),
        ("torch_dense_causal_sdpa", torch),
    ]


_LANE_HEAD = " | defaults ÷ large lane (GPU clock / eval) | torch ÷ large lane (GPU clock) |"


def _side_by_side(t: dict, cols: list[tuple[str, str]]) -> str:
    """A row's cells from the ms of `cols` (`_lane_cols`) on: the times, the defaults ÷ large
    lane ratios (GPU clock / eval) and torch ÷ large lane (GPU clock)."""
    ms = [f"{t[c]['median_us'] / 1e3:.2f}" if c in t else "–" for c, _ in cols]
    gain = f"{_ratio(t, cols[0][0], cols[1][0])} / {_ratio(t, cols[2][0], cols[3][0])}"
    return " | ".join(ms) + f" | {gain} | {_ratio(t, cols[4][0], cols[1][0])} |"


def _route(entry: dict) -> str:
    """An entry's selector and consumers, as the bench recorded them."""
    return f"{entry.get('selector', '?')} + {'/'.join(entry.get('consumers', []))}"


def large_table(doc: dict) -> str:
    """The layer with the library defaults against the layer with the large-prefill lane and
    `prefill_flash` from `large_from` on (`bench prefill --large-from`), ms, the routes each
    took, and torch's dense causal SDPA over the same context."""
    cols = _lane_cols("qsa_cuda_layer", "CUDA layer, ", "torch dense causal (events)")
    head = "| prefix | routes (defaults → large lane) | " + " | ".join(c[1] for c in cols)
    lines = [head + _LANE_HEAD, "|" + "---|" * (len(cols) + 4)]
    for p in doc["points"]:
        t = p["timings"]
        if "qsa_cuda_layer_large" not in t:
            continue
        lines.append(
            f"| {p['prefix'] // 1024}K | {_route(t['qsa_cuda_layer'])} → "
            f"{_route(t['qsa_cuda_layer_large'])} | " + _side_by_side(t, cols)
        )
    return "\n".join(lines)


def _routes(entry: dict) -> str:
    """A prompt entry's chunk routes, counted: "4 × oracle + sdpa, 12 × compiled + ..."."""
    counts: dict[str, int] = {}
    for r in entry.get("routes", []):
        name = f"{r[0]} + {'/'.join(r[1:])}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} × {name}" for name, n in counts.items())


def prompt_table(doc: dict) -> str:
    """`bench prompt`: a whole prompt through one layer, ms, with the library defaults and the
    large-prefill lane, against torch's dense causal SDPA over the whole prompt in one call."""
    cols = _lane_cols("qsa_cuda_prompt", "CUDA, ", "torch dense causal, one call (events)")
    head = "| prompt | chunks | routes (defaults; large lane) | " + " | ".join(c[1] for c in cols)
    lines = [head + _LANE_HEAD, "|" + "---|" * (len(cols) + 5)]
    for p in doc["points"]:
        t = p["timings"]
        routes = "; ".join(_routes(t[c]) for c in (cols[2][0], cols[3][0]) if c in t)
        lines.append(
            f"| {p['prompt'] // 1024}K | {len(p['chunks'])} | {routes} | " + _side_by_side(t, cols)
        )
    return "\n".join(lines)


def main() -> None:
    tables = {"decode": decode_table, "prefill": prefill_table, "prompt": prompt_table}
    for path in sys.argv[1:]:
        doc = json.load(open(path))
        switches = "".join(f", {k}={v}" for k, v in doc.get("switches", {}).items())
        print(f"{path}: {doc['device_name']}, {doc['date']}, `{doc['command']}`{switches}\n")
        print(tables[doc["bench"]](doc))
        print()


if __name__ == "__main__":
    main()
