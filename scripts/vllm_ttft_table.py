"""Print the time-to-first-token tables (markdown) from committed runs of scripts/bench_vllm_ttft.py
(issue 20; issue 39 runs add the pull's speed against ``llmdd bench`` and its breakdown).

    python scripts/vllm_ttft_table.py bench/results-committed/issue20/ttft-*.json

docs/vllm.md's tables are this script's output, between its generated markers (a test checks it)."""

from __future__ import annotations

import json
import statistics
import sys

SLOW_S = 0.5      # a local 100-token prompt's TTFT is ~70 ms, or ~1 s with the wait described in docs/vllm.md
#: the breakdown's phases (llmdd_vllm.worker.PHASES; not imported: this script needs no vLLM)
PHASES = ("to_worker_s", "queue_s", "plan_s", "link_s", "submit_s", "transfer_s", "report_s", "total_s")


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
    engine = run.get("engine_bench") or {}
    if rows and all(r.get("pull_breakdown") for r in rows):
        out += _speed(rows, engine)
    if ov:
        a = [r["with_connector_ttft_s"] for r in ov]
        b = [r["without_connector_ttft_s"] for r in ov]
        out += ["", f"A {ov[0]['prompt_tokens']}-token prompt computed locally ({len(ov)} repetitions): "
                f"TTFT median (min) {_mm(a)} ms on the decode instance (connector loaded), {_mm(b)} ms on an "
                f"instance without a connector; at or above {1000 * SLOW_S:.0f} ms: {sum(x >= SLOW_S for x in a)} "
                f"and {sum(x >= SLOW_S for x in b)} of {len(ov)}."]
        if "engine_bench" in run:
            out[-1] += (f" Ratio of the medians (connector loaded / without): "
                        f"{statistics.median(a) / statistics.median(b):.2f}; of the minimums: {min(a) / min(b):.2f}.")
    hooks = run.get("step_hooks") or {}
    if hooks.get("step_hook_calls"):
        out += ["", f"The connector's worker-side step hooks (`start_load_kv`, `get_finished`) on the decode instance "
                f"over the whole run: {hooks['step_hook_calls']} calls, {1e6 * hooks['step_hook_seconds'] / hooks['step_hook_calls']:.0f} us "
                f"each on average, the longest {1e3 * hooks['max_step_hook_s']:.2f} ms."]
    return out


def _speed(rows: list, engine: dict) -> list:
    """The pull's GB/s against llmdd bench's (same session), and the pull's breakdown, per prompt length."""
    ref = [engine[k]["pull_blocks_64k"]["median_gbps"] for k in ("before", "after") if k in engine]
    out = [""]
    if ref:
        out.append("`llmdd bench --quick --transport shm` in the same session, pull_blocks 64 KiB x 64 tensors: "
                   + ", ".join(f"{k} {engine[k]['pull_blocks_64k']['median_gbps']:.2f} GB/s" for k in ("before", "after")
                               if k in engine)
                   + f" (median of the two, the reference: {statistics.median(ref):.2f} GB/s).")
        out.append("")
    ref_gbps = statistics.median(ref) if ref else None
    head = ["prompt tokens", "KV MiB", "pull GB/s (transfer phase)"] + (["vs llmdd bench"] if ref_gbps else [])
    head += [p[:-2].replace("_", " ") + " ms" for p in PHASES]
    out += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in sorted({r["prompt_tokens"] for r in rows}):
        bd = [r["pull_breakdown"] for r in rows if r["prompt_tokens"] == n]
        gbps = statistics.median(b["bytes"] / b["transfer_s"] / 1e9 for b in bd)
        cells = [str(n), f"{bd[0]['bytes'] / 2**20:.1f}", f"{gbps:.2f}"]
        if ref_gbps:
            cells.append(f"{gbps / ref_gbps:.2f}x")
        cells += [_mm([b[p] for b in bd]) for p in PHASES]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Phases (median (min) ms): to worker = the scheduler made the job -> the worker's step hook queued "
            "it; queue -> the pull thread took it; plan; link = the link check; submit = `pull_blocks_async` "
            "returned; transfer -> llmdd's callback (bytes here, read tag acknowledged by the owner); report -> "
            "vLLM collected it (`get_finished`); total = to worker .. report. Pull GB/s: bytes / transfer phase."]
    return out


def table(paths: list) -> list:
    out: list = []
    for path in paths:
        with open(path) as f:
            out += ([""] if out else []) + _run(path, json.load(f))
    return out


if __name__ == "__main__":
    print("\n".join(table(sys.argv[1:])))
