"""Per-kernel time of an Nsight Compute CSV (`--csv --metrics gpu__time_duration.sum`) whose
launches split into equal parts (the contexts of benchmarks/layer_profile.py, or the
configurations of benchmarks/gemm_profile.py, in order).

    python3 benchmarks/ncu_summary.py NCU.csv [PARTS] [--skip N]

--skip N leaves out the first N launches of each part: gemm_profile.py's warm-up call, which
took 1.5x the later calls' time while the GEMM's tensor maps lived in managed memory (its first
read of them waited for the page), and is a warm-up in any case.
"""

from __future__ import annotations

import collections
import csv
import sys

_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def metric_rows(path: str, metric: str) -> list[tuple[str, float, str]]:
    """(kernel, value, unit) of every launch for one metric of an ncu CSV."""
    with open(path) as f:
        rows = [r for r in csv.reader(f) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    ki, ni, vi, ui = (
        header.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit")
    )
    out = []
    for r in rows:
        if r[ni] != metric:
            continue
        try:
            v = float(r[vi].replace(",", ""))
        except ValueError:
            continue
        out.append((r[ki][:90], v, r[ui]))
    return out


def durations(path: str) -> list[tuple[str, float]]:
    return [(k, v * _TO_US.get(u, 1.0)) for k, v, u in metric_rows(path, "gpu__time_duration.sum")]


def main() -> None:
    args = sys.argv[1:]
    skip = 0
    if "--skip" in args:
        i = args.index("--skip")
        skip = int(args[i + 1])
        del args[i : i + 2]
    vals = durations(args[0])
    parts = int(args[1]) if len(args) > 1 else 2
    # with sm__cycles_elapsed.* in the CSV: each kernel's mean SM clock and its time at 1.98 GHz
    clocks = metric_rows(args[0], "sm__cycles_elapsed.avg.per_second")
    cycles = metric_rows(args[0], "sm__cycles_elapsed.max")
    size = len(vals) // parts
    print("kernels", len(vals), f"(first {skip} of each part left out)" if skip else "")
    for p in range(parts):
        part = vals[p * size + skip : (p + 1) * size]
        print(f"== part {p}: {len(part)} kernels, {sum(v for _, v in part):.1f} us")
        agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
        for i, (k, v) in enumerate(part):
            agg[k][0] += 1
            agg[k][1] += v
            j = p * size + skip + i
            if j < len(clocks) and j < len(cycles):
                hz = clocks[j][1] * {"hz": 1, "khz": 1e3, "mhz": 1e6, "ghz": 1e9}.get(
                    clocks[j][2].lower(), 1
                )
                agg[k][2] += hz / 1e9
                agg[k][3] += cycles[j][1] / 1980.0  # us at 1.98 GHz
        for k, (c, v, ghz, at_boost) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]:
            extra = f"  {ghz / c:4.2f} GHz, {at_boost / c:6.1f} us at 1.98 GHz" if ghz else ""
            print(f"  {v:9.1f} us  x{c:3d}{extra}  {k}")


if __name__ == "__main__":
    main()
