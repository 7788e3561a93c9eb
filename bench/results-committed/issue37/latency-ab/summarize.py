"""Summarize the issue-37 latency A/B (run.sh): per transport and direction, the p50 of each run,
the median of the three runs per side, and B / A; the anchors and the load of each run.

    python bench/results-committed/issue37/latency-ab/summarize.py DIR > DIR/summary.md
    python bench/results-committed/issue37/latency-ab/summarize.py --pooled DIR DIR ...
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

ROWS = [(t, k, label) for t in ("shm", "tcp", "ucx")
        for k, label in (("latency_64k", "pull_blocks"), ("push_latency_64k", "push_blocks"))]


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    runs = {f"{s}{i}": json.loads((out / f"{s}{i}.json").read_text()) for s in "AB" for i in (1, 2, 3)
            if (out / f"{s}{i}.json").exists()}
    print("| transport | call (1 x 64 KiB) | A p50 per run (us) | B p50 per run (us) | A median | B median | B / A |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t, k, label in ROWS:
        a = [runs[f"A{i}"]["transports"][t][k]["p50"] for i in (1, 2, 3) if f"A{i}" in runs]
        b = [runs[f"B{i}"]["transports"][t][k]["p50"] for i in (1, 2, 3) if f"B{i}" in runs]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {t} | {label} | {', '.join(f'{x:.1f}' for x in a)} | {', '.join(f'{x:.1f}' for x in b)} "
              f"| {ma:.1f} | {mb:.1f} | {mb / ma:.3f} |")
    print()
    print("| run | load before (1, 5, 15 min) | load after | cma anchor p50 (us) | tcp req/reply anchor p50 (us) |")
    print("| --- | --- | --- | --- | --- |")
    for name in sorted(runs, key=lambda n: (n[1], n[0])):
        r = runs[name]
        lb = ", ".join(f"{x:.1f}" for x in r["load_before"])
        la = ", ".join(f"{x:.1f}" for x in r["load_after"])
        print(f"| {name} | {lb} | {la} | {r['anchors']['cma_latency_64k']['p50']:.1f} "
              f"| {r['anchors']['tcp_rr_64k']['p50']:.1f} |")




def pooled(dirs: list[str]) -> None:
    """The median of every run's p50 per side over several rounds (``--pooled DIR DIR ...``)."""
    print("| transport | call (1 x 64 KiB) | runs per side | A median p50 (us) | B median p50 (us) | B / A |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t, k, label in ROWS:
        a, b = [], []
        for d in dirs:
            for f in sorted(pathlib.Path(d).glob("[AB][123].json")):
                v = json.loads(f.read_text())["transports"][t][k]["p50"]
                (a if f.name[0] == "A" else b).append(v)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {t} | {label} | {len(a)} / {len(b)} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--pooled":
        pooled(sys.argv[2:])
    else:
        main()
