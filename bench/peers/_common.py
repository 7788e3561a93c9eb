"""Shared by the peer scripts of this directory: sizes, the data pattern, timing, JSON lines.

These scripts run in their own virtual environment (numpy and the peer's wheel, no llmdd), so
they carry their own small helpers instead of importing llmdd's.

Output: one JSON object per line in ``<out>/<script>.jsonl``.  A measurement line has ``name``
(the key ``llmdd bench --report --peers`` knows it by), ``label``, ``median`` (GB/s = 1e9 B/s,
or the p50 in microseconds for a latency), ``unit``, every run's value in ``all`` and
``verified`` (the moved bytes were checked against the source pattern).  Other lines carry
``"unit": "info"`` (versions, set-up costs, failures).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
NUM_TENSORS = 64  # 32 layers x (K, V), as in llmdd bench
HOST = "127.0.0.1"


def kv_layout(total: int, block: int) -> tuple:
    """(tensors, blocks per tensor) of a KV cache of ``total`` bytes in ``block``-byte blocks."""
    return NUM_TENSORS, total // NUM_TENSORS // block


def fill(buf) -> None:
    """word[i] = i over a uint8 numpy buffer (length a multiple of 8)."""
    import numpy as np

    w = buf.view(np.uint64)
    step = 1 << 24
    for lo in range(0, len(w), step):
        hi = min(len(w), lo + step)
        w[lo:hi] = np.arange(lo, hi, dtype=np.uint64)


def touch(buf) -> None:
    """Fault in every page before timing."""
    buf[::4096] = 0
    if len(buf):
        buf[-1] = 0


def blocks_ok(buf, tensors: int, per: int, block: int, src_ids, dst_ids) -> bool:
    """First and last word of every destination block hold the source block's words."""
    import numpy as np

    w = block // 8
    view = buf[:tensors * per * block].view(np.uint64).reshape(tensors, per, w)
    base = (np.arange(tensors, dtype=np.uint64)[:, None] * np.uint64(per)
            + np.asarray(src_ids, dtype=np.uint64)[None, :]) * np.uint64(w)
    return bool(np.array_equal(view[:, dst_ids, 0], base) and np.array_equal(view[:, dst_ids, w - 1],
                                                                               base + np.uint64(w - 1)))


def contiguous_ok(buf, nbytes: int) -> bool:
    import numpy as np

    w = buf[:nbytes].view(np.uint64)
    idx = np.arange(0, len(w), 4099, dtype=np.int64)
    return bool(np.array_equal(w[idx], idx.astype(np.uint64)) and int(w[-1]) == len(w) - 1)


def percentile(sorted_vals: list, p: float) -> float:
    return sorted_vals[min(len(sorted_vals) - 1, int(round(p * (len(sorted_vals) - 1))))]


class Output:
    """Appends JSON lines to ``<directory>/<script>.jsonl`` and echoes a short line on stdout."""

    def __init__(self, directory: str, script: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{script}.jsonl")
        self.script = script
        self.info("machine", nproc=os.cpu_count(), kernel=platform.release(), python=platform.python_version(),
                  load=[round(x, 2) for x in os.getloadavg()])

    def _write(self, row: dict) -> None:
        row = dict(row, script=self.script, utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def info(self, what: str, **fields) -> None:
        self._write(dict(fields, name=f"{self.script}: {what}", unit="info"))
        print(f"{what}: {fields}", flush=True)

    def bandwidth(self, name: str, label: str, nbytes: int, seconds: list, verified: bool, **extra) -> None:
        rates = [nbytes / s / 1e9 for s in seconds]
        self._write(dict(extra, name=name, label=label, unit="GB/s", median=statistics.median(rates),
                         min=min(rates), max=max(rates), all=[round(r, 4) for r in rates], bytes=nbytes,
                         verified=verified))
        print(f"{label}: {statistics.median(rates):.2f} GB/s (runs {', '.join(f'{r:.2f}' for r in rates)}), "
              f"verified={verified}", flush=True)

    def latency(self, name: str, label: str, us: list, verified: bool, **extra) -> None:
        s = sorted(us)
        self._write(dict(extra, name=name, label=label, unit="us", median=percentile(s, 0.5),
                         p50=percentile(s, 0.5), p99=percentile(s, 0.99), min=s[0], max=s[-1], n=len(s),
                         verified=verified))
        print(f"{label}: p50 {percentile(s, 0.5):.1f} us, p99 {percentile(s, 0.99):.1f} us, verified={verified}",
              flush=True)
