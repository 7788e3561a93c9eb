"""Reads the NIXL / Mooncake results (JSON lines) that ``bench/run_peers.sh`` writes.

The peers are measured by ``bench/peers/nixl_peer.py`` and ``bench/peers/mooncake_peer.py`` in
a separate virtual environment; each JSON line carries a ``name`` (a key of
:data:`.report.PEERS`) and a ``median`` (GB/s, or the p50 in us for latencies) and whether the
moved bytes were checked.  Lines with other names are kept as information; when a name appears
in several files, the last one read wins.  ``status.txt`` (what was installed, what failed,
the load) is kept beside the values.
"""

from __future__ import annotations

import glob
import json
import os

from llmdd._tools.bench.report import PEERS


def load_peers(directory: str) -> dict:
    """``{"values": {name: median}, "verified": {name: bool}, "files": [...], "info": [...],
    "status": [lines of status.txt], "load": "..."}`` from ``directory``."""
    values: dict = {}
    verified: dict = {}
    info: list = []
    files = sorted(glob.glob(os.path.join(directory, "**", "*.jsonl"), recursive=True))
    for path in files:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(row, dict):
                    continue
                name = row.get("name")
                if name in PEERS and isinstance(row.get("median"), (int, float)):
                    values[name] = float(row["median"])
                    if "verified" in row:
                        verified[name] = bool(row["verified"])
                else:
                    info.append({k: v for k, v in row.items() if k != "date"})
    status: list = []
    load = None
    spath = os.path.join(directory, "status.txt")
    if os.path.exists(spath):
        with open(spath) as f:
            status = [ln.rstrip("\n") for ln in f if ln.strip()]
        for ln in status:
            if " load " in ln and load is None:
                load = ln.split(" load ", 1)[1].strip()
    return {"values": values, "verified": verified, "files": [os.path.relpath(p, directory) for p in files],
            "info": info, "status": status, "load": load}
