"""Units, statistics, memory readings and the data pattern shared by every bench process.

Conventions: GB/s is 1e9 B/s on the wall clock (``time.perf_counter``) around the data
movement only; buffers are allocated and pre-faulted before timing.  Bandwidths are the
median of the timed runs after warm-up; latencies are reported as p50 / p99.

The data pattern makes every 8-byte word of a buffer carry its own position plus a salt
(``word[i] = salt + i``), so a receiver can check any block it got against the block
table without a copy of the source: block ``b`` of tensor ``t`` starts with word
``salt + (t * tensor_bytes + b * block_bytes) / 8``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Iterable, Optional

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def bw_summary(seconds: Iterable[float], nbytes: int) -> dict:
    """GB/s statistics of timed runs that each moved ``nbytes``."""
    rates = [gbps(nbytes, s) for s in seconds]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "n": len(rates),
            "all": [round(r, 4) for r in rates], "bytes": nbytes, "unit": "GB/s"}


def lat_summary(us: Iterable[float]) -> dict:
    """Latency statistics in microseconds: p50 (also ``median``), p99, min, max, mean."""
    s = sorted(us)
    n = len(s)

    def pct(p: float) -> float:
        return s[min(n - 1, int(round(p * (n - 1))))]

    return {"p50": pct(0.5), "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "min": s[0], "max": s[-1],
            "mean": statistics.fmean(s), "n": n, "unit": "us",
            "hist": _histogram(s)}


def _histogram(sorted_us: list) -> dict:
    """A log-spaced histogram (for the latency plot), small enough for the JSON."""
    lo, hi = max(sorted_us[0], 0.1), max(sorted_us[-1], 0.2)
    edges = np.geomspace(lo, hi * 1.0001, 41)
    counts, _ = np.histogram(np.asarray(sorted_us), bins=edges)
    return {"edges": [round(float(e), 3) for e in edges], "counts": [int(c) for c in counts]}


def rss_bytes(pid: Optional[int] = None) -> int:
    """Resident set size of ``pid`` (this process by default) from ``/proc/<pid>/statm``."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def prefault(buf: np.ndarray) -> None:
    """Touch every page of a writable uint8 buffer so timing excludes first-touch faults."""
    buf[::4096] = 0
    if len(buf):
        buf[-1] = 0


def fill_pattern(buf: np.ndarray, salt: int) -> None:
    """``word[i] = salt + i`` over the whole uint8 buffer (its length a multiple of 8)."""
    words = buf.view(np.uint64)
    step = 1 << 24
    for lo in range(0, len(words), step):
        hi = min(len(words), lo + step)
        np.add(np.arange(lo, hi, dtype=np.uint64), np.uint64(salt), out=words[lo:hi])


def check_blocks(buf: np.ndarray, num_tensors: int, tensor_bytes: int, block_bytes: int, dst_blocks,
                 src_blocks, salt: int, full_sample: int = 16, seed: int = 0,
                 src_tensor_bytes: Optional[int] = None) -> dict:
    """Check that block ``dst_blocks[i]`` of every tensor of ``buf`` holds source block ``src_blocks[i]``
    of the same tensor (pattern with ``salt``; the source's tensors are ``src_tensor_bytes`` apart,
    ``tensor_bytes`` by default): first and last word of every block, and every word of
    ``full_sample`` random (tensor, block) pairs.  Returns ``{"verified": bool, "blocks": n, ...}``."""
    w = block_bytes // 8
    tw = (src_tensor_bytes or tensor_bytes) // 8
    dst = np.asarray(dst_blocks, dtype=np.int64)
    src = np.asarray(src_blocks, dtype=np.uint64)
    nb = tensor_bytes // block_bytes
    view = buf[:num_tensors * tensor_bytes].view(np.uint64).reshape(num_tensors, nb, w)
    base = (np.arange(num_tensors, dtype=np.uint64)[:, None] * np.uint64(tw)
            + src[None, :] * np.uint64(w) + np.uint64(salt))
    first_ok = np.array_equal(view[:, dst, 0], base)
    last_ok = np.array_equal(view[:, dst, w - 1], base + np.uint64(w - 1))
    rng = np.random.default_rng(seed)
    full_ok = True
    for _ in range(min(full_sample, num_tensors * len(dst))):
        t = int(rng.integers(num_tensors))
        i = int(rng.integers(len(dst)))
        want = np.arange(w, dtype=np.uint64) + base[t, i]
        if not np.array_equal(view[t, dst[i]], want):
            full_ok = False
            break
    return {"verified": bool(first_ok and last_ok and full_ok), "blocks": int(num_tensors * len(dst)),
            "first_last_ok": bool(first_ok and last_ok), "full_sample_ok": full_ok}


def check_contiguous(buf: np.ndarray, nbytes: int, salt: int, samples: int = 64) -> bool:
    """Check that ``buf[:nbytes]`` holds the pattern with ``salt`` (every 4099th word and the ends)."""
    words = buf[:nbytes].view(np.uint64)
    n = len(words)
    idx = np.unique(np.concatenate([np.arange(0, n, 4099, dtype=np.int64), [0, n - 1]]))
    if not np.array_equal(words[idx], idx.astype(np.uint64) + np.uint64(salt)):
        return False
    rng = np.random.default_rng(samples)
    for _ in range(samples):
        lo = int(rng.integers(0, max(1, n - 8192)))
        if not np.array_equal(words[lo:lo + 8192], np.arange(lo, lo + 8192, dtype=np.uint64) + np.uint64(salt)):
            return False
    return True


def load_average() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class Progress:
    """Plain-text progress on stderr: one line per step, with elapsed time and a bar."""

    def __init__(self, total: int, stream=None, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.done = 0
        self.began = time.monotonic()
        self.stream = stream or sys.stderr
        self.enabled = enabled

    def step(self, label: str) -> None:
        self.done = min(self.total, self.done + 1)
        self._print(label)

    def note(self, label: str) -> None:
        self._print(label)

    def _print(self, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        print(f"[{bar}] {self.done:3d}/{self.total} {time.monotonic() - self.began:6.1f}s  {label}",
              file=self.stream, flush=True)
