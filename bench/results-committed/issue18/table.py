"""Print the markdown table of the C++ row runs in this directory (cpp_row_*.json).

Usage: python bench/results-committed/issue18/table.py
Every figure and every verdict is computed from the JSON files the row wrote
(`python -m llmdd._bench.cpp row --out FILE 3`); nothing here is typed in.
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
LAT_MAX, BW_MIN, RSS_MAX = 1.2, 0.9, 30.0  # the row's targets (llmdd/_bench/cpp.py)


def load_runs(directory: str = HERE) -> list:
    paths = glob.glob(os.path.join(directory, "cpp_row_*.json"))
    paths.sort(key=lambda p: int(re.search(r"cpp_row_(\d+)\.json$", p).group(1)))
    return [(os.path.basename(p), json.load(open(p))) for p in paths]


def _verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def markdown(runs: list) -> list:
    rows = []
    for name, r in runs:
        rows.append({
            "name": name, "utc": r["utc_start"][11:19], "cpp": r["cpp"]["p50_us"], "py": r["python"]["p50_us"],
            "lat": r["latency_ratio"], "cbw": r["cpp"]["gbps"], "pbw": r["python"]["gbps"],
            "bw": r["bandwidth_ratio"], "rss": r["rss_delta_bytes"] / MiB,
            "load": f"{r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}",
        })
    med = {k: statistics.median(x[k] for x in rows) for k in ("cpp", "py", "lat", "cbw", "pbw", "bw", "rss")}
    n = len(rows)
    lat_ok = sum(x["lat"] <= LAT_MAX for x in rows)
    bw_ok = sum(x["bw"] >= BW_MIN for x in rows)
    rss_ok = sum(x["rss"] <= RSS_MAX for x in rows)
    out = [
        "| run (UTC start) | C++ p50 | Python p50 | latency ratio | bandwidth C++ / Python | bandwidth ratio "
        "| RSS delta | load (1-min, before -> after) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for x in rows:
        out.append(f"| `{x['name']}` ({x['utc']}) | {x['cpp']:.1f} us | {x['py']:.1f} us | {x['lat']:.2f}x "
                   f"| {x['cbw']:.1f} / {x['pbw']:.1f} GB/s | {x['bw']:.2f}x | {x['rss']:+.1f} MiB | {x['load']} |")
    out.append(f"| median of {n} | {med['cpp']:.1f} us | {med['py']:.1f} us | {med['lat']:.2f}x "
               f"| {med['cbw']:.1f} / {med['pbw']:.1f} GB/s | {med['bw']:.2f}x | {med['rss']:+.1f} MiB | |")
    out.append(f"| target | | | <= {LAT_MAX}x | | >= {BW_MIN}x | <= +{RSS_MAX:.0f} MiB | |")
    out.append(f"| verdict (median) | | | {_verdict(med['lat'] <= LAT_MAX)} ({lat_ok}/{n} runs) "
               f"| | {_verdict(med['bw'] >= BW_MIN)} ({bw_ok}/{n} runs) "
               f"| {_verdict(med['rss'] <= RSS_MAX)} ({rss_ok}/{n} runs) | |")
    verified = all(r["verified"] for _, r in runs)
    heads = sorted({r["git_head"][:7] for _, r in runs})
    out.append("")
    for side, label in (("cpp", "C++"), ("python", "Python")):
        rounds = [x["p50_us"] for _, r in runs for x in r["runs"][side]]
        high = sum(v > 20 for v in rounds)
        call = statistics.median(r[side]["call_p50_us"] for _, r in runs)
        out.append(f"- {label}: one-block p50 per round {min(rounds):.1f}-{max(rounds):.1f} us, {high} of "
                   f"{len(rounds)} rounds above 20 us; a call that moves nothing (unregister an unknown id) "
                   f"p50 {call:.1f} us (median of the runs).")
    if all("orders" in r for _, r in runs):  # runs that record which side ran first in each round
        parts = []
        for side, label in (("cpp", "C++"), ("python", "Python")):
            first = [x["p50_us"] for _, r in runs for x, o in zip(r["runs"][side], r["orders"]) if o[0] == side]
            second = [x["p50_us"] for _, r in runs for x, o in zip(r["runs"][side], r["orders"]) if o[0] != side]
            parts.append(f"{label} rounds above 20 us: {sum(v > 20 for v in first)} of {len(first)} when it ran "
                         f"first, {sum(v > 20 for v in second)} of {len(second)} when it ran second")
        out.append(f"- Order (C++ first in odd rounds, Python first in even ones, as each run records): "
                   f"{'; '.join(parts)}.")
    out.append("")
    out.append("Ratios in the median row are the medians of the per-run ratios. "
               f"Bytes verified in every round of every run: {'yes' if verified else 'NO'}; "
               f"commit {', '.join(heads)}; {runs[0][1]['rounds']} interleaved rounds per run "
               f"(each figure the median of its rounds); {runs[0][1]['cpus']} CPUs.")
    return out


if __name__ == "__main__":
    print("\n".join(markdown(load_runs())))
