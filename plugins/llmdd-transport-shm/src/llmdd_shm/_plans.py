"""A validated shm batch as a copy plan: :class:`_Plan` (numpy address arrays: coalesced, capped, chunked,
split across the copy threads) and :class:`_FewPlan` (a few ops as Python ints, the latency path), with
the array helpers :func:`_cap`, :func:`_chunks` and :func:`_split_arrays`."""

from __future__ import annotations

import ctypes
import errno
import os
from typing import TYPE_CHECKING, Union

from llmdd.lowlevel import copy_runs
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from ._cma import IOV_MAX, CmaError, iovecs
from ._config import OPT_CHUNK
from ._format import KIND_CMA, KIND_SHM
from ._hotpath import _ST_CMA, _ST_NOPROGRESS


if TYPE_CHECKING:  # annotations only: the channel runs the plans
    from ._channel import ShmChannel
    from ._endpoint import _Batch


class _Plan:
    """A validated batch as address arrays: mapped-segment runs and CMA iovecs, chunked."""

    __slots__ = ("n", "total", "slots", "gens", "rids", "slot_range", "mlocal", "mremote", "mlen",
                 "clocal", "cremote", "clen")

    def __init__(self, ops: np.ndarray, laddr: np.ndarray, rbase: np.ndarray, rkind: np.ndarray,
                 slots: np.ndarray, gens: np.ndarray, rids: np.ndarray) -> None:
        self.slots = slots
        self.gens = gens
        self.rids = rids
        self.slot_range = (int(slots.min()), int(slots.max()) + 1) if len(slots) else (0, 1)
        la = laddr + ops["local_offset"]
        ra = rbase + ops["remote_offset"]
        ln = ops["length"]
        if len(ops) > 1:
            # coalesce ops that continue each other on both sides, in the order given (the engine's
            # planner emits a table's blocks in order and has merged those runs already): no sort,
            # which cost 8 ms per 16384 ops (a GiB of 64 KiB blocks), more than the iovecs it saved
            cont = (rkind[1:] == rkind[:-1]) & (la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])
            if cont.any():
                starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                la, ra, rkind = la[starts], ra[starts], rkind[starts]
                ln = np.add.reduceat(ln, starts)
        keep = ln > 0
        if not keep.all():
            la, ra, ln, rkind = la[keep], ra[keep], ln[keep], rkind[keep]
        m = rkind == KIND_SHM
        if m.all():
            self._set(la, ra, ln, None, None, None)
        elif not m.any():
            self._set(None, None, None, la, ra, ln)
        else:
            c = ~m
            self._set(la[m], ra[m], ln[m], la[c], ra[c], ln[c])

    def _set(self, ml, mr, mn, cl, cr, cn) -> None:
        e = np.empty(0, np.uint64)
        self.mlocal, self.mremote, self.mlen = (e, e, e) if ml is None else (ml, mr, mn)
        self.clocal, self.cremote, self.clen = (e, e, e) if cl is None else (cl, cr, cn)
        self.n = len(self.mlen) + len(self.clen)
        self.total = int(self.mlen.sum(dtype=np.uint64)) + int(self.clen.sum(dtype=np.uint64))

    def split(self, parts: int) -> list["_Plan"]:
        """At most ``parts`` sub-plans of about equal bytes (each kind split on its own)."""
        out = []
        mp = _split_arrays(self.mlocal, self.mremote, self.mlen, parts)
        cp = _split_arrays(self.clocal, self.cremote, self.clen, parts)
        e = np.empty(0, np.uint64)
        for i in range(max(len(mp), len(cp))):
            p = object.__new__(_Plan)
            p.slots, p.gens, p.rids, p.slot_range = self.slots, self.gens, self.rids, self.slot_range
            ml, mr, mn = mp[i] if i < len(mp) else (e, e, e)
            cl, cr, cn = cp[i] if i < len(cp) else (e, e, e)
            p._set(ml, mr, mn, cl, cr, cn)
            if p.n:
                out.append(p)
        return out or [self]

    def execute(self, ch: ShmChannel, batch: _Batch, write: bool, deadline: float) -> None:
        chunk = int(ch._cfg[OPT_CHUNK])
        if len(self.mlen):
            self._memmove(ch, batch, write, deadline, chunk)
        if len(self.clen):
            self._cma(ch, batch, write, deadline, chunk)

    def _memmove(self, ch: ShmChannel, batch: _Batch, write: bool, deadline: float, chunk: int) -> None:
        la, ra, ln = _cap(self.mlocal, self.mremote, self.mlen, chunk)
        dst, src = (ra, la) if write else (la, ra)
        bounds = _chunks(ln, chunk, IOV_MAX)
        nat = ch._native
        if nat is not None:  # one C call per chunk, no Python object per op
            liov, riov = iovecs(la, ln), iovecs(ra, ln)
            for k, (s, e) in enumerate(bounds):
                if k:
                    ch._check_peer(self, batch, deadline, first=False)
                nat.copy(int(write), 0, KIND_SHM, liov[s:e].ctypes.data, riov[s:e].ctypes.data, e - s)
            return
        for k, (s, e) in enumerate(bounds):   # numpy gathers per chunk (llmdd.lowlevel.copy_runs)
            if k:
                ch._check_peer(self, batch, deadline, first=False)
            copy_runs(dst[s:e], src[s:e], ln[s:e])

    def _cma(self, ch: ShmChannel, batch: _Batch, write: bool, deadline: float, chunk: int) -> None:
        la, ra, ln = _cap(self.clocal, self.cremote, self.clen, chunk)
        liov = iovecs(la, ln)
        riov = iovecs(ra, ln)
        check = lambda: ch._check_peer(self, batch, deadline, first=False)  # noqa: E731
        nat = ch._native
        for k, (s, e) in enumerate(_chunks(ln, chunk, ch._cma.iov_max)):
            if k:
                check()
            if nat is None:
                ch._cma.transfer(ch._pid, liov[s:e], riov[s:e], write=write, between=check)
                continue
            # one C call per chunk (short transfers resumed inside it)
            st, a, b = nat.copy(int(write), ch._pid, KIND_CMA, liov[s:e].ctypes.data, riov[s:e].ctypes.data, e - s)
            call = f"process_vm_{'writev' if write else 'readv'}(pid={ch._pid})"
            if st == _ST_CMA:
                ch._cma.calls += 1
                raise CmaError(a, f"{call}: {os.strerror(a)}")
            if st == _ST_NOPROGRESS:
                ch._cma.calls += 1
                raise CmaError(errno.EFAULT, f"{call} made no progress ({a} bytes left)")
            ch._cma.calls += b


