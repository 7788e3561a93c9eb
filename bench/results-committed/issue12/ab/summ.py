"""Medians of the interleaved issue-12 A/B (run.sh): the latency-path JSONs; the quick benches' ratios are
in quick_{before,after}_report.md (llmdd bench --report quick_<tree>_{1,2,3}.json --markdown)."""
import json
import pathlib
import statistics

here = pathlib.Path(__file__).parent
rows = []
for tree in ("before", "after"):
    runs = [json.loads((here / f"lat_{tree}_{i}.json").read_text()) for i in (1, 2, 3)]
    shm = [r["transports"]["shm"]["latency_64k"]["p50"] for r in runs]
    tcp = [r["transports"]["tcp"]["latency_64k"]["p50"] for r in runs]
    tcp_rr = [t / r["anchors"]["tcp_rr_64k"]["p50"] for t, r in zip(tcp, runs)]
    bulk = [r["transports"]["tcp"]["pull_blocks_64k"]["median"] / r["anchors"]["tcp_2stream"]["median"]
            for r in runs]
    rows.append((tree, shm, tcp, tcp_rr, bulk))
print("| tree | shm one-block p50 (us) | tcp one-block p50 (us) | tcp p50 / raw req-reply | tcp bulk / raw 2 streams |")
print("|---|---|---|---|---|")
for tree, shm, tcp, rr, bulk in rows:
    f = lambda xs, fmt: f"{fmt.format(statistics.median(xs))} ({', '.join(fmt.format(x) for x in xs)})" if xs else "-"
    print(f"| {tree} | {f(shm, '{:.1f}')} | {f(tcp, '{:.1f}')} | {f(rr, '{:.2f}x')} | {f(bulk, '{:.2f}x')} |")
