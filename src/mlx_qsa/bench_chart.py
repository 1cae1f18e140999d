"""PNG charts of `mlx-qsa bench` JSON documents (matplotlib, imported only when asked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_chart(doc: dict[str, Any], path: Path) -> None:
    """Decode: µs per step against context, one panel per row count, log scales, the floor
    dashed. Prefill: ms per chunk against the prefix. Prompt: ms per prompt against its length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"bench --png needs matplotlib ({e}); pip install matplotlib") from None
    points = doc["points"]
    device = doc.get("device_name") or doc["backend"]
    title = f"mlx-qsa bench {doc['bench']} — {device}, {doc['date'][:10]}"
    if doc["bench"] == "decode" and "context" in points[0] and "timings" in points[0]:
        rows = sorted({p["rows"] for p in points})
        fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 4), squeeze=False)
        for ax, r in zip(axes[0], rows, strict=True):
            pts = sorted((p for p in points if p["rows"] == r), key=lambda p: p["context"])
            ctx = [p["context"] for p in pts]
            names = [k for k in pts[0]["timings"] if not k.endswith("_async")]
            for name in names:
                ax.plot(ctx, [p["timings"][name]["median_us"] for p in pts], marker="o", label=name)
            ax.plot(ctx, [p["floor"]["us"] for p in pts], "k--", label="bandwidth floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("µs per step (median)")
            ax.set_title(f"{r} row{'s' if r > 1 else ''}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(6, 4))
        key = "prompt" if doc["bench"] == "prompt" else "prefix"
        pts = sorted(points, key=lambda p: p.get(key, p.get("context", 0)))
        ctx = [p.get(key, p.get("context")) for p in pts]
        for name in pts[0]["timings"]:
            ax.plot(
                ctx, [p["timings"][name]["median_us"] / 1e3 for p in pts], marker="o", label=name
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if key == "prompt":
            ax.set_xlabel("prompt (tokens)")
            ax.set_ylabel("ms per prompt, one layer (median)")
        else:
            ax.set_xlabel("prefix (tokens)")
            ax.set_ylabel("ms per 2048-row chunk (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