class _FewPlan:
    """A validated batch of at most ``FEW`` ops as Python ints (the latency path).

    Same contract as :class:`_Plan` (``n``, ``total``, ``slots`` / ``gens`` / ``rids`` of the remote
    regions, ``slot_range``, ``execute``), without numpy's fixed per-call costs: mapped-segment ops
    are ``memmove``d, CMA ops go into one ``process_vm_readv`` / ``writev`` with reused ctypes
    iovecs. Ops larger than the chunk size, or a split across threads, go through :meth:`full`.
    """

    __slots__ = ("n", "total", "slots", "gens", "rids", "slot_range", "mm", "cm", "_args")

    def __init__(self, ops: np.ndarray, laddr: list, rl: list, rinfo: dict, used_ids: list) -> None:
        lo, ro, ln = ops["local_offset"].tolist(), ops["remote_offset"].tolist(), ops["length"].tolist()
        mm: list = []
        cm: list = []
        total = 0
        for la, off, rid, roff, n in zip(laddr, lo, rl, ro, ln):
            if n <= 0:
                continue
            base, kind = rinfo[rid][0], rinfo[rid][1]
            (mm if kind == KIND_SHM else cm).append((la + off, base + roff, n))
            total += n
        self.mm, self.cm = mm, cm
        self.n = len(mm) + len(cm)
        self.total = total
        self.rids = used_ids
        self.slots = [rinfo[r][2] for r in used_ids]
        self.gens = [rinfo[r][3] for r in used_ids]
        self.slot_range = (min(self.slots), max(self.slots) + 1) if self.slots else (0, 1)
        self._args = (ops, laddr, rl, rinfo)

    def full(self) -> "_Plan":
        """The same batch as a numpy :class:`_Plan` (chunking, splitting)."""
        ops, laddr, rl, rinfo = self._args
        info = [rinfo[r] for r in rl]
        ids = self.rids
        return _Plan(ops, np.asarray(laddr, np.uint64), np.asarray([i[0] for i in info], np.uint64),
                     np.asarray([i[1] for i in info], np.uint8),
                     np.asarray([rinfo[r][2] for r in ids], np.int64),
                     np.asarray([rinfo[r][3] for r in ids], np.uint32), np.asarray(ids, np.int64))

    def split(self, parts: int) -> list:
        return self.full().split(parts)

    def execute(self, ch: "ShmChannel", batch: _Batch, write: bool, deadline: float) -> None:
        chunk = int(ch._cfg[OPT_CHUNK])
        if any(n > chunk for _, _, n in self.mm) or any(n > chunk for _, _, n in self.cm) \
                or sum(n for _, _, n in self.mm) > chunk or sum(n for _, _, n in self.cm) > chunk:
            self.full().execute(ch, batch, write, deadline)  # checks between chunks
            return
        if self.mm:
            mm = ctypes.memmove
            for la, ra, n in self.mm:
                if write:
                    mm(ra, la, n)
                else:
                    mm(la, ra, n)
        if self.cm:
            if self.mm:
                ch._check_peer(self, batch, deadline, first=False)
            cm = self.cm
            ch._cma.transfer_few(ch._pid, [c[0] for c in cm], [c[1] for c in cm], [c[2] for c in cm], write=write,
                                 between=lambda: ch._check_peer(self, batch, deadline, first=False))


