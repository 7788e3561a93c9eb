"""The tcp+tls row against plain tcp, per run of ``llmdd bench --quick --transport tcp --transport tcp+tls``:
every workload's tcp+tls / tcp ratio of the same run (bandwidth: < 1 is slower; latency: > 1 is slower),
and the median over the runs given.  Usage: python tls_ratios.py quick_tls_1.json [...]"""

from __future__ import annotations

import json
import statistics
import sys

ROWS = [("pull_blocks_64k", "bw", "pull_blocks 64 KiB blocks"), ("push_blocks_64k", "bw", "push_blocks 64 KiB blocks"),
        ("pull_blocks_16k", "bw", "pull_blocks 16 KiB blocks"), ("push_blocks_16k", "bw", "push_blocks 16 KiB blocks"),
        ("transfer_cache_async_64k", "bw", "transfer_cache_async, 64 KiB layout"),
        ("pull_cache", "bw", "pull_cache contiguous"), ("latency_64k", "lat", "one 64 KiB block, p50")]


def value(fig: dict, kind: str) -> float:
    return fig["p50"] if kind == "lat" else fig["median"]


def main(paths: list) -> None:
    runs = [json.load(open(p)) for p in paths]
    for p, r in zip(paths, runs):
        t = r["transports"]
        assert t["tcp+tls"]["link"]["data_tls"] is True and t["tcp"]["link"]["data_tls"] is False, p
        assert all(t[n][f]["verified"] for n in ("tcp", "tcp+tls") for f, _, _ in ROWS), p
    head = " | ".join(f"run {i + 1} tcp / tcp+tls / ratio" for i in range(len(runs)))
    print(f"| workload | {head} | median ratio |")
    print("|---|" + "---|" * (len(runs) + 1))
    for fig, kind, label in ROWS:
        unit = "us" if kind == "lat" else "GB/s"
        cells, ratios = [], []
        for r in runs:
            a, b = value(r["transports"]["tcp"][fig], kind), value(r["transports"]["tcp+tls"][fig], kind)
            ratios.append(b / a)
            cells.append(f"{a:.{1 if kind == 'lat' else 2}f} / {b:.{1 if kind == 'lat' else 2}f} {unit} / {b / a:.2f}x")
        print(f"| {label} | " + " | ".join(cells) + f" | {statistics.median(ratios):.2f}x |")
    for i, r in enumerate(runs):
        m = r["meta"]
        print(f"\nrun {i + 1}: started {m['started_utc']}, load average before {m['load_before']}, "
              f"after {m['load_after']}, {m['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
