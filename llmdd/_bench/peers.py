"""Reads the NIXL / Mooncake anchor results (JSON lines) that ``bench/run_peers.sh`` writes.

The peers are measured by the anchor scripts in ``../shared/bench`` in a separate virtual
environment; their JSON lines carry a ``name`` and a ``median`` (GB/s, or us for
latencies).  Only the measurements listed in :data:`.report.PEERS` are taken; when a
name appears in several files, the last one read wins.
"""

from __future__ import annotations

import glob
import json
import os

from .report import PEERS


def load_peers(directory: str) -> dict:
    """``{"values": {key: median}, "files": [...], "info": [...]}`` from every ``*.jsonl`` under ``directory``."""
    by_name = {name: key for key, name in PEERS.items()}
    values: dict = {}
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
                key = by_name.get(row.get("name"))
                if key is not None and row.get("median") is not None:
                    values[key] = float(row["median"])
                elif row.get("unit") == "info":
                    info.append({k: v for k, v in row.items() if k not in ("date",)})
    return {"values": values, "files": [os.path.relpath(p, directory) for p in files], "info": info,
            "directory": os.path.abspath(directory)}
