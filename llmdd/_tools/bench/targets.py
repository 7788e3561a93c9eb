"""The performance targets (``targets.toml`` beside this module) and their verdicts on bench results.

A target names a figure of ``results.json`` by path (or a ratio of two paths), a goal and where
the goal comes from.  :func:`evaluate` gives one run's verdicts; :func:`aggregate` gives the
verdicts over several runs: the median of the runs that measured the figure, every run's value
kept beside it.  The file is the only place a goal is written.
"""

from __future__ import annotations

import operator
import os
import statistics
import tomllib
from dataclasses import dataclass
from typing import Any, Optional

TARGETS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets.toml")

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


class TargetsError(ValueError):
    """The targets file is malformed."""


@dataclass(frozen=True)
class Target:
    id: str
    source: str
    title: str
    transports: tuple
    value: str
    goal: str
    unit: str = ""
    scale: float = 1.0

    @property
    def op(self) -> str:
        return self.goal.split()[0]

    @property
    def bound(self) -> float:
        return float(self.goal.split()[1])

    def met(self, v: Optional[float]) -> Optional[bool]:
        return None if v is None else bool(_OPS[self.op](v, self.bound))

    def paths(self, transport: Optional[str]) -> list:
        parts = [p.strip() for p in self.value.split(" / ")]
        return [p.replace("{t}", transport) if transport else p for p in parts]


def load(path: Optional[str] = None) -> list:
    """The targets of ``path`` (default: ``targets.toml`` beside this module), checked."""
    with open(path or TARGETS_FILE, "rb") as f:
        doc = tomllib.load(f)
    out, seen = [], set()
    for i, row in enumerate(doc.get("target", [])):
        try:
            t = Target(id=str(row["id"]), source=str(row["source"]), title=str(row["title"]),
                       transports=tuple(row.get("transports", ())), value=str(row["value"]),
                       goal=str(row["goal"]), unit=str(row.get("unit", "")), scale=float(row.get("scale", 1.0)))
        except KeyError as exc:
            raise TargetsError(f"target {i + 1}: missing {exc.args[0]!r}") from None
        goal = t.goal.split()
        if len(goal) != 2 or goal[0] not in _OPS:
            raise TargetsError(f"target {t.id}: goal {t.goal!r} is not '<op> <number>' (op: {', '.join(_OPS)})")
        try:
            float(goal[1])
        except ValueError:
            raise TargetsError(f"target {t.id}: goal bound {goal[1]!r} is not a number") from None
        if len(t.paths(None)) > 2:
            raise TargetsError(f"target {t.id}: value {t.value!r}: at most one ' / '")
        if t.id in seen:
            raise TargetsError(f"target {t.id}: duplicate id")
        seen.add(t.id)
        out.append(t)
    return out


def lookup(results: Any, path: str) -> Optional[float]:
    """The number at ``path`` (dot-separated keys; integers index lists) in ``results``, or None."""
    node = results
    for key in path.split("."):
        if isinstance(node, dict):
            if key not in node:
                return None
            node = node[key]
        elif isinstance(node, list):
            try:
                node = node[int(key)]
            except (ValueError, IndexError):
                return None
        else:
            return None
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        return None
    return float(node)


def quick(results: dict) -> bool:
    meta = results.get("meta", {})
    return bool(meta.get("quick")) or meta.get("sizes", {}).get("kv_bytes", 1 << 30) < (1 << 30)


def evaluate(results: dict, targets: Optional[list] = None) -> list:
    """One run's verdicts: a row per (target, transport this run measured)."""
    measured = list(results.get("transports", {}))
    out = []
    for t in targets if targets is not None else load():
        for transport in (t.transports or (None,)):
            if transport is not None and transport not in measured:
                continue
            paths = t.paths(transport)
            nums = [lookup(results, p) for p in paths]
            missing = [p for p, n in zip(paths, nums) if n is None]
            value = None
            if not missing:
                value = nums[0] / nums[1] if len(nums) == 2 and nums[1] else (nums[0] if len(nums) == 1 else None)
                if value is not None:
                    value *= t.scale
            note = f"not in this run: {', '.join(missing)}" if missing else ""
            if value is not None and quick(results):
                note = "--quick sizes"
            out.append({"id": t.id, "source": t.source, "target": t.title, "transport": transport or "-",
                        "value": value, "unit": t.unit, "goal": t.goal, "met": t.met(value), "note": note})
    return out


def aggregate(runs: list, targets: Optional[list] = None) -> list:
    """Verdicts over several runs: per (target, transport) the value of every run (None where that run
    did not measure it), their median and the verdict on the median."""
    targets = targets if targets is not None else load()
    per_run = [evaluate(r, targets) for r in runs]
    order: list = []
    rows: dict = {}
    for i, rows_i in enumerate(per_run):
        for row in rows_i:
            key = (row["id"], row["transport"])
            if key not in rows:
                order.append(key)
                rows[key] = dict(row, values=[None] * len(runs), notes=[""] * len(runs))
            rows[key]["values"][i] = row["value"]
            rows[key]["notes"][i] = row["note"]
    by_id = {t.id: t for t in targets}
    out = []
    for key in order:
        row = rows[key]
        got = [v for v in row["values"] if v is not None]
        row["value"] = statistics.median(got) if got else None
        row["met"] = by_id[row["id"]].met(row["value"])
        row["runs_measured"] = len(got)
        missing = sorted({n for n in row["notes"] if n.startswith("not in this run")})
        row["note"] = "; ".join(missing) if not got else (
            f"{len(runs) - len(got)} of {len(runs)} runs did not measure it" if len(got) < len(runs) else "")
        if got and any(n == "--quick sizes" for n in row["notes"]):
            row["note"] = (row["note"] + "; " if row["note"] else "") + "--quick sizes"
        del row["notes"]
        out.append(row)
    return out
