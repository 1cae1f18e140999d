"""Per-kernel time of an Nsight Compute CSV (`--csv --metrics gpu__time_duration.sum`) whose
launches split into equal parts (the contexts of benchmarks/layer_profile.py, in order).

    python3 benchmarks/ncu_summary.py NCU.csv [PARTS]
"""

from __future__ import annotations

import collections
import csv
import sys

_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def durations(path: str) -> list[tuple[str, float]]:
    with open(path) as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    ki, vi, ui = (header.index(c) for c in ("Kernel Name", "Metric Value", "Metric Unit"))
    out = []
    for r in rows:
        try:
            v = float(r[vi].replace(",", ""))
        except ValueError:
            continue
        out.append((r[ki][:90], v * _TO_US.get(r[ui], 1.0)))
    return out


def main() -> None:
    vals = durations(sys.argv[1])
    parts = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    size = len(vals) // parts
    print("kernels", len(vals))
    for p in range(parts):
        part = vals[p * size : (p + 1) * size]
        print(f"== part {p}: {len(part)} kernels, {sum(v for _, v in part):.1f} us")
        agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for k, v in part:
            agg[k][0] += 1
            agg[k][1] += v
        for k, (c, v) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"  {v:9.1f} us  x{c:3d}  {k}")


if __name__ == "__main__":
    main()
