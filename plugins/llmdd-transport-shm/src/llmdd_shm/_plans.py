"""A validated shm batch as a copy plan: :class:`Plan` (numpy address arrays: coalesced, capped),
:class:`_Shared` (its chunks, which one or more copy threads take in turn; :class:`Part` is one
thread's view) and :class:`FewPlan` (a few ops as Python ints, the latency path), with the array
helpers :func:`_cap` and :func:`_bounds`."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
from typing import Any, Protocol, Union

from llmdd.lowlevel import copy_runs
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from ._batch import PinnedBatch
from ._cma import IOV_MAX, Cma, CmaError, iovecs
from ._format import KIND_CMA, KIND_SHM
from ._hotpath import ST_CMA, ST_NOPROGRESS


class PlanChannel(Protocol):
    """What a plan uses of the channel that runs it (:class:`~llmdd_shm._channel.ShmChannel`): the peer's
    pid, the cross-memory-attach caller, the C hot path (or None), the chunk size, and the peer check a
    plan runs between chunks."""

    @property
    def pid(self) -> int: ...

    @property
    def cma(self) -> Cma: ...

    @property
    def native(self) -> Any: ...

    @property
    def chunk_bytes(self) -> int: ...

    def check_peer(self, plan: "AnyPlan", batch: PinnedBatch, deadline: float, *, first: bool) -> None: ...


class Plan:
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

    def share(self, parts: int, chunk: int, iov_max: int) -> list["Part"]:
        """``parts`` workers' views of one :class:`_Shared` list of this plan's chunks (each worker
        takes the next chunk not yet taken, so the threads finish together however fast each runs)."""
        sh = _Shared(self, chunk, iov_max, parts)
        return [Part(sh) for _ in range(max(1, min(parts, len(sh.tasks))))]

    def execute(self, ch: PlanChannel, batch: PinnedBatch, write: bool, deadline: float) -> None:
        """Every chunk in this thread, the peer checked between chunks."""
        Part(_Shared(self, ch.chunk_bytes, ch.cma.iov_max, 1)).execute(ch, batch, write, deadline)


class _Shared:
    """One plan's chunks as a list every copy thread takes from (``tasks``: ``(kind, start, stop, bytes)``,
    kind 0 the mapped-segment runs, 1 the CMA iovecs), the iovecs built once for all of them.

    Split work used to be cut by bytes into one fixed part per thread; on two shared cores one
    thread often ran 10-20% slower than the other and the batch waited for it.  Here a thread takes
    the next chunk (``itertools.count``'s ``__next__``: one atomic step under the GIL), and with more
    than one worker the chunks shrink towards the end (guided: a chunk is at most a ``2 x parts``-th
    of what is left, not below :data:`_MIN_PIECE`), so the last chunks are small.
    """

    __slots__ = ("plan", "tasks", "take", "m", "c", "exhausted")

    def __init__(self, plan: Plan, chunk: int, iov_max: int, parts: int) -> None:
        self.plan = plan
        m = _cap(plan.mlocal, plan.mremote, plan.mlen, chunk)
        c = _cap(plan.clocal, plan.cremote, plan.clen, chunk)
        self.m = (m[0], m[1], m[2], iovecs(m[0], m[2]), iovecs(m[1], m[2]))
        self.c = (iovecs(c[0], c[2]), iovecs(c[1], c[2]))   # CMA chunks need the iovecs only
        ctotal = int(plan.clen.sum(dtype=np.uint64))
        tasks = [(0, s, e, b) for s, e, b in _bounds(m[2], chunk, IOV_MAX, parts, ctotal)] if len(m[2]) else []
        if len(c[2]):
            tasks += [(1, s, e, b) for s, e, b in _bounds(c[2], chunk, iov_max, parts, 0)]
        self.tasks = tasks
        self.take = itertools.count().__next__
        self.exhausted = False  # a worker found every chunk taken (a later one returns without locking)

    def run(self, part: "Part", ch: PlanChannel, batch: PinnedBatch, write: bool, deadline: float) -> None:
        tasks, n = self.tasks, len(self.tasks)
        nat = ch.native
        first = True
        while True:
            k = self.take()
            if k >= n:
                self.exhausted = True
                return
            if not first:
                ch.check_peer(part, batch, deadline, first=False)
            first = False
            kind, s, e, nbytes = tasks[k]
            if kind == 0:
                la, ra, ln, liov, riov = self.m
                if nat is not None:  # one C call per chunk, no Python object per op
                    nat.copy(int(write), 0, KIND_SHM, liov[s:e].ctypes.data, riov[s:e].ctypes.data, e - s)
                elif write:          # numpy gathers per chunk (llmdd.lowlevel.copy_runs)
                    copy_runs(ra[s:e], la[s:e], ln[s:e])
                else:
                    copy_runs(la[s:e], ra[s:e], ln[s:e])
            else:
                self._cma(part, ch, batch, write, deadline, s, e)
            part.moved += nbytes

    def _cma(self, part: "Part", ch: PlanChannel, batch: PinnedBatch, write: bool, deadline: float, s: int, e: int) -> None:
        liov, riov = self.c
        nat = ch.native
        if nat is None:
            ch.cma.transfer(ch.pid, liov[s:e], riov[s:e], write=write,
                             between=lambda: ch.check_peer(part, batch, deadline, first=False))
            return
        # one C call per chunk (short transfers resumed inside it)
        st, a, b = nat.copy(int(write), ch.pid, KIND_CMA, liov[s:e].ctypes.data, riov[s:e].ctypes.data, e - s)
        call = f"process_vm_{'writev' if write else 'readv'}(pid={ch.pid})"
        if st == ST_CMA:
            ch.cma.calls += 1
            raise CmaError(a, f"{call}: {os.strerror(a)}")
        if st == ST_NOPROGRESS:
            ch.cma.calls += 1
            raise CmaError(errno.EFAULT, f"{call} made no progress ({a} bytes left)")
        ch.cma.calls += b


class Part:
    """One worker's view of a :class:`_Shared` plan: the plan's slots for the peer checks, ``n`` the
    chunks not yet taken by anyone (0: the worker returns without locking), ``moved`` its bytes (the
    batch's totals stay the plan's)."""

    __slots__ = ("sh", "slots", "gens", "rids", "slot_range", "moved")

    def __init__(self, sh: _Shared) -> None:
        p = sh.plan
        self.sh = sh
        self.slots, self.gens, self.rids, self.slot_range = p.slots, p.gens, p.rids, p.slot_range
        self.moved = 0

    @property
    def n(self) -> int:
        return 0 if self.sh.exhausted else len(self.sh.tasks)

    def execute(self, ch: PlanChannel, batch: PinnedBatch, write: bool, deadline: float) -> None:
        self.sh.run(self, ch, batch, write, deadline)


class FewPlan:
    """A validated batch of at most ``FEW`` ops as Python ints (the latency path).

    Same contract as :class:`Plan` (``n``, ``total``, ``slots`` / ``gens`` / ``rids`` of the remote
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

    def full(self) -> "Plan":
        """The same batch as a numpy :class:`Plan` (chunking, splitting)."""
        ops, laddr, rl, rinfo = self._args
        info = [rinfo[r] for r in rl]
        ids = self.rids
        return Plan(ops, np.asarray(laddr, np.uint64), np.asarray([i[0] for i in info], np.uint64),
                     np.asarray([i[1] for i in info], np.uint8),
                     np.asarray([rinfo[r][2] for r in ids], np.int64),
                     np.asarray([rinfo[r][3] for r in ids], np.uint32), np.asarray(ids, np.int64))

    def share(self, parts: int, chunk: int, iov_max: int) -> list:
        return self.full().share(parts, chunk, iov_max)

    def execute(self, ch: PlanChannel, batch: PinnedBatch, write: bool, deadline: float) -> None:
        chunk = ch.chunk_bytes
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
                ch.check_peer(self, batch, deadline, first=False)
            cm = self.cm
            ch.cma.transfer_few(ch.pid, [c[0] for c in cm], [c[1] for c in cm], [c[2] for c in cm], write=write,
                                 between=lambda: ch.check_peer(self, batch, deadline, first=False))


#: a batch's plan, or one copy thread's part of a shared one (what a copy thread uses: n, slots / gens /
#: rids, slot_range, execute; a whole plan also has total)
AnyPlan = Union[Plan, FewPlan, Part]


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


def _bounds(ln: np.ndarray, chunk_bytes: int, max_ops: int, parts: int, after: int) -> list[tuple[int, int, int]]:
    """Consecutive chunks ``(start, stop, bytes)`` of at most ``max_ops`` ops and about ``chunk_bytes``
    (one op more than that only when a single op is larger). With ``parts`` > 1 (threads sharing the
    chunks) a chunk is also at most a ``2 x parts``-th of the bytes left, ``after`` (bytes of the
    plan's other kind, taken later) counted, and not below :data:`_MIN_PIECE`."""
    n = len(ln)
    ends = np.cumsum(ln, dtype=np.uint64)
    total = int(ends[-1]) if n else 0
    if parts <= 1 and n <= max_ops and total <= chunk_bytes:
        return [(0, n, total)] if n else []
    floor = min(chunk_bytes, _MIN_PIECE)
    out = []
    s = 0
    base = 0
    while s < n:
        want = chunk_bytes
        if parts > 1:
            want = max(floor, min(chunk_bytes, (total - base + after) // (2 * parts)))
        e = int(np.searchsorted(ends, np.uint64(base + want), side="right"))
        e = min(max(e, s + 1), s + max_ops, n)
        top = int(ends[e - 1])
        out.append((s, e, top - base))
        s, base = e, top
    return out


#: the smallest chunk the copy threads share at a batch's end (a few per-chunk checks per MiB at most)
_MIN_PIECE = 1 << 20
