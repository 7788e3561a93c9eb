"""llmdd.lowlevel.copy_runs (the shm plugin's pure-Python copy, the tcp plugin's TLS staging) between two
16 MiB buffers: mixed run lengths, unaligned addresses, seeded bytes, the bytes around the runs untouched,
and which runs took the numpy gather and which a memmove.  (The shm plugin's conformance suite runs it
over real shared-memory mappings of another endpoint, its python variant.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from llmdd._base import runs as _copy

SLOT = 1 << 16
SIZE = 256 * SLOT   # 16 MiB per mapping


class _Buf:
    def __init__(self, arr: np.ndarray) -> None:
        self.addr = arr.ctypes.data


@pytest.fixture
def mappings():
    bufs = [np.empty(SIZE, np.uint8) for _ in range(2)]
    return bufs, [_Buf(b) for b in bufs]


def _layout(rng: np.random.Generator, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination offsets: each run in its own destination slot (no two overlap), at an
    unaligned offset inside it; sources anywhere (they may overlap each other)."""
    slots = rng.choice(SIZE // SLOT, len(lengths), replace=False).astype(np.uint64)
    dst = slots * np.uint64(SLOT) + rng.integers(0, SLOT - lengths + 1).astype(np.uint64)
    src = rng.integers(0, SIZE - lengths + 1).astype(np.uint64)
    return src, dst


def _mismatches(src_b, dst_b, before, so, do, ln) -> list:
    """Runs whose destination differs from their source, and whether any byte outside the runs changed."""
    bad = [i for i, (s, d, n) in enumerate(zip(so.tolist(), do.tolist(), ln.tolist()))
           if not np.array_equal(dst_b[d:d + n], src_b[s:s + n])]
    outside = np.ones(SIZE, bool)
    for d, n in zip(do.tolist(), ln.tolist()):
        outside[d:d + n] = False
    return bad + (["outside"] if not np.array_equal(dst_b[outside], before[outside]) else [])


def test_copy_runs_moves_every_run_and_nothing_else(mappings, monkeypatch):
    (src_b, dst_b), (sm, dm) = mappings
    rng = np.random.default_rng(1717)
    src_b[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    dst_b[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    before = dst_b.copy()
    # 64 x 64 B and 40 x 1 KiB (gathered), 5 x 40 KiB (too long: memmove), 3 x 7 B (too few: memmove)
    ln = np.concatenate([np.full(64, 64), np.full(40, 1024), np.full(5, 40960), np.full(3, 7)]).astype(np.uint64)
    ln = ln[rng.permutation(len(ln))]
    so, do = _layout(rng, ln)
    gathers, moves = [], []
    real_gather, real_mm = _copy._gather, ctypes.memmove
    monkeypatch.setattr(_copy, "_gather", lambda d, s, n: (gathers.append((len(d), n)), real_gather(d, s, n)))
    monkeypatch.setattr(ctypes, "memmove", lambda d, s, n: (moves.append(n), real_mm(d, s, n)))
    _copy.copy_runs(do + np.uint64(dm.addr), so + np.uint64(sm.addr), ln)
    assert _mismatches(src_b, dst_b, before, so, do, ln) == []
    assert sorted(gathers) == [(40, 1024), (64, 64)]
    assert sorted(moves) == [7] * 3 + [40960] * 5


def test_the_check_sees_a_wrong_copy(mappings):
    """Control: the same check fails when one run is copied from the wrong source byte."""
    (src_b, dst_b), (sm, dm) = mappings
    rng = np.random.default_rng(1718)
    src_b[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    dst_b[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    before = dst_b.copy()
    ln = np.full(32, 512, np.uint64)
    so, do = _layout(rng, ln)
    wrong = so.copy()
    wrong[7] = wrong[7] + np.uint64(1) if wrong[7] + 512 < SIZE else wrong[7] - np.uint64(1)
    _copy.copy_runs(do + np.uint64(dm.addr), wrong + np.uint64(sm.addr), ln)
    assert _mismatches(src_b, dst_b, before, so, do, ln) == [7]


@pytest.mark.parametrize("n", [1, 31, 32, 256])
def test_copy_runs_any_count_of_one_length(mappings, monkeypatch, n):
    """Below, at and above the gather's minimum count, one length: every run lands, in one gather from
    the minimum count on."""
    (src_b, dst_b), (sm, dm) = mappings
    gathers = []
    real_gather = _copy._gather
    monkeypatch.setattr(_copy, "_gather", lambda d, s, k: (gathers.append(len(d)), real_gather(d, s, k)))
    rng = np.random.default_rng(n)
    src_b[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    dst_b[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    before = dst_b.copy()
    ln = np.full(n, _copy.GATHER_MAX_LEN, np.uint64)
    so, do = _layout(rng, ln)
    _copy.copy_runs(do + np.uint64(dm.addr), so + np.uint64(sm.addr), ln)
    assert _mismatches(src_b, dst_b, before, so, do, ln) == []
    assert gathers == ([n] if n >= _copy.GATHER_MIN_OPS else [])
