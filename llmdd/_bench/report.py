"""Ratios to the anchors, the DESIGN.md section 8 targets, the stdout table, the JSON and the plots."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from .common import KiB, MiB

# figure -> (label, kind): kind "bw" (GB/s, higher is better) or "lat" (us, lower is better)
FIGURES = {
    "pull_blocks_64k": ("pull_blocks KV 64 KiB blocks", "bw"),
    "push_blocks_64k": ("push_blocks KV 64 KiB blocks", "bw"),
    "pull_blocks_16k": ("pull_blocks KV 16 KiB blocks", "bw"),
    "push_blocks_16k": ("push_blocks KV 16 KiB blocks", "bw"),
    "transfer_cache_async_64k": ("transfer_cache_async 32 layers, 64 KiB", "bw"),
    "pull_cache": ("pull_cache contiguous", "bw"),
    "latency_64k": ("one 64 KiB block pull_blocks, p50", "lat"),
}

ANCHORS = {
    "memcpy": "memcpy np.copyto, 1 thread",
    "gather_64k": "in-process gather 64 KiB blocks (np.take)",
    "gather_16k": "in-process gather 16 KiB blocks (np.take)",
    "cma_contiguous": "process_vm_readv contiguous, 1 thread",
    "cma_64k": "process_vm_readv 64 KiB blocks, 1 thread",
    "cma_16k": "process_vm_readv 16 KiB blocks, 1 thread",
    "cma_latency_64k": "process_vm_readv one 64 KiB block, p50",
    "tcp_1stream": "raw tcp socket, 1 stream",
    "tcp_2stream": "raw tcp socket, 2 streams",
    "tcp_rr_64k": "raw tcp request/reply 64 KiB, p50",
}

# peers (bench/run_peers.sh): key -> the anchor script's measurement name
PEERS = {
    "nixl_kv64": "nixl KV 64x256x64KiB READ make+post->done [UCX_TLS=default(cma)]",
    "nixl_kv64_prepared": "nixl KV 64x256x64KiB READ post->done [UCX_TLS=default(cma)]",
    "nixl_kv16": "nixl KV 64x1024x16KiB READ make+post->done [UCX_TLS=default(cma)]",
    "nixl_kv16_prepared": "nixl KV 64x1024x16KiB READ post->done [UCX_TLS=default(cma)]",
    "nixl_contiguous": "nixl i) contiguous 1GiB READ [UCX_TLS=default(cma)]",
    "nixl_latency": "nixl one 64KiB block READ initialize+post->done+release latency [UCX_TLS=default(cma)]",
    "nixl_latency_prepared": "nixl one 64KiB block READ post->done latency [UCX_TLS=default(cma)]",
    "mooncake_kv64": "mooncake KV 64x256x64KiB batch_transfer_sync_read 1 call [tcp]",
    "mooncake_kv16": "mooncake KV 64x1024x16KiB batch_transfer_sync_read 1 call [tcp]",
    "mooncake_contiguous": "mooncake i) contiguous 1GiB transfer_sync_read [tcp]",
    "mooncake_latency": "mooncake one 64KiB block transfer_sync_read latency [tcp]",
}

# the matching peer of each llmdd figure: same-host transports vs NIXL (cma), tcp vs Mooncake (tcp)
PEER_MATCH = {
    "pull_blocks_64k": ("nixl_kv64", "mooncake_kv64"),
    "pull_blocks_16k": ("nixl_kv16", "mooncake_kv16"),
    "pull_cache": ("nixl_contiguous", "mooncake_contiguous"),
    "latency_64k": ("nixl_latency", "mooncake_latency"),
}


def same_host(transport: str) -> bool:
    return transport != "tcp"


def anchor_match(figure: str, transport: str) -> list:
    """The anchors of one llmdd figure, the primary (the physical path of that transport) first."""
    sh = same_host(transport)
    if figure in ("pull_blocks_64k", "push_blocks_64k", "transfer_cache_async_64k"):
        return ["cma_64k", "gather_64k"] if sh else ["tcp_2stream", "tcp_1stream", "cma_64k"]
    if figure in ("pull_blocks_16k", "push_blocks_16k"):
        return ["cma_16k", "gather_16k"] if sh else ["tcp_2stream", "tcp_1stream", "cma_16k"]
    if figure == "pull_cache":
        return ["cma_contiguous", "memcpy"] if sh else ["tcp_2stream", "tcp_1stream", "memcpy"]
    if figure == "latency_64k":
        return ["cma_latency_64k", "tcp_rr_64k"] if sh else ["tcp_rr_64k", "cma_latency_64k"]
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


def targets(results: dict, rows: list) -> list:
    """DESIGN.md section 8, each target per transport it concerns: met True / False / None (not measured)."""
    out = []
    tr = results.get("transports", {})
    sizes = results.get("meta", {}).get("sizes", {})

    def add(target: str, transport: str, value: Any, goal: str, met: Optional[bool], note: str = "") -> None:
        out.append({"target": target, "transport": transport, "value": value, "goal": goal, "met": met,
                    "note": note})

    for t, figs in tr.items():
        if same_host(t):
            r = _ratio(rows, t, "pull_blocks_64k", "cma_64k")
            add("same host 64 KiB blocks vs single-thread process_vm_readv", t, r, ">= 0.9x",
                None if r is None else r >= 0.9)
            r = _ratio(rows, t, "pull_blocks_64k", "nixl_kv64")
            add("same host 64 KiB blocks vs NIXL/UCX (cma)", t, r, ">= 1.5x", None if r is None else r >= 1.5,
                "" if r is not None else "needs bench/run_peers.sh")
            r = _ratio(rows, t, "pull_blocks_64k", "gather_64k")
            add("moonshot: 64 KiB blocks vs single-thread in-process gather", t, r, "> 1.0x",
                None if r is None else r > 1.0)
            r = _ratio(rows, t, "pull_blocks_16k", "cma_16k")
            add("same host 16 KiB blocks vs single-thread process_vm_readv", t, r, ">= 0.8x",
                None if r is None else r >= 0.8)
            r = _ratio(rows, t, "pull_blocks_16k", "nixl_kv16")
            add("same host 16 KiB blocks vs NIXL/UCX (cma)", t, r, ">= 2x", None if r is None else r >= 2.0,
                "" if r is not None else "needs bench/run_peers.sh")
            lat = figs.get("latency_64k", {}).get("p50")
            add("one 64 KiB block p50, same host", t, lat, "<= 50 us", None if lat is None else lat <= 50.0)
        else:
            r = _ratio(rows, t, "pull_blocks_64k", "tcp_2stream")
            add("tcp 64 KiB blocks vs raw two-stream Python socket", t, r, ">= 0.8x", None if r is None else r >= 0.8)
            r = _ratio(rows, t, "pull_blocks_64k", "mooncake_kv64")
            add("tcp 64 KiB blocks vs Mooncake TCP", t, r, ">= 2x", None if r is None else r >= 2.0,
                "" if r is not None else "needs bench/run_peers.sh")
            r = _ratio(rows, t, "latency_64k", "tcp_rr_64k")
            add("one 64 KiB block p50 vs raw tcp request/reply", t, r, "<= 1.3x", None if r is None else r <= 1.3)
        dec = figs.get("decoders", {})
        ns = sorted(int(k) for k in dec if k.isdigit())
        if ns:
            n = ns[-1]
            agg = dec[str(n)]["aggregate_gbps"] / dec["1"]["aggregate_gbps"] if "1" in dec else None
            floor = dec[str(n)]["min_gbps"] / dec[str(n)]["mean_gbps"]
            suffix = "" if n == 8 else f" (measured with {n}: --quick)"
            add(f"{n} decoders: aggregate vs one decoder", t, agg, ">= 0.8x", None if agg is None else agg >= 0.8,
                suffix)
            add(f"{n} decoders: slowest vs mean", t, floor, ">= 0.5x", floor >= 0.5, suffix)
        links = figs.get("links", {})
        if links.get("idle"):
            idle = links["idle"]["delta_bytes"] / MiB
            add("idle engine RSS (after init minus before)", t, idle, "<= 50 MiB", idle <= 50.0,
                f"process total {links['idle']['rss_after_init'] / MiB:.1f} MiB")
        pts = links.get("points") or []
        if pts and pts[-1].get("marginal_per_link_bytes") is not None:
            last = pts[-1]
            per = last["marginal_per_link_bytes"] / MiB
            add(f"server RSS per link (links 2..{last['links']}; the first link's "
                f"{pts[0]['delta_bytes'] / MiB:.1f} MiB of transport set-up reported apart)", t, per, "<= 1 MiB",
                per <= 1.0)
    if "ucx" in tr:
        for fig, pk in (("pull_blocks_64k", "nixl_kv64"), ("pull_blocks_16k", "nixl_kv16"),
                        ("latency_64k", "nixl_latency")):
            r = _ratio(rows, "ucx", fig, pk)
            if fig == "latency_64k":
                met = None if r is None else r <= 1.1
            else:
                met = None if r is None else r >= 0.9
            add(f"ucx plugin {fig} vs raw NIXL per-request path", "ucx", r, "within 10%", met,
                "" if r is not None else "needs bench/run_peers.sh")
    if sizes and sizes.get("kv_bytes", 0) < (1 << 30):
        for row in out:
            row["note"] = (row["note"] + "; " if row["note"] else "") + "--quick sizes"
    return out


# ---------------------------------------------------------------------- text
def _fmt(v: Optional[float], kind: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f} GB/s" if kind == "bw" else f"{v:.1f} us"


def table(results: dict, rows: list, tgts: list) -> list:
    """The readable report: a table of figures with the primary ratio, then anchors, targets."""
    lines = []
    meta = results.get("meta", {})
    transports = list(results.get("transports", {}))
    lines.append(f"llmdd bench  {meta.get('started_utc', '')}  nproc={meta.get('nproc')}  "
                 f"load {meta.get('load_before')} -> {meta.get('load_after')}  "
                 f"({meta.get('elapsed_s', 0):.0f} s)")
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
    lines.append("DESIGN.md section 8 targets:")
    for g in tgts:
        v = g["value"]
        vs = "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
        met = {True: "MET", False: "NOT MET", None: "n/a"}[g["met"]]
        lines.append(f"  [{met:7s}] {g['transport']:4s} {g['target']}: {vs} (goal {g['goal']})"
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
    results["plots"] = plots(results, out_dir)
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


def plots(results: dict, out_dir: str) -> dict:
    """PNG plots when matplotlib is installed; otherwise says why there are none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"skipped": "matplotlib is not installed (pip install matplotlib); no plots"}
    made = []
    tr = results.get("transports", {})
    an = results.get("anchors", {})
    contiguous = results.get("meta", {}).get("sizes", {}).get("contiguous_bytes", 1 << 30)

    # bandwidth vs block size
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [16 * KiB, 64 * KiB, contiguous]
    for t, figs in tr.items():
        ys = [_value(figs.get("pull_blocks_16k"), "bw"), _value(figs.get("pull_blocks_64k"), "bw"),
              _value(figs.get("pull_cache"), "bw")]
        ax.plot(xs, [y or float("nan") for y in ys], marker="o", label=f"llmdd {t} pull")
    for label, keys in (("process_vm_readv 1 thread", ("cma_16k", "cma_64k", "cma_contiguous")),
                        ("in-process gather / memcpy", ("gather_16k", "gather_64k", "memcpy"))):
        ax.plot(xs, [_value(an.get(k), "bw") or float("nan") for k in keys], linestyle="--", marker="x", label=label)
    if an.get("tcp_2stream"):
        ax.axhline(an["tcp_2stream"]["median"], color="grey", linestyle=":", label="raw tcp, 2 streams")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, ["16 KiB", "64 KiB", f"contiguous {contiguous // MiB} MiB"])
    ax.set_ylabel("GB/s")
    ax.set_title("bandwidth vs block size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "bandwidth_vs_block_size.png"), dpi=100)
    plt.close(fig)
    made.append("bandwidth_vs_block_size.png")

    # latency distribution
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [(f"llmdd {t}", figs.get("latency_64k")) for t, figs in tr.items()]
    series += [("process_vm_readv", an.get("cma_latency_64k")), ("raw tcp req/reply", an.get("tcp_rr_64k"))]
    for label, entry in series:
        if entry and entry.get("hist"):
            e, c = entry["hist"]["edges"], entry["hist"]["counts"]
            ax.stairs(c, e, label=f"{label} (p50 {entry['p50']:.0f} us, p99 {entry['p99']:.0f} us)")
    ax.set_xscale("log")
    ax.set_xlabel("us per 64 KiB block")
    ax.set_ylabel("calls")
    ax.set_title("latency of one 64 KiB block")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "latency_64k.png"), dpi=100)
    plt.close(fig)
    made.append("latency_64k.png")

    # scaling with decoders and links
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for t, figs in tr.items():
        dec = figs.get("decoders", {})
        ns = sorted(int(k) for k in dec if k.isdigit())
        if ns:
            ax1.plot(ns, [dec[str(n)]["aggregate_gbps"] for n in ns], marker="o", label=f"{t} aggregate")
            ax1.plot(ns, [dec[str(n)]["min_gbps"] for n in ns], marker="x", linestyle="--", label=f"{t} slowest")
        pts = figs.get("links", {}).get("points", [])
        if pts:
            ax2.plot([p["links"] for p in pts], [p["delta_bytes"] / MiB for p in pts], marker="o",
                     label=f"{t} server RSS delta")
    ax1.set_xlabel("decoders pulling from one prompt")
    ax1.set_ylabel("GB/s")
    ax1.set_title("scaling with decoders")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("links")
    ax2.set_ylabel("MiB")
    ax2.set_title("server memory vs links")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=100)
    plt.close(fig)
    made.append("scaling.png")
    return {"files": made}