#: either plan of a batch (same contract: n, total, slots / gens / rids, execute)
_AnyPlan = Union[_Plan, _FewPlan]


def _cap(la: np.ndarray, ra: np.ndarray, ln: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ops longer than ``cap`` bytes into pieces of at most ``cap`` (vectorised)."""
    if not len(ln) or int(ln.max()) <= cap:
        return la, ra, ln
    cap_u = np.uint64(cap)
    pieces = ((ln + cap_u - np.uint64(1)) // cap_u).astype(np.int64)
    idx = np.repeat(np.arange(len(ln)), pieces)
    first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    k = (np.arange(len(idx)) - np.repeat(first, pieces)).astype(np.uint64)
    off = k * cap_u
    return la[idx] + off, ra[idx] + off, np.minimum(ln[idx] - off, cap_u)


def _chunks(ln: np.ndarray, chunk_bytes: int, max_ops: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` index ranges of at most ``max_ops`` ops and about ``chunk_bytes``."""
    n = len(ln)
    if n <= max_ops and int(ln.sum(dtype=np.uint64)) <= chunk_bytes:
        return [(0, n)]
    ends = np.cumsum(ln, dtype=np.uint64)
    out = []
    s = 0
    while s < n:
        base = int(ends[s - 1]) if s else 0
        e = int(np.searchsorted(ends, np.uint64(base + chunk_bytes), side="right"))
        e = min(max(e, s + 1), s + max_ops, n)
        out.append((s, e))
        s = e
    return out


def _split_arrays(la: np.ndarray, ra: np.ndarray, ln: np.ndarray, parts: int) -> list:
    if not len(ln):
        return []
    if parts <= 1 or len(ln) < 2:
        return [(la, ra, ln)]
    ends = np.cumsum(ln, dtype=np.uint64)
    total = int(ends[-1])
    cuts = np.searchsorted(ends, [total * k // parts for k in range(1, parts)], side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(ln) - 1)).tolist()
    bounds = [0] + cuts + [len(ln)]
    return [(la[a:b], ra[a:b], ln[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
