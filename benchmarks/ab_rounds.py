"""Summary of an interleaved A/B log (`step_device.sh layerab8`): lines
`ROUND TREE T=... build B us, eval E us, step S us, ...`, one per tree and round. Prints each
tree's median of build / eval / step and, per round, new minus old (the host's speed drifts
over a call, so differences within a round are what compare like with like).

    python3 benchmarks/ab_rounds.py layerab8.log [OLD NEW]

OLD and NEW name the two trees (default: `.old/src` and `src`, else the two in sorted order).
"""

from __future__ import annotations

import re
import statistics
import sys

LINE = re.compile(
    r"^(\d+) (\S+) T=\d+ rows=\d+ \S+ build ([\d.]+) us, eval ([\d.]+) us, step ([\d.]+) us"
)


def main() -> None:
    rounds: dict[str, dict[str, tuple[float, float, float]]] = {}
    for line in open(sys.argv[1]):
        m = LINE.match(line)
        if m:
            rounds.setdefault(m.group(1), {})[m.group(2)] = tuple(float(v) for v in m.groups()[2:])
    trees = sorted({t for r in rounds.values() for t in r})
    for tree in trees:
        rows = [r[tree] for r in rounds.values() if tree in r]
        med = [statistics.median(v[i] for v in rows) for i in range(3)]
        print(f"{tree}: {len(rows)} rounds, median build {med[0]:.0f} / eval {med[1]:.0f} / "
              f"step {med[2]:.0f} us")  # fmt: skip
    if len(trees) == 2:
        if len(sys.argv) == 4:
            old, new = sys.argv[2], sys.argv[3]
        else:
            old, new = (".old/src", "src") if ".old/src" in trees else trees
        diffs = [r[new][2] - r[old][2] for r in rounds.values() if old in r and new in r]
        if diffs:
            print(f"step {new} - {old} per round (us): {', '.join(f'{d:+.0f}' for d in diffs)}; "
                  f"median {statistics.median(diffs):+.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
