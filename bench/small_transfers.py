"""Issue 21's small-transfer targets over shm, both data paths, interleaved runs, one JSON.

Each run starts a fresh prompt and decoder (spawned, one engine each, shm transport), registers a
64 KiB layout and a 16 KiB layout of 64 tensors on both sides, links, and measures in the decoder,
interleaved with their bare-syscall anchors (``llmdd._tools.bench.small.rows``):

* ``pull_1x64k``: ``pull_blocks`` of one 64 KiB block of one tensor vs one ``process_vm_readv``;
* ``push_1x64k``: ``push_blocks`` of one 64 KiB block vs one ``process_vm_writev``;
* ``pull_8x2x16k``: ``pull_blocks`` of 8 blocks of 16 KiB from 2 tensors (16 iovecs, 256 KiB) vs one
  ``process_vm_readv`` of the same 16 iovecs.

Runs alternate between the pure-Python path (``LLMDD_SHM_NATIVE=0`` in the workers' environment)
and the C hot path; the summary is the median over the runs of each path of the per-run ratios.

    .venv/bin/python bench/small_transfers.py --runs 3 --out bench/results-committed/issue21/<name>
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

from llmdd._tools.bench.common import KiB, MiB, load_average
from llmdd._tools.bench.runner import DECODER, NUM_TENSORS, PROMPT, SALT_DECODER, SALT_PROMPT, close_all, start_peers
from llmdd._tools.bench.small import TARGETS, markdown, rows


#: the shapes profiled by --profile: row -> (layout block bytes, blocks, tensors, op)
_PROFILE_SHAPES = {"pull_1x64k": (64 * KiB, 1, 1, "pull"), "push_1x64k": (64 * KiB, 1, 1, "push"),
                   "pull_8x2x16k": (16 * KiB, 8, 2, "pull")}


def one_run(path: str, kv: int, n: int, warmup: int, profile: bool = False) -> dict:
    spawn = mp.get_context("spawn")
    old = os.environ.get("LLMDD_SHM_NATIVE")
    os.environ["LLMDD_SHM_NATIVE"] = "0" if path == "python" else "1"
    try:
        prompt, dec = start_peers(spawn, [f"{path}-prompt", f"{path}-decoder"], 300)
    finally:
        if old is None:
            os.environ.pop("LLMDD_SHM_NATIVE", None)
        else:
            os.environ["LLMDD_SHM_NATIVE"] = old
    out: dict = {"path": path, "load_before": load_average(), "started": time.strftime("%H:%M:%S", time.gmtime())}
    try:
        pinfo = prompt.call("init", role="PROMPT", cluster_id=PROMPT, transport="shm", listen=True)
        dec.call("init", role="DECODER", cluster_id=DECODER, transport="shm")
        layouts = {}
        for mid, bb in ((10, 64 * KiB), (11, 16 * KiB)):
            nb = kv // NUM_TENSORS // bb
            name = f"b{bb // KiB}k"
            layouts[bb] = (mid, nb, name)
            for p in (prompt, dec):
                p.call("alloc", nbytes=kv, name=name)
                p.call("register_blocks", model_id=mid, num_tensors=NUM_TENSORS, num_blocks=nb, block_bytes=bb,
                       name=name)
            prompt.call("fill", salt=SALT_PROMPT, name=name)
        out["data_path"] = dec.call("shm_data_path")
        want_native = path == "native"
        if bool(out["data_path"]["native"]) is not want_native:
            raise RuntimeError(f"{path} run: the decoder's shm data path is {out['data_path']}")
        link = dec.call("link", remote=PROMPT, port=pinfo["port"])
        if link["status"] != "LLM_SUCCESS" or link.get("transport") not in (None, "shm"):
            raise RuntimeError(f"link failed or not shm: {link}")
        if profile:
            out["profiles"] = {}
            for row, (bb, blocks, tensors, op) in _PROFILE_SHAPES.items():
                mid, nb, _ = layouts[bb]
                out["profiles"][row] = dec.call("small_profile", op=op, remote=PROMPT, model_id=mid,
                                                remote_model_id=mid, num_blocks=nb, blocks=blocks,
                                                tensors=tensors, n=n)
        else:
            out["rows"] = rows(prompt, dec, layouts, n, warmup, salt_prompt=SALT_PROMPT, salt_decoder=SALT_DECODER,
                               prompt_id=PROMPT, step=lambda m: print(f"  [{path}] {m}", flush=True))
    finally:
        close_all([dec, prompt])
    out["load_after"] = load_average()
    return out


def first_link_run(mode: str) -> dict:
    """One fresh server and client (spawned), automatic transport choice; ``mode`` "nixl": every
    installed transport plugin loaded, "no-nixl": the ucx (NIXL) plugin blocked in both
    (``LLMDD_DISABLED_PLUGINS=ucx``).  The server's RSS (after a gc) before and after the link."""
    spawn = mp.get_context("spawn")
    old = os.environ.get("LLMDD_DISABLED_PLUGINS")
    if mode == "no-nixl":
        os.environ["LLMDD_DISABLED_PLUGINS"] = ",".join(x for x in (old, "ucx") if x)
    try:
        server, client = start_peers(spawn, [f"{mode}-server", f"{mode}-client"], 300)
    finally:
        if old is None:
            os.environ.pop("LLMDD_DISABLED_PLUGINS", None)
        else:
            os.environ["LLMDD_DISABLED_PLUGINS"] = old
    out: dict = {"mode": mode, "load_before": load_average(), "started": time.strftime("%H:%M:%S", time.gmtime())}
    try:
        info = server.call("init", role="PROMPT", cluster_id=PROMPT, transport="", listen=True)
        client.call("init", role="DECODER", cluster_id=DECODER, transport="")
        out["server_rss_before_link"] = server.call("rss")
        out["client_rss_before_link"] = client.call("rss")
        out["link"] = client.call("link", remote=PROMPT, port=info["port"])
        time.sleep(0.05)   # the server finishes its side of the setup on its own threads
        out["server_rss_after_link"] = server.call("rss")
        out["client_rss_after_link"] = client.call("rss")
        out["server_delta_mib"] = (out["server_rss_after_link"] - out["server_rss_before_link"]) / MiB
        out["client_delta_mib"] = (out["client_rss_after_link"] - out["client_rss_before_link"]) / MiB
        out["link_ms"] = out["link"]["link_s"] * 1e3
        out["server_transports"] = server.call("transports")
    finally:
        close_all([client, server])
    out["load_after"] = load_average()
    return out


