"""Ratios to the anchors, the targets' verdicts, the stdout table, the JSON, the plots and the
report over several committed runs (text or markdown)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Optional

from llmdd._tools.bench.common import KiB, MiB

# figure -> (label, kind): kind "bw" (GB/s, higher is better) or "lat" (us, lower is better)
FIGURES = {
    "pull_blocks_64k": ("pull_blocks KV 64 KiB blocks", "bw"),
    "push_blocks_64k": ("push_blocks KV 64 KiB blocks", "bw"),
    "pull_blocks_16k": ("pull_blocks KV 16 KiB blocks", "bw"),
    "push_blocks_16k": ("push_blocks KV 16 KiB blocks", "bw"),
    "transfer_cache_async_64k": ("transfer_cache_async 32 layers, 64 KiB", "bw"),
    "pull_cache": ("pull_cache contiguous", "bw"),
    "latency_64k": ("one 64 KiB block pull_blocks, p50", "lat"),
    "latency_push_64k": ("one 64 KiB block push_blocks, p50", "lat"),
}

ANCHORS = {
    "memcpy": "memcpy np.copyto, 1 thread",
    "gather_64k": "in-process gather 64 KiB blocks (np.take)",
    "gather_16k": "in-process gather 16 KiB blocks (np.take)",
    "cma_contiguous": "process_vm_readv contiguous, 1 thread",
    "cma_64k": "process_vm_readv 64 KiB blocks, 1 thread",
    "cma_16k": "process_vm_readv 16 KiB blocks, 1 thread",
    "cma2_64k": "process_vm_readv 64 KiB blocks, 2 threads",
    "cma2_16k": "process_vm_readv 16 KiB blocks, 2 threads",
    "cma_latency_64k": "process_vm_readv one 64 KiB block, p50",
    "tcp_1stream": "raw tcp socket, 1 stream",
    "tcp_2stream": "raw tcp socket, 2 streams",
    "tcp_rr_64k": "raw tcp request/reply 64 KiB, p50",
    "tcp_rr_push_64k": "raw tcp push 64 KiB (block out, 1-byte answer), p50",
}

# peers (bench/run_peers.sh runs bench/peers/*.py): measurement name -> label
PEERS = {
    "nixl_kv64": "NIXL/UCX KV 64x256x64 KiB READ, per request (make + post + wait)",
    "nixl_kv64_prepared": "NIXL/UCX KV 64x256x64 KiB READ, prepared handle (post + wait)",
    "nixl_kv16": "NIXL/UCX KV 64x1024x16 KiB READ, per request",
    "nixl_kv16_prepared": "NIXL/UCX KV 64x1024x16 KiB READ, prepared handle",
    "nixl_contiguous": "NIXL/UCX contiguous READ",
    "nixl_latency": "NIXL/UCX one 64 KiB block, per request, p50",
    "nixl_latency_prepared": "NIXL/UCX one 64 KiB block, prepared handle, p50",
    "nixl_latency_write": "NIXL/UCX one 64 KiB block WRITE, per request, p50",
    "mooncake_kv64": "Mooncake TCP KV 64x256x64 KiB, one batch_transfer_sync_read",
    "mooncake_kv16": "Mooncake TCP KV 64x1024x16 KiB, one batch_transfer_sync_read",
    "mooncake_contiguous": "Mooncake TCP contiguous transfer_sync_read",
    "mooncake_latency": "Mooncake TCP one 64 KiB block transfer_sync_read, p50",
    "mooncake_latency_write": "Mooncake TCP one 64 KiB block transfer_sync_write, p50",
}

# the matching peer of each llmdd figure: same-host transports vs NIXL (cma), tcp vs Mooncake (tcp)
PEER_MATCH = {
    "pull_blocks_64k": ("nixl_kv64", "mooncake_kv64"),
    "pull_blocks_16k": ("nixl_kv16", "mooncake_kv16"),
    "pull_cache": ("nixl_contiguous", "mooncake_contiguous"),
    "latency_64k": ("nixl_latency", "mooncake_latency"),
    "latency_push_64k": ("nixl_latency_write", "mooncake_latency_write"),
}


def same_host(transport: str) -> bool:
    return transport not in ("tcp", "tcp+tls")


def anchor_match(figure: str, transport: str) -> list:
    """The anchors of one llmdd figure, the primary (the physical path of that transport) first."""
    sh = same_host(transport)
    if figure in ("pull_blocks_64k", "push_blocks_64k", "transfer_cache_async_64k"):
        return ["cma_64k", "gather_64k", "cma2_64k"] if sh else ["tcp_2stream", "tcp_1stream", "cma_64k"]
    if figure in ("pull_blocks_16k", "push_blocks_16k"):
        return ["cma_16k", "gather_16k", "cma2_16k"] if sh else ["tcp_2stream", "tcp_1stream", "cma_16k"]
    if figure == "pull_cache":
        return ["cma_contiguous", "memcpy"] if sh else ["tcp_2stream", "tcp_1stream", "memcpy"]
    if figure == "latency_64k":
        return ["cma_latency_64k", "tcp_rr_64k"] if sh else ["tcp_rr_64k", "cma_latency_64k"]
    if figure == "latency_push_64k":
        return ["cma_latency_64k", "tcp_rr_push_64k"] if sh else ["tcp_rr_push_64k", "cma_latency_64k"]
    return []


def _value(entry: Optional[dict], kind: str) -> Optional[float]:
    if not entry:
        return None
    if kind == "lat":
        return entry.get("p50", entry.get("median"))
    return entry.get("median")


def ratios(results: dict) -> list:
    """Every llmdd figure as a ratio to each matching anchor (and peer, when merged).

    Bandwidth ratios are llmdd / anchor (>1: llmdd faster); latency ratios are llmdd / anchor
    too (<1: llmdd faster)."""
    rows = []
    anchors = results.get("anchors", {})
    peers = results.get("peers", {}).get("values", {})
    for t, figs in results.get("transports", {}).items():
        for fig, (label, kind) in FIGURES.items():
            v = _value(figs.get(fig), kind)
            if v is None:
                continue
            refs = [(a, ANCHORS[a], _value(anchors.get(a), "lat" if "latency" in a or "rr" in a else "bw"))
                    for a in anchor_match(fig, t)]
            match = PEER_MATCH.get(fig)
            if match:
                pk = match[0] if same_host(t) else match[1]
                pv = peers.get(pk)
                if pv is not None:
                    refs.append((pk, PEERS[pk], pv))
            for key, name, av in refs:
                if av:
                    rows.append({"transport": t, "figure": fig, "label": label, "kind": kind, "value": v,
                                 "anchor": key, "anchor_label": name, "anchor_value": av, "ratio": v / av})
    return rows


def _ratio(rows: list, t: str, fig: str, anchor: str) -> Optional[float]:
    for r in rows:
        if r["transport"] == t and r["figure"] == fig and r["anchor"] == anchor:
            return r["ratio"]
    return None


def targets(results: dict, rows: Optional[list] = None) -> list:
    """One run's verdicts on the targets of ``targets.toml`` (see :mod:`.targets`)."""
    from llmdd._tools.bench.targets import evaluate

    return evaluate(results)


