"""Summarise an interleaved ucx-path run directory: p50s per run, medians, ratios to raw NIXL per request."""
import json, statistics, sys, os
d = sys.argv[1]
rows = {}
for side in ("base", "after"):
    for i in (1, 2, 3):
        j = json.load(open(f"{d}/{side}-{i}.json"))
        t = j["transports"]["ucx"]
        nx = [json.loads(l) for l in open(f"{d}/nixl-{side}-{i}/nixl_peer.jsonl")]
        raw = next(x for x in nx if x["name"] == "nixl_latency")["p50"]
        rows.setdefault(side, []).append((t["latency_64k"]["p50"], t["push_latency_64k"]["p50"], raw,
                                          t["latency_64k"]["verified"] and t["push_latency_64k"]["verified"],
                                          j["load_before"][0]))
out = []
for side, rs in rows.items():
    for i, (pl, ps, raw, ok, load) in enumerate(rs, 1):
        out.append(f"{side} run {i}: pull_blocks p50 {pl:.1f} us, push_blocks p50 {ps:.1f} us, raw NIXL per request "
                   f"p50 {raw:.1f} us -> pull {pl / raw:.2f}x, push {ps / raw:.2f}x (verified={ok}, load {load})")
    pl = statistics.median(r[0] for r in rs); ps = statistics.median(r[1] for r in rs)
    raw = statistics.median(r[2] for r in rs)
    rp = statistics.median(r[0] / r[2] for r in rs); rs_ = statistics.median(r[1] / r[2] for r in rs)
    out.append(f"{side} median of 3: pull {pl:.1f} us, push {ps:.1f} us, raw NIXL {raw:.1f} us; "
               f"median per-run ratio pull {rp:.2f}x, push {rs_:.2f}x; ratio of medians pull {pl / raw:.2f}x, "
               f"push {ps / raw:.2f}x")
print("\n".join(out))
