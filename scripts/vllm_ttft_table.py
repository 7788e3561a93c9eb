"""Print the time-to-first-token tables (markdown) from committed runs of scripts/bench_vllm_ttft.py
(issue 20; issue 39 runs add the pull's speed against ``llmdd bench`` and its breakdown).

    python scripts/vllm_ttft_table.py bench/results-committed/issue20/ttft-*.json

docs/vllm.md's tables are this script's output, between its generated markers (a test checks it).
With ``--nixl``: the issue-39 LlmddConnector-vs-NixlConnector tables, with their verdicts, from runs of
scripts/bench_vllm_vs_nixl.py, docs/benchmarks.md's section "vLLM: LlmddConnector vs NixlConnector"::

    python scripts/vllm_ttft_table.py --nixl bench/results-committed/issue39/nixl/run-*.json [--write docs/benchmarks.md]

``--write FILE`` replaces the block under the generated marker naming this very command in FILE."""

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


# issue 39 (8): LlmddConnector / NixlConnector ratios of medians, and their targets
TTFT_MAX = 1.0          # decode TTFT at every prompt length
TTFT_MAX_LONG = 0.8     # ... and from LONG tokens up
LONG = 2048
MIXED_MIN = 1.1         # output tokens/s of the mixed load through the P/D proxy
LOCAL_MAX = 1.05        # a local request's TTFT with the connector loaded / without
MIN_REPS = 16           # the repetitions for a verdict
NOISY = 2.0             # a 1-minute load average above this many per CPU: every process mostly waits for a core


def _verdict(ok: bool, n: int, noisy: bool = False) -> str:
    v = "met" if ok else "**NOT met**"
    why = ([f"{n} < {MIN_REPS} repetitions"] if n < MIN_REPS else []) + (["load above 2 per CPU"] if noisy else [])
    return f"{v} (indicative: {'; '.join(why)})" if why else v


def _noisy(run: dict, ph: dict, rows: list) -> bool:
    loads = [ph["loadavg_start"][0], ph["loadavg_end"][0]] if ph else [r["loadavg"][0] for r in rows]
    return max(loads) > NOISY * run["machine"]["cpus"]


def _load(ph: dict, rows: list) -> str:
    """the phase's 1-minute load average at its start and end; of its first and last row in a run cut short"""
    if ph:
        return f"{ph['loadavg_start'][0]:.1f} -> {ph['loadavg_end'][0]:.1f}"
    return f"{rows[0]['loadavg'][0]:.1f} -> {rows[-1]['loadavg'][0]:.1f} (first -> last row: the run stopped in this phase)"