# ---------------------------------------------------------------------- text
def _fmt(v: Optional[float], kind: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f} GB/s" if kind == "bw" else f"{v:.1f} us"


def _options_text(meta: dict, quote: str = "") -> str:
    """The engine options a run was measured with (``llmdd bench --option``), ``KEY=VALUE, ...`` ("" when none)."""
    return ", ".join(f"{quote}{k}={v}{quote}" for k, v in sorted((meta.get("options") or {}).items()))


def table(results: dict, rows: list, tgts: list) -> list:
    """The readable report: a table of figures with the primary ratio, then anchors, targets."""
    lines = []
    meta = results.get("meta", {})
    transports = list(results.get("transports", {}))
    lines.append(f"llmdd bench  {meta.get('started_utc', '')}  nproc={meta.get('nproc')}  "
                 f"load {meta.get('load_before')} -> {meta.get('load_after')}  "
                 f"({meta.get('elapsed_s', 0):.0f} s)")
    if meta.get("options"):
        lines.append("engine options: " + _options_text(meta))
    w = 40
    head = f"{'workload':{w}s}" + "".join(f" | {t + ' (x primary anchor)':>30s}" for t in transports)
    lines.append(head)
    lines.append("-" * len(head))
    for fig, (label, kind) in FIGURES.items():
        cells = []
        for t in transports:
            v = _value(results["transports"][t].get(fig), kind)
            refs = anchor_match(fig, t)
            r = _ratio(rows, t, fig, refs[0]) if refs else None
            ok = results["transports"][t].get(fig, {}).get("verified")
            mark = "" if ok in (True, None) else " UNVERIFIED"
            cells.append(f"{_fmt(v, kind)} ({'-' if r is None else f'{r:.2f}x'} {refs[0] if refs else ''}){mark}")
        lines.append(f"{label:{w}s}" + "".join(f" | {c:>30s}" for c in cells))
    for t in transports:
        dec = results["transports"][t].get("decoders", {})
        for k in sorted((k for k in dec if k.isdigit()), key=int):
            d = dec[k]
            lines.append(f"  {t}: {k} decoder(s) aggregate {d['aggregate_gbps']:.2f} GB/s, per decoder "
                         + ", ".join(f"{x:.2f}" for x in d["per_decoder_gbps"]) + f", verified={d['verified']}")
        links = results["transports"][t].get("links", {})
        if links.get("idle"):
            lines.append(f"  {t}: idle engine +{links['idle']['delta_bytes'] / MiB:.1f} MiB RSS "
                         f"(process {links['idle']['rss_after_init'] / MiB:.1f} MiB); link setup p50 "
                         f"{links.get('link_ms_p50', 0):.1f} ms, max {links.get('link_ms_max', 0):.1f} ms")
            for p in links.get("points", []):
                marg = p.get("marginal_per_link_bytes")
                lines.append(f"      {p['links']:3d} links: server +{p['delta_bytes'] / MiB:.2f} MiB"
                             + ("" if marg is None else f" ({marg / KiB:.0f} KiB per link after the first)"))
    lines.append("")
    lines.append("anchors (this machine, same run):")
    for key, label in ANCHORS.items():
        a = results.get("anchors", {}).get(key)
        if a:
            kind = "lat" if "latency" in key or "rr" in key else "bw"
            extra = f", p99 {a['p99']:.1f} us" if kind == "lat" else ""
            ver = a.get("verified")
            lines.append(f"  {label:48s} {_fmt(_value(a, kind), kind)}{extra}"
                         + ("" if ver in (True, None) else "  UNVERIFIED"))
    peers = results.get("peers", {}).get("values", {})
    if peers:
        lines.append("peers (bench/run_peers.sh, same machine):")
        for key, v in peers.items():
            kind = "lat" if "latency" in key else "bw"
            lines.append(f"  {PEERS[key]:70s} {_fmt(v, kind)}")
    lines.append("")
    lines.append("targets (llmdd/_tools/bench/targets.toml):")
    if _is_quick(results):
        lines.append("  --quick sizes: the figures are indicative only; a verdict (MET / NOT MET) counts from a full "
                     "run (`llmdd bench` without --quick), so a NOT MET here is no cause for concern by itself")
    for g in tgts:
        v = g["value"]
        vs = "-" if v is None else f"{v:.2f}{g.get('unit', '')}"
        met = {True: "MET", False: "NOT MET", None: "n/a"}[g["met"]]
        lines.append(f"  [{met:7s}] {g.get('id', ''):14s} {g['transport']:4s} {g['target']}: {vs} (goal {g['goal']})"
                     + (f"  [{g['note']}]" if g["note"] else ""))
    for e in results.get("errors", []):
        lines.append(f"ERROR in {e['step']}: {e['error'].splitlines()[0]}")
    return lines


