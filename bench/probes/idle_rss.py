#!/usr/bin/env python3
"""Idle engine memory (issue 22, target 5): whole-process RSS of an idle engine, and RSS per link.

* idle: a fresh interpreter imports llmdd, builds an engine as the bench worker does (cache manager on,
  remote cache access on, listening on loopback) and inits it; after a collection its RSS is read from
  /proc/self/statm.  Also recorded: the RSS right after ``import llmdd``, the number of modules and
  threads, whether structlog/asyncio got loaded, the largest mappings (/proc/self/smaps), and the same
  idle RSS with each installed plugin left out (``LLMDD_DISABLED_PLUGINS``), which is what each plugin
  costs.  Target: <= 45 MiB.
* per link: ``llmdd._tools.bench.scaling`` (one real server engine, synthetic clients speaking the real
  protocol, each link from its own loopback address): the server's RSS growth from 1 to 1 + N links,
  divided by N.  Target: <= 64 KiB per link.

Run: ``python bench/probes/idle_rss.py [--links 16] [--out FILE.json]``.  The library never prints; this
script does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

MiB = 1 << 20
KiB = 1 << 10
IDLE_MAX_BYTES = 45 * MiB
PER_LINK_MAX_BYTES = 64 * KiB

def measure_idle(env: Optional[dict] = None, timeout: float = 120.0) -> dict:
    """One idle engine in a fresh interpreter; its numbers (llmdd._tools.bench.idle, which llmdd bench uses too)."""
    from llmdd._tools.bench.idle import measure_idle as measure

    return measure(env, timeout)


def installed_plugins() -> list[str]:
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group="llmdd"))


def measure_per_link(links: int = 16, processes: int = 2) -> dict:
    """Server RSS growth per link from 1 to 1 + ``links`` links (llmdd._tools.bench.scaling)."""
    from llmdd._tools.bench.scaling import run_scaling

    result = run_scaling((1, 1 + links), processes=processes, probes=3)
    points = result["points"]
    lo, hi = points[0], points[-1]
    per_link = (hi["rss_bytes"] - lo["rss_bytes"]) / max(1, hi["links"] - lo["links"])
    return {"links_from": lo["links"], "links_to": hi["links"], "rss_from": lo["rss_bytes"],
            "rss_to": hi["rss_bytes"], "rss_per_link_bytes": per_link, "client_errors": result["client_errors"],
            "threads": result.get("threads")}


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="idle measurements (fresh interpreters)")
    ap.add_argument("--no-plugin-breakdown", action="store_true")
    ap.add_argument("--trace-top", type=int, default=25, help="tracemalloc: the N largest files (0: skip)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    load_before = _load()
    idle = [measure_idle() for _ in range(args.repeat)]
    rss = sorted(x["rss_idle"] for x in idle)
    median = rss[len(rss) // 2]
    breakdown = {}
    if not args.no_plugin_breakdown:
        for name in installed_plugins():
            without = measure_idle({"LLMDD_DISABLED_PLUGINS": name})["rss_idle"]
            breakdown[name] = {"rss_idle_without": without, "plugin_cost_bytes": median - without}
        breakdown["(no plugin autoload)"] = {
            "rss_idle_without": measure_idle({"LLMDD_DISABLE_PLUGIN_AUTOLOAD": "1"})["rss_idle"]}
    traced = measure_idle({"LLMDD_IDLE_TRACE": str(args.trace_top)}) if args.trace_top else None
    link = measure_per_link(args.links) if args.links else None
    doc = {
        "bench": "idle_rss",
        "command": " ".join(([f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else [])
                            + [os.path.basename(sys.executable), "bench/probes/idle_rss.py", *(argv or sys.argv[1:])]),
        "llmdd": __import__("llmdd").__file__,
        "load_before": load_before, "load_after": _load(), "cpus": os.cpu_count(),
        "idle": {"runs": idle, "rss_idle_median": median, "target_max": IDLE_MAX_BYTES,
                 "met": median <= IDLE_MAX_BYTES},
        "plugins": breakdown,
        "tracemalloc": None if traced is None else {k: traced[k] for k in ("traced_bytes", "tracemalloc_top")},
        "per_link": None if link is None else {**link, "target_max": PER_LINK_MAX_BYTES,
                                              "met": link["rss_per_link_bytes"] <= PER_LINK_MAX_BYTES},
    }
    print(f"idle engine RSS median {median / MiB:.1f} MiB (target <= {IDLE_MAX_BYTES / MiB:.0f}); "
          f"after import {idle[0]['rss_after_import'] / MiB:.1f} MiB; modules {idle[0]['modules']}")
    for name, b in breakdown.items():
        cost = b.get("plugin_cost_bytes")
        print(f"  without {name}: {b['rss_idle_without'] / MiB:.1f} MiB"
              + ("" if cost is None else f" (plugin costs {cost / MiB:.1f} MiB)"))
    if traced:
        print(f"tracemalloc: {traced['traced_bytes'] / MiB:.1f} MiB of Python objects in an idle engine")
    if link:
        print(f"per link: {link['rss_per_link_bytes'] / KiB:.1f} KiB over {link['links_to'] - link['links_from']} "
              f"links (target <= {PER_LINK_MAX_BYTES / KiB:.0f})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