def _nixl_run(path: str, run: dict) -> list:
    med = statistics.median
    m, ph = run["model"], run["phases"]
    end = f"{run['machine']['loadavg_end'][0]:.1f}" if "loadavg_end" in run["machine"] else "not recorded"
    out = [f"`{path}`: `{run['command']}`; {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads x "
           f"{m['hidden'] // m['heads']}, {m['dtype']}, block {m['block_size']}; llmdd transport "
           f"{', '.join(sorted(set(run.get('transports', {}).values()))) or '?'}; NixlConnector: "
           f"{run['connectors']['nixl']}; {run['machine']['cpus']} CPUs, load (1 min) "
           f"{run['machine']['loadavg_start'][0]:.1f} at the start, {end} at the end; "
           "ratios are LlmddConnector's median over NixlConnector's, from this one run (the two alternate)."]
    if run.get("cut_short"):
        out[0] += f" This run was cut short: {run['cut_short']}."
    rows = run["rows"]
    if rows:
        n = len({r["rep"] for r in rows})
        out += ["", f"Decode time to first token, ms, median (min) of {n} interleaved repetitions (load {_load(ph.get('ttft'), rows)}):",
                "", "| prompt tokens | LlmddConnector | NixlConnector | ratio | target | verdict | llmdd pull (connector) "
                "| first token equal | prefill instance TTFT, Llmdd / Nixl |", "|---:|---:|---:|---:|---:|---|---:|---|---:|"]
        for length in sorted({r["prompt_tokens"] for r in rows}):
            rs = [r for r in rows if r["prompt_tokens"] == length]
            a, b = [r["llmdd_ttft_s"] for r in rs], [r["nixl_ttft_s"] for r in rs]
            ratio = med(a) / med(b)
            target = TTFT_MAX_LONG if length >= LONG else TTFT_MAX
            out.append(f"| {length} | {_mm(a)} | {_mm(b)} | {ratio:.2f}x | <= {target:.1f}x "
                       f"| {_verdict(ratio <= target, len(rs), _noisy(run, ph.get('ttft'), rows))} | {_mm([r['llmdd_pull_s'] for r in rs])} "
                       f"| {sum(r['same_first_token'] for r in rs)}/{len(rs)} "
                       f"| {_ms([r['llmdd_prefill_ttft_s'] for r in rs])} / {_ms([r['nixl_prefill_ttft_s'] for r in rs])} |")
    mixed = run["mixed"]
    if mixed:
        r0 = mixed[0]
        out += ["", f"Mixed load: {r0['requests']} concurrent requests through the P/D proxy ({r0['prompt_tokens']} prompt "
                f"and {r0['output_tokens']} output tokens in all), {len(mixed)} repetitions, median (min) "
                f"(load {_load(ph.get('mixed'), mixed)}):", "",
                "| connector | output tokens/s, prefill + decode | output tokens/s, decode phase | decode TTFT median, ms "
                "| prefill phase wall, s | outputs equal across connectors |", "|---|---:|---:|---:|---:|---|"]
        for c, label in (("llmdd", "LlmddConnector"), ("nixl", "NixlConnector")):
            tp = [r[c]["tokens_per_s"] for r in mixed]
            dp = [r[c]["decode_tokens_per_s"] for r in mixed]
            out.append(f"| {label} | {med(tp):.1f} ({min(tp):.1f}) | {med(dp):.1f} ({min(dp):.1f}) "
                       f"| {1000 * med(med(r[c]['decode_ttft_s']) for r in mixed):.0f} "
                       f"| {med(r[c]['prefill_wall_s'] for r in mixed):.1f} "
                       f"| {sum(r['same_tokens'] for r in mixed)}/{sum(r['requests'] for r in mixed)} |")
        ratio = med(r["llmdd"]["tokens_per_s"] for r in mixed) / med(r["nixl"]["tokens_per_s"] for r in mixed)
        dratio = (med(r["llmdd"]["decode_tokens_per_s"] for r in mixed)
                  / med(r["nixl"]["decode_tokens_per_s"] for r in mixed))
        out += ["", f"Throughput ratio (prefill + decode): {ratio:.2f}x, target >= {MIXED_MIN:.1f}x: "
                f"{_verdict(ratio >= MIXED_MIN, len(mixed), _noisy(run, ph.get('mixed'), mixed))}; decode phase alone: {dratio:.2f}x."]
    local = run["local"]
    if local:
        a = [r["llmdd_ttft_s"] for r in local]
        x = [r["nixl_ttft_s"] for r in local]
        b = [r["none_ttft_s"] for r in local]
        ratio, xratio = med(a) / med(b), med(x) / med(b)
        out += ["", f"A {local[0]['prompt_tokens']}-token prompt computed locally, {len(local)} repetitions (order rotated), "
                f"TTFT ms median (min) (load {_load(ph.get('local'), local)}): LlmddConnector's decode instance {_mm(a)}, "
                f"NixlConnector's {_mm(x)}, no connector {_mm(b)}; with LlmddConnector / without: {ratio:.2f}x, "
                f"target <= {LOCAL_MAX:.2f}x: {_verdict(ratio <= LOCAL_MAX, len(local), _noisy(run, ph.get('local'), local))} "
                f"(NixlConnector / without: {xratio:.2f}x)."]
    return out


def nixl_table(paths: list) -> list:
    out: list = []
    for path in paths:
        with open(path) as f:
            out += ([""] if out else []) + _nixl_run(path, json.load(f))
    return out


def _write(doc: str, command: str, body: list) -> None:
    lines = open(doc).read().split("\n")
    start = lines.index(f"<!-- generated: {command} -->")
    end = lines.index("<!-- end generated -->", start)
    lines[start + 1:end] = [""] + body + [""]
    with open(doc, "w") as f:
        f.write("\n".join(lines))


def main(argv: list) -> int:
    write = None
    if "--write" in argv:
        i = argv.index("--write")
        write, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if argv and argv[0] == "--nixl":
        body = nixl_table(argv[1:])
    else:
        body = table(argv)
    if write:
        _write(write, " ".join(["python", "scripts/vllm_ttft_table.py"] + argv), body)
    else:
        print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