# ---------------------------------------------------------------------- files
def finish(results: dict, out_dir: str) -> dict:
    """Compute ratios and targets into ``results``, write ``results.json`` (and plots); returns results."""
    rows = ratios(results)
    results["ratios"] = rows
    results["targets"] = targets(results, rows)
    os.makedirs(out_dir, exist_ok=True)
    for t, figs in results.get("transports", {}).items():
        for key in [k for k in figs if k.startswith("profile_")]:
            with open(os.path.join(out_dir, f"{key}_{t}.txt"), "w") as f:
                f.write(figs.pop(key))
            figs.setdefault("profiles", []).append(f"{key}_{t}.txt")
    results["plots"] = plots([results], out_dir)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return results


def all_verified(results: dict) -> bool:
    """Every workload that moved bytes checked them and found them right."""
    checks = []
    for a in results.get("anchors", {}).values():
        if "verified" in a:
            checks.append(a["verified"])
    for figs in results.get("transports", {}).values():
        for k, v in figs.items():
            if isinstance(v, dict) and "verified" in v:
                checks.append(v["verified"])
        for k, v in figs.get("decoders", {}).items():
            if isinstance(v, dict) and "verified" in v:
                checks.append(v["verified"])
    return bool(checks) and all(checks)


def _spread(runs: list, get) -> tuple:
    """(median, min, max) of ``get(run)`` over the runs where it is a number; NaNs when none is."""
    import statistics

    vals = [v for v in (get(r) for r in runs) if isinstance(v, (int, float))]
    if not vals:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(vals), min(vals), max(vals)


