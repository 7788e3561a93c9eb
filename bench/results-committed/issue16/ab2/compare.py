"""Issue 16 point 7: before (4373b8f) vs after (dc995d3), from the committed runs of this directory.

Bandwidth rows: the median over a tree's runs of each run's same-run ratio to the primary anchor
(llmdd / anchor, higher is better); the one-block latency: llmdd p50 / anchor p50 (lower is better).
The verdict per row: "within 10%" when after is no more than 10% worse than before, else "worse".
Latency-path rows (bench/latency_path.py, lat_<tree>_<round>.json): tcp p50 / raw request-reply p50.

usage: python compare.py [quick|tcp|lat]   (quick: quick_*/, tcp: tcp_*/, lat: lat_*.json)"""
import json
import pathlib
import statistics
import sys

here = pathlib.Path(__file__).parent
kind = sys.argv[1] if len(sys.argv) > 1 else "quick"


def primary(run: dict) -> dict:
    out = {}
    for r in run["ratios"]:   # the first ratio listed per (transport, figure) is the primary anchor's
        out.setdefault((r["transport"], r["figure"]), (r["label"], r["kind"], r["ratio"], r["anchor"]))
    return out


if kind == "lat":
    trees = {"before": "4373b8f (before house I)", "r1": "4e43e41 (house I refactor, last session)",
             "s0": "51dbb05 (this session's start)", "after": "dc995d3 (after)"}
    print("| tree | runs | tcp one-block p50 (us) | tcp / raw req-reply p50 | shm one-block p50 (us) |")
    print("|---|---:|---:|---|---:|")
    for tree, name in trees.items():
        runs = [json.loads(p.read_text()) for p in sorted(here.glob(f"lat_{tree}_*.json"))]
        tcp = [r["transports"]["tcp"]["latency_64k"]["p50"] for r in runs]
        rr = [t / r["anchors"]["tcp_rr_64k"]["p50"] for t, r in zip(tcp, runs)]
        shm = [r["transports"]["shm"]["latency_64k"]["p50"] for r in runs]
        print(f"| {name} | {len(runs)} | {statistics.median(tcp):.1f} | {statistics.median(rr):.2f}x "
              f"({', '.join(f'{x:.2f}' for x in rr)}) | {statistics.median(shm):.1f} |")
    sys.exit(0)

prefix = "quick" if kind == "quick" else "tcp"
rows: dict = {}
for tree in ("before", "after"):
    for p in sorted(here.glob(f"{prefix}_{tree}_*/results.json")):
        for key, (label, k, ratio, anchor) in primary(json.loads(p.read_text())).items():
            rows.setdefault(key, {"label": label, "kind": k, "anchor": anchor, "before": [], "after": []})[tree].append(ratio)
print("| transport | workload | anchor | before (median, runs) | after (median, runs) | after / before | verdict |")
print("|---|---|---|---|---|---:|---|")
for (transport, _), row in rows.items():
    b, a = statistics.median(row["before"]), statistics.median(row["after"])
    change = a / b
    ok = change <= 1.10 if row["kind"] == "lat" else change >= 0.90
    print(f"| {transport} | {row['label']} | {row['anchor']} | {b:.2f}x ({len(row['before'])}) | {a:.2f}x ({len(row['after'])}) "
          f"| {change:.2f} | {'within 10%' if ok else 'worse'} |")