def first_link_main(a) -> int:
    """Target 3 of issue 21: first link in automatic mode <= 50 ms with every optional transport
    installed; the server's first-link memory with NIXL installed <= 2 MiB above without it."""
    res: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "nproc": os.cpu_count(),
                 "load_before": load_average(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "runs": [], "targets": {"first_link_ms": 50.0, "server_first_link_extra_mib": 2.0}}
    modes = ("nixl", "no-nixl")
    for i in range(a.runs):
        for mode in modes:
            r = first_link_run(mode)
            print(f"run {i + 1}/{a.runs} [{mode}]: link {r['link_ms']:.1f} ms ({r['link']['status']}, "
                  f"{r['link'].get('transport')}), server +{r['server_delta_mib']:.2f} MiB, client "
                  f"+{r['client_delta_mib']:.2f} MiB; server transports {r['server_transports']}", flush=True)
            res["runs"].append(r)
    summary: dict = {}
    for mode in modes:
        runs = [r for r in res["runs"] if r["mode"] == mode]
        summary[mode] = {"link_ms_median": statistics.median(r["link_ms"] for r in runs),
                         "link_ms": [r["link_ms"] for r in runs],
                         "server_delta_mib_median": statistics.median(r["server_delta_mib"] for r in runs),
                         "server_delta_mib": [r["server_delta_mib"] for r in runs],
                         "transport": sorted({str(r["link"].get("transport")) for r in runs}),
                         "ok": all(r["link"]["status"] == "LLM_SUCCESS" for r in runs)}
    extra = summary["nixl"]["server_delta_mib_median"] - summary["no-nixl"]["server_delta_mib_median"]
    summary["verdict"] = {
        "first_link_ms": summary["nixl"]["link_ms_median"],
        "first_link_met": summary["nixl"]["link_ms_median"] <= res["targets"]["first_link_ms"],
        "server_extra_mib": extra, "server_extra_met": extra <= res["targets"]["server_first_link_extra_mib"]}
    res["summary"] = summary
    res["load_after"] = load_average()
    res["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    v = summary["verdict"]
    print(f"first link with NIXL installed: median {v['first_link_ms']:.1f} ms (target <= 50 ms) "
          f"{'met' if v['first_link_met'] else 'NOT met'}; without: {summary['no-nixl']['link_ms_median']:.1f} ms")
    print(f"server first-link memory: +{summary['nixl']['server_delta_mib_median']:.2f} MiB with NIXL, "
          f"+{summary['no-nixl']['server_delta_mib_median']:.2f} MiB without: {extra:+.2f} MiB (target <= 2 MiB) "
          f"{'met' if v['server_extra_met'] else 'NOT met'}")
    print(f"load {res['load_before']} -> {res['load_after']}")
    return 0 if all(summary[m]["ok"] for m in modes) else 1


def profile_main(a, paths: list) -> int:
    os.makedirs(a.out, exist_ok=True)
    res: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "nproc": os.cpu_count(),
                 "load_before": load_average(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "n": a.n, "runs": []}
    for path in paths:
        r = one_run(path, a.kv_mib * MiB, a.n, a.warmup, profile=True)
        for row, p in r["profiles"].items():
            with open(os.path.join(a.out, f"profile-{path}-{row}.txt"), "w") as f:
                f.write(f"# {res['command']}  ({res['started_utc']}, load {r['load_before']} -> "
                        f"{r['load_after']}, {path} shm path)\n")
                f.write(f"# {row}: whole call p50 {p['whole_p50_us']} us under the stage timer; "
                        f"per-stage p50 (us):\n")
                for stage, us in p["stages_p50_us"].items():
                    f.write(f"#   {us:8.2f}  {stage}\n")
                f.write(p.pop("cprofile"))
            print(f"[{path}] {row}: whole {p['whole_p50_us']} us; " +
                  "; ".join(f"{k.split(' (')[0]} {v}" for k, v in p["stages_p50_us"].items()), flush=True)
        res["runs"].append(r)
    res["load_after"] = load_average()
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="runs per path (interleaved python, native, ...)")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--kv-mib", type=int, default=64, help="bytes per layout and side (MiB)")
    ap.add_argument("--paths", default="python,native")
    ap.add_argument("--out", required=True, help="directory for results.json")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the rows: one run per path of the per-stage timer and cProfile of each shape "
                         "(profile-<path>-<row>.txt and results.json in --out)")
    ap.add_argument("--first-link", action="store_true",
                    help="instead of the rows: target 3 (first link in automatic mode, with and without the NIXL "
                         "plugin, --runs interleaved runs each)")
    ap.add_argument("--report", nargs="+", metavar="DIR",
                    help="print the markdown table of committed runs (their results.json) instead of measuring "
                         "(docs/benchmarks.md's issue-21 table is this output; tests/unit/tools/test_bench_docs.py checks it)")
    ap.add_argument("--markdown", action="store_true", help="with --report: markdown (the only format)")
    if "--report" in sys.argv:   # no --out needed
        for act in ap._actions:
            if act.dest == "out":
                act.required = False
    a = ap.parse_args()
    if a.report:
        results = []
        for d in a.report:
            with open(os.path.join(d, "results.json")) as f:
                results.append(json.load(f))
        print("\n".join(markdown(results, a.report)))
        return 0
    if a.first_link:
        return first_link_main(a)
    paths = [p for p in a.paths.split(",") if p]
    if a.profile:
        return profile_main(a, paths)
    res: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "nproc": os.cpu_count(),
                 "load_before": load_average(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "n": a.n, "warmup": a.warmup, "kv_mib": a.kv_mib, "runs": [], "targets": TARGETS}
    for i in range(a.runs):
        for path in paths:
            print(f"run {i + 1}/{a.runs}, {path} path", flush=True)
            res["runs"].append(one_run(path, a.kv_mib * MiB, a.n, a.warmup))
    summary: dict = {}
    for path in paths:
        runs = [r for r in res["runs"] if r["path"] == path]
        summary[path] = {}
        for row in TARGETS:
            ratios = [r["rows"][row]["ratio_p50"] for r in runs]
            summary[path][row] = {
                "ratio_p50_median": statistics.median(ratios), "ratios": ratios,
                "llmdd_p50_us": [r["rows"][row]["llmdd"]["p50"] for r in runs],
                "anchor_p50_us": [r["rows"][row]["anchor"]["p50"] for r in runs],
                "verified": all(r["rows"][row]["llmdd"]["verified"] for r in runs),
                "target": TARGETS[row], "met": statistics.median(ratios) <= TARGETS[row]}
    res["summary"] = summary
    res["load_after"] = load_average()
    res["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    for path in paths:
        for row, v in summary[path].items():
            print(f"{path:>6} {row:<13} median ratio {v['ratio_p50_median']:.2f}x (runs "
                  f"{', '.join(f'{x:.2f}' for x in v['ratios'])}; llmdd p50 "
                  f"{', '.join(f'{x:.1f}' for x in v['llmdd_p50_us'])} us; bare "
                  f"{', '.join(f'{x:.1f}' for x in v['anchor_p50_us'])} us) target <= {v['target']}x "
                  f"{'met' if v['met'] else 'NOT met'}; verified={v['verified']}")
    print(f"load {res['load_before']} -> {res['load_after']}")
    ok = all(v["verified"] for p in summary.values() for v in p.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