def plots(runs: list, out_dir: str) -> dict:
    """PNG plots of one run, or of the medians of several (bars span each value's min..max over the runs),
    when matplotlib is installed; otherwise says why there are none.

    Block sizes and "contiguous" are categories (grouped bars, no line between them); decoder and link
    counts get integer ticks at the measured counts; every legend sits outside the data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return {"skipped": "matplotlib is not installed (pip install 'llmdd[bench]'); no plots"}
    import numpy as np

    made = []
    transports: list = []
    for r in runs:
        transports += [t for t in r.get("transports", {}) if t not in transports]
    contiguous = runs[0].get("meta", {}).get("sizes", {}).get("contiguous_bytes", 1 << 30)
    title_runs = "" if len(runs) == 1 else f" (median of {len(runs)} runs; bars: min..max)"
    n_quick = sum(1 for r in runs if _is_quick(r))
    # every figure says when it comes from --quick sizes: indicative only, a full run decides the targets
    sizes_note = ("" if not n_quick else "\n--quick sizes: indicative only (targets are judged on full runs)"
                  if n_quick == len(runs) else f"\n{n_quick} of {len(runs)} runs at --quick sizes: indicative only")

    def tr(r: dict, t: str, fig: str, kind: str = "bw"):
        return _value(r.get("transports", {}).get(t, {}).get(fig), kind)

    def an(r: dict, key: str, kind: str = "bw"):
        return _value(r.get("anchors", {}).get(key), kind)

    # bandwidth vs block size: three categories, one bar per series
    cats = ["16 KiB blocks", "64 KiB blocks", f"contiguous {contiguous // MiB} MiB"]
    series: list[tuple[str, list[Callable[[dict], Any]]]] = [
        (f"llmdd {t} pull", [functools.partial(tr, t=t, fig=f) for f in
                             ("pull_blocks_16k", "pull_blocks_64k", "pull_cache")]) for t in transports]
    series.append(("process_vm_readv, 1 thread", [functools.partial(an, key=k) for k in
                                                  ("cma_16k", "cma_64k", "cma_contiguous")]))
    series.append(("process_vm_readv, 2 threads (blocks)", [functools.partial(an, key=k) for k in
                                                            ("cma2_16k", "cma2_64k", "-")]))
    series.append(("in-process gather (blocks) / memcpy (contiguous), 1 thread",
                   [functools.partial(an, key=k) for k in ("gather_16k", "gather_64k", "memcpy")]))
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    width = 0.8 / max(1, len(series))
    x = np.arange(len(cats))
    for i, (label, getters) in enumerate(series):
        med_t, lo_t, hi_t = zip(*(_spread(runs, g) for g in getters))
        med, lo, hi = np.array(med_t), np.array(lo_t), np.array(hi_t)
        yerr = None if len(runs) == 1 else np.vstack([med - lo, hi - med])
        ax.bar(x + (i - (len(series) - 1) / 2) * width, med, width, yerr=yerr, capsize=3, label=label)
    tcp2 = _spread(runs, lambda r: an(r, "tcp_2stream"))[0]
    if tcp2 == tcp2:
        ax.axhline(tcp2, color="grey", linestyle=":", label="raw tcp socket, 2 streams")
    ax.set_xticks(x, cats)
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_title("pull bandwidth by block size" + title_runs + sizes_note, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.savefig(os.path.join(out_dir, "bandwidth_vs_block_size.png"), dpi=100, bbox_inches="tight")
    plt.close(fig)
    made.append("bandwidth_vs_block_size.png")

    # latency of one block: the first run's distributions (histograms do not average), p50 over the runs
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    first = runs[0]
    def transport_entry(r: dict, t: str, key: str) -> Any:
        return r.get("transports", {}).get(t, {}).get(key)

    def anchor_entry(r: dict, key: str) -> Any:
        return r.get("anchors", {}).get(key)

    lat: list[tuple[str, Callable[[dict], Any]]] = [
        (f"llmdd {t} pull_blocks", functools.partial(transport_entry, t=t, key="latency_64k")) for t in transports]
    lat += [("bare process_vm_readv", functools.partial(anchor_entry, key="cma_latency_64k")),
            ("raw tcp request/reply", functools.partial(anchor_entry, key="tcp_rr_64k"))]
    for label, get in lat:
        entry = get(first)
        if entry and entry.get("hist"):
            p50 = _spread(runs, lambda r: (get(r) or {}).get("p50"))[0]
            p99 = _spread(runs, lambda r: (get(r) or {}).get("p99"))[0]
            e, c = entry["hist"]["edges"], entry["hist"]["counts"]
            ax.stairs(c, e, label=f"{label}: p50 {p50:.0f} us, p99 {p99:.0f} us")
    ax.set_xscale("log")
    ax.set_xlabel("us per call, one 64 KiB block")
    ax.set_ylabel("calls")
    locator = ax.yaxis.get_major_locator()
    if isinstance(locator, MaxNLocator):   # a linear axis' AutoLocator is one
        locator.set_params(integer=True)
    ax.set_title("latency of one 64 KiB block" + ("" if len(runs) == 1 else
                                                  f" (histograms: first run; p50/p99: median of {len(runs)} runs)")
                 + sizes_note, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.savefig(os.path.join(out_dir, "latency_64k.png"), dpi=100, bbox_inches="tight")
    plt.close(fig)
    made.append("latency_64k.png")

    # scaling with decoders (categorical counts) and links (integer counts)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    fig.subplots_adjust(wspace=0.3)
    counts = sorted({int(k) for r in runs for f in r.get("transports", {}).values()
                     for k in f.get("decoders", {}) if k.isdigit()})
    pos = np.arange(len(counts))
    nser = 2 * max(1, len(transports))
    width = 0.8 / nser
    i = 0
    for ti, t in enumerate(transports):
        for key, what in (("aggregate_gbps", "aggregate"), ("min_gbps", "slowest decoder")):
            med_t, lo_t, hi_t = zip(*(_spread(runs, lambda r, n=n, key=key: r.get("transports", {}).get(t, {})
                                              .get("decoders", {}).get(str(n), {}).get(key)) for n in counts)) \
                if counts else ((), (), ())
            med, lo, hi = np.array(med_t), np.array(lo_t), np.array(hi_t)
            yerr = None if len(runs) == 1 or not counts else np.vstack([med - lo, hi - med])
            ax1.bar(pos + (i - (nser - 1) / 2) * width, med, width, yerr=yerr, capsize=2, label=f"{t} {what}",
                    color=f"C{ti}", edgecolor="black", linewidth=0.5,
                    hatch="" if key == "aggregate_gbps" else "//", alpha=1.0 if key == "aggregate_gbps" else 0.55)
            i += 1
    ax1.set_xticks(pos, [str(n) for n in counts])
    ax1.set_xlabel("decoders pulling from one prompt at once")
    ax1.set_ylabel("GB/s (1e9 B/s)")
    ax1.set_title("scaling with decoders", fontsize=10)
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    link_counts = sorted({p["links"] for r in runs for f in r.get("transports", {}).values()
                          for p in f.get("links", {}).get("points", [])})
    for ti, t in enumerate(transports):
        def at(r, n, t=t):
            for p in r.get("transports", {}).get(t, {}).get("links", {}).get("points", []):
                if p["links"] == n:
                    return p["delta_bytes"] / MiB
            return None
        rss = [_spread(runs, lambda r, n=n: at(r, n))[0] for n in link_counts]
        ax2.plot(link_counts, rss, marker="o", color=f"C{ti}", label=f"{t}: server RSS above no links")
    if link_counts:
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(link_counts, [str(n) for n in link_counts])
        ax2.minorticks_off()
    ax2.set_xlabel("links to one server (log scale)")
    ax2.set_ylabel("MiB")
    ax2.set_title("server memory vs links", fontsize=10)
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1)
    if title_runs or sizes_note:
        fig.suptitle((title_runs.strip(" ()") + sizes_note).strip("\n"), fontsize=10)
    fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=100, bbox_inches="tight")
    plt.close(fig)
    made.append("scaling.png")
    return {"files": made, "note": sizes_note.strip()}   # what every title says about the sizes ("" full)


# ---------------------------------------------------------------------- several committed runs
def prepare(results: dict) -> dict:
    """``results`` with its ratios and verdicts recomputed from the current tables (in place)."""
    results["ratios"] = ratios(results)
    results["targets"] = targets(results)
    return results


def _median(vals: list) -> Optional[float]:
    import statistics

    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def _cell(vals: list, kind: str) -> str:
    """``median (run 1, run 2, ...)``; a single run is just its value."""
    med = _median(vals)
    if med is None:
        return "-"
    fmt = (lambda v: f"{v:.2f}") if kind in ("bw", "x") else (lambda v: f"{v:.1f}")
    unit = {"bw": " GB/s", "lat": " us", "x": "x"}[kind]
    if len(vals) == 1:
        return fmt(med) + unit
    return fmt(med) + unit + " (" + ", ".join("-" if v is None else fmt(v) for v in vals) + ")"


def markdown(runs: list, names: list) -> list:
    """The report over ``runs`` (``results.json`` dictionaries, ``names`` their paths as given) as markdown
    lines: the runs and their load, the figures, the ratios to the primary anchor, the anchors, the peers,
    and the targets' verdicts on the medians."""
    from llmdd._tools.bench.targets import aggregate

    for r in runs:
        prepare(r)
    transports: list = []
    for r in runs:
        transports += [t for t in r.get("transports", {}) if t not in transports]
    n = len(runs)
    L = [f"Generated by `llmdd bench --report {' '.join(names)} --markdown` from the committed results;"
         f" {'each cell: the median of the ' + str(n) + ' runs, then every run in order' if n > 1 else 'one run'}.",
         "", "| run | started (UTC) | load 1/5/15 min before -> after | seconds | transports | sizes | peers |",
         "|---|---|---|---:|---|---|---|"]
    for name, r in zip(names, runs):
        m = r.get("meta", {})
        peers = r.get("peers", {})
        pv = peers.get("values", {})
        pl = peers.get("load")
        pcell = (f"{len(pv)} figures" + (f", load {pl}" if pl else "")) if pv else "none"
        L.append(f"| `{name}` | {m.get('started_utc', '?')} | {m.get('load_before')} -> {m.get('load_after')} | "
                 f"{m.get('elapsed_s', 0):.0f} | {', '.join(r.get('transports', {}))} | "
                 f"{'quick' if _is_quick(r) else 'full'}{'; ' + _options_text(m, '`') if m.get('options') else ''} | {pcell} |")
    errors = [(name, e) for name, r in zip(names, runs) for e in r.get("errors", [])]
    unverified = [name for name, r in zip(names, runs) if not all_verified(r)]
    L.append("")
    L.append("Every moved byte verified in every run." if not unverified else
             "Runs with a byte that did not verify: " + ", ".join(f"`{u}`" for u in unverified) + ".")
    if errors:
        L.append("")
    for name, e in errors:
        L.append(f"- error in `{name}`, step {e['step']}: {e['error'].splitlines()[0]}")
    L += ["", "**Figures**", "", "| workload | " + " | ".join(f"llmdd {t}" for t in transports) + " |",
          "|---|" + "---:|" * len(transports)]
    for fig, (label, kind) in FIGURES.items():
        cells = [_cell([_value(r.get("transports", {}).get(t, {}).get(fig), kind) for r in runs], kind)
                 for t in transports]
        if all(c == "-" for c in cells):
            continue   # a figure these runs did not measure (an older bench)
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    for k in sorted({int(k) for r in runs for f in r.get("transports", {}).values() for k in f.get("decoders", {})
                     if k.isdigit()}):
        cells = [_cell([r.get("transports", {}).get(t, {}).get("decoders", {}).get(str(k), {}).get("aggregate_gbps")
                        for r in runs], "bw") for t in transports]
        L.append(f"| {k} decoder{'s' if k > 1 else ''} at once, aggregate | " + " | ".join(cells) + " |")
    L += ["", "**Ratios to the primary anchor** (bandwidth: llmdd / anchor, > 1 is faster; latency: llmdd / anchor,"
          " < 1 is faster)", "", "| workload | " + " | ".join(f"llmdd {t}" for t in transports) + " |",
          "|---|" + "---|" * len(transports)]
    for fig, (label, kind) in FIGURES.items():
        cells = []
        for t in transports:
            refs = anchor_match(fig, t)
            if not refs:
                cells.append("-")
                continue
            vals = [_ratio(r["ratios"], t, fig, refs[0]) for r in runs]
            cells.append("-" if _median(vals) is None else f"{_cell(vals, 'x')} {refs[0]}")
        if all(c == "-" for c in cells):
            continue
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    for fig, match in PEER_MATCH.items():
        cells = []
        for t in transports:
            pk = match[0] if same_host(t) else match[1]
            vals = [_ratio(r["ratios"], t, fig, pk) for r in runs]
            cells.append("-" if _median(vals) is None else f"{_cell(vals, 'x')} {pk}")
        if any(c != "-" for c in cells):
            L.append(f"| {FIGURES[fig][0]} vs the peer | " + " | ".join(cells) + " |")
    L += ["", "**Anchors** (this machine, same runs)", "", "| anchor | value |", "|---|---:|"]
    for key, label in ANCHORS.items():
        kind = "lat" if "latency" in key or "rr" in key else "bw"
        vals = [_value(r.get("anchors", {}).get(key), kind) for r in runs]
        if _median(vals) is not None:
            L.append(f"| {label} | {_cell(vals, kind)} |")
    if any(r.get("peers", {}).get("values") for r in runs):
        L += ["", "**Peers** (bench/run_peers.sh right after each run, same machine)", "", "| peer | value |",
              "|---|---:|"]
        for key, label in PEERS.items():
            kind = "lat" if "latency" in key else "bw"
            vals = [r.get("peers", {}).get("values", {}).get(key) for r in runs]
            if _median(vals) is not None:
                L.append(f"| {label} | {_cell(vals, kind)} |")
        notes = sorted({s for r in runs for s in r.get("peers", {}).get("status", [])
                        if "failed" in s or "unavailable" in s or "not" in s})
        if notes:
            L.append("")
        for s in notes:
            L.append(f"- {s}")
    L += ["", "**Targets** (`llmdd/_tools/bench/targets.toml`; verdict on the median of the runs that measured it)", "",
          "| id | source | target | transport | value | goal | verdict |", "|---|---|---|---|---|---|---|"]
    for g in aggregate(runs):
        unit = g["unit"]
        kind = "x" if unit == "x" else "num"
        if g["value"] is None:
            val = "-"
        elif kind == "x":
            val = _cell(g["values"], "x")
        else:
            fmt = (lambda v: "-" if v is None else f"{v:.2f}")
            val = fmt(g["value"]) + f" {unit}" + ("" if n == 1 else " (" + ", ".join(fmt(v) for v in g["values"]) + ")")
        verdict = {True: "**met**", False: "**not met**", None: "not measured"}[g["met"]]
        note = f" ({g['note']})" if g["note"] else ""
        goal = g["goal"] + ("x" if unit == "x" else f" {unit}" if unit else "")
        L.append(f"| {g['id']} | {g['source']} | {g['target']} | {g['transport']} | {val} | {goal} | {verdict}{note} |")
    return L


def _is_quick(results: dict) -> bool:
    from llmdd._tools.bench.targets import quick

    return quick(results)


def text(runs: list, names: list) -> list:
    """The report over several runs for a terminal: the markdown without its table syntax."""
    out = []
    for line in markdown(runs, names):
        if line.startswith("|---"):
            continue
        if line.startswith("| "):
            line = "  ".join(c.strip() for c in line.strip("|").split(" | "))
        out.append(line.replace("**", "").replace("`", ""))
    return out
