"""Print the issue-20 time-to-first-token tables (markdown) from committed runs of scripts/bench_vllm_ttft.py.

    python scripts/vllm_ttft_table.py bench/results-committed/issue20/ttft-*.json

docs/vllm.md's tables are this script's output, between its generated markers (a test checks it)."""

from __future__ import annotations

import json
import statistics
import sys

SLOW_S = 0.5      # a local 100-token prompt's TTFT is ~70 ms, or ~1 s with the wait described in docs/vllm.md


def _ms(xs: list) -> str:
    return f"{1000 * statistics.median(xs):.0f}"


def _mm(xs: list) -> str:
    """median (min) in ms"""
    return f"{_ms(xs)} ({1000 * min(xs):.0f})"


def _run(path: str, run: dict) -> list:
    m, rows, ov = run["model"], run["rows"], run["overhead"]
    head = (f"`{path}`: `{run['command']}`; {m['layers']} layers, hidden {m['hidden']}, "
            f"{m['kv_heads']} KV heads x {m['hidden'] // m['heads']}, {m['dtype']}, block {m['block_size']}; ")
    if run["transports"]:
        head += f"transport {', '.join(sorted(set(run['transports'].values())))}; "
    if rows:
        head += f"{max(r['rep'] for r in rows) + 1} interleaved repetitions, ms: median (min); "
    head += (f"load {run['machine']['loadavg_start'][0]:.1f} -> {run['machine']['loadavg_end'][0]:.1f} "
             f"on {run['machine']['cpus']} CPUs")
    out = [head]
    if rows:
        out += ["", "| prompt tokens | KV MiB | decode TTFT, recompute | decode TTFT, transfer | speed-up of medians "
                "| pull (connector) | TTFT minus pull | prefill instance TTFT | first token equal |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for n in sorted({r["prompt_tokens"] for r in rows}):
            rs = [r for r in rows if r["prompt_tokens"] == n]
            rc = statistics.median(r["recompute_ttft_s"] for r in rs)
            tr = statistics.median(r["transfer_ttft_s"] for r in rs)
            out.append(f"| {n} | {rs[0]['bytes_pulled'] / 2**20:.1f} | {_mm([r['recompute_ttft_s'] for r in rs])} "
                       f"| {_mm([r['transfer_ttft_s'] for r in rs])} | {rc / tr:.1f}x | {_mm([r['pull_s'] for r in rs])} "
                       f"| {_mm([r['transfer_ttft_s'] - r['pull_s'] for r in rs])} "
                       f"| {_mm([r['prefill_instance_ttft_s'] for r in rs])} "
                       f"| {sum(r['same_first_token'] for r in rs)}/{len(rs)} |")
    if ov:
        a = [r["with_connector_ttft_s"] for r in ov]
        b = [r["without_connector_ttft_s"] for r in ov]
        out += ["", f"A {ov[0]['prompt_tokens']}-token prompt computed locally ({len(ov)} repetitions): "
                f"TTFT median (min) {_mm(a)} ms on the decode instance (connector loaded), {_mm(b)} ms on an "
                f"instance without a connector; at or above {1000 * SLOW_S:.0f} ms: {sum(x >= SLOW_S for x in a)} "
                f"and {sum(x >= SLOW_S for x in b)} of {len(ov)}."]
    return out


def table(paths: list) -> list:
    out: list = []
    for path in paths:
        with open(path) as f:
            out += ([""] if out else []) + _run(path, json.load(f))
    return out


if __name__ == "__main__":
    print("\n".join(table(sys.argv[1:])))
