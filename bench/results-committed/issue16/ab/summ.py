"""Medians of the interleaved issue-16 A/B (run.sh): the latency-path JSONs (`lat_*`: --n 500 with the tcp
bulk rows, run by run.sh; `lat2_*`: --n 2000, shm and tcp one-block only, the command in README.md).
The quick benches' ratios are in quick_{before,after}_report.md (llmdd bench --report ... --markdown).

usage: python summ.py [lat|lat2]"""
import json
import pathlib
import statistics
import sys

here = pathlib.Path(__file__).parent
prefix = sys.argv[1] if len(sys.argv) > 1 else "lat"
print(f"| tree ({prefix}) | shm one-block p50 (us) | tcp one-block p50 (us) | tcp p50 / raw req-reply | tcp bulk / raw 2 streams |")
print("|---|---|---|---|---|")
for tree in ("before", "after"):
    runs = [json.loads((here / f"{prefix}_{tree}_{i}.json").read_text()) for i in (1, 2, 3)]
    shm = [r["transports"]["shm"]["latency_64k"]["p50"] for r in runs]
    tcp = [r["transports"]["tcp"]["latency_64k"]["p50"] for r in runs]
    tcp_rr = [t / r["anchors"]["tcp_rr_64k"]["p50"] for t, r in zip(tcp, runs)]
    bulk = [r["transports"]["tcp"]["pull_blocks_64k"]["median"] / r["anchors"]["tcp_2stream"]["median"]
            for r in runs if "pull_blocks_64k" in r["transports"]["tcp"]]
    f = lambda xs, fmt: f"{fmt.format(statistics.median(xs))} ({', '.join(fmt.format(x) for x in xs)})" if xs else "-"
    print(f"| {tree} | {f(shm, '{:.1f}')} | {f(tcp, '{:.1f}')} | {f(tcp_rr, '{:.2f}x')} | {f(bulk, '{:.2f}x')} |")
