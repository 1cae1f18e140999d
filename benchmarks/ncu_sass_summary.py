"""Where each kernel's warps stall, per SASS instruction, from an Nsight Compute source-page CSV
(`ncu --page source --print-source sass --csv ...`, e.g. `step_device.sh sass`; `.xz` read as
is): per kernel the stall reasons summed over its instructions, then the instructions with the
most warp-stall samples, each with its two main reasons.

    python3 benchmarks/ncu_sass_summary.py NCU_SASS.csv[.xz] [TOP]
"""

from __future__ import annotations

import collections
import csv
import io
import lzma
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: str) -> tuple[list[str], dict[str, list[dict[str, str]]]]:
    """The CSV's column names and, per kernel (in order), one dict per SASS instruction."""
    raw = lzma.open(path, "rt") if path.endswith(".xz") else open(path)
    with raw as f:
        text = f.read()
    data: dict[str, list[dict[str, str]]] = {}
    header: list[str] = []
    kern = None
    for r in csv.reader(io.StringIO(text)):
        if len(r) >= 2 and r[0] == "Kernel Name":
            kern = r[1].split("(")[0].rsplit("::", 1)[-1]
            data[kern] = []
        elif r and r[0] == "Address":
            header = r
        elif kern is not None and header and len(r) == len(header):
            data[kern].append(dict(zip(header, r, strict=True)))
    return header, data


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    header, data = kernels(path)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    for kern, ins in data.items():
        total = sum(int(i[SAMPLES] or 0) for i in ins)
        print(f"== {kern}: {len(ins)} instructions, {total} warp-stall samples")
        by = collections.Counter()
        for i in ins:
            for h in reasons:
                by[h[6:]] += int(i[h] or 0)
        print("   by reason:", ", ".join(f"{k} {v}" for k, v in by.most_common(7)))
        ranked = sorted(range(len(ins)), key=lambda j: -int(ins[j][SAMPLES] or 0))[:top]
        for j in sorted(ranked):
            i = ins[j]
            main2 = sorted(((int(i[h] or 0), h[6:]) for h in reasons), reverse=True)[:2]
            why = ", ".join(f"{name} {n}" for n, name in main2 if n)
            print(
                f"  #{j:<5} {i[SAMPLES]:>6}  {i['Source'].strip()[:56]:56s} "
                f"x{i['Instructions Executed']:>6}  {why}"
            )


if __name__ == "__main__":
    main()
