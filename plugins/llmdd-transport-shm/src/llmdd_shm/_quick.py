"""The shm channel's planned small transfers (issue 21): one C call per ``pull_blocks`` / ``push_blocks``.

The engine plans a call shape once (which local and remote region each tensor pair uses, the block
size, the two caches' block counts, the direction) and asks the channel for a *prepared transfer* (the seam's ``Channel.prepare``):
:func:`prepare` resolves the regions against the endpoint's and the channel's current tables and
packs what ``_shmfast.quick`` needs (bases, sizes, the peer's slots and generations, the lock range,
the pidfd, a lock fd, the two tables' versions and the addresses of the counters it bumps) into one
``bytes``.  A call then hands the C function that plan and the two block lists; it returns the bytes
moved, or a negative status when it did not do the transfer (a block out of range, a table changed
since the plan was built, the owner holding its lock, the peer gone, a stale generation, a failed
``process_vm_*``), and the caller takes the ops path, which does the transfer or reports the error
as the contract says.

Safety: the plan carries addresses, so it is only valid while the tables it was built from are the
current ones; every change of either table, and the close of the endpoint or the channel, bumps a
version word the C call compares first, and the C call keeps the GIL for its whole length (the plan's
byte limit is at most ``llmdd.shm.native_gil_bytes``), so no Python thread can deregister a region,
unmap a segment or close an fd while it runs.  The lock fd is the channel's own, used only under the
GIL by this path (OFD locks belong to the open file description: no other batch shares it).
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Callable, Optional, Sequence

from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from . import _seg
from ._format import KIND_CMA

#: the C side's header: magic, ep_ctr, ep_ver, ch_ctr, ch_ver, ctl_addr, write, pid, pidfd, lock_fd,
#: bs, su, du, npairs, nslots, iov_max, max_bytes, slot_lo, slot_hi (see _shmfast.c, qhdr_t)
_HDR = struct.Struct("<6Q4q9Q")
_PAIR = struct.Struct("<5Q")
_SLOT = struct.Struct("<2Q")
QUICK_MAGIC = 0x4B43495551444D4C  # "LMDQUICK"
#: the counters both sides keep for the C path: word 0 the table version, then the statistics
QC_VERSION, QC_BATCHES, QC_BYTES_READ, QC_BYTES_WRITTEN, QC_OPS_READ, QC_OPS_WRITTEN, QC_CMA_CALLS = range(7)
QC_WORDS = 8


def counters() -> np.ndarray:
    """A fresh counter array (kept by an endpoint or a channel for its whole life)."""
    return np.zeros(QC_WORDS, np.uint64)


def bump(qc: np.ndarray) -> None:
    """Invalidate every quick plan built on the table that ``qc`` versions (call with the table's lock held,
    before any mapping, fd or region the plans name goes away)."""
    qc[QC_VERSION] += np.uint64(1)


def merged(stats: dict, qc: np.ndarray, *, channel: bool) -> dict:
    """``stats`` with the C path's counters added."""
    q = qc.tolist()
    stats["batches"] = stats.get("batches", 0) + q[QC_BATCHES]
    stats["quick_batches"] = q[QC_BATCHES]
    if channel:
        stats["native_batches"] = stats.get("native_batches", 0) + q[QC_BATCHES]
        stats["bytes_read"] += q[QC_BYTES_READ]
        stats["bytes_written"] += q[QC_BYTES_WRITTEN]
        stats["ops_read"] += q[QC_OPS_READ]
        stats["ops_written"] += q[QC_OPS_WRITTEN]
        stats["cma_calls"] = stats.get("cma_calls", 0) + q[QC_CMA_CALLS]
    return stats


def prepare(ch: Any, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int, dst_units: int,
               push: bool) -> Optional[Callable[[Any, Any], int]]:
    """``f(src_blocks, dst_blocks) -> bytes moved, or < 0: not done, take the ops path`` for this shape
    on channel ``ch``, or None when the C path cannot take it (no extension, no pidfd, a region not in
    the tables now, too many pairs, a block larger than the single-call limit)."""
    nat = ch._native
    quick = getattr(nat, "quick", None)
    if quick is None or ch._pidfd < 0 or not 0 < len(pairs) <= nat.QUICK_MAX_PAIRS:
        return None
    bs, su, du = int(block_bytes), int(src_units), int(dst_units)
    max_bytes = min(int(ch._nlimit), int(ch._ngil))
    if bs <= 0 or su <= 0 or du <= 0 or bs > max_bytes:
        return None
    ep = ch._ep
    with ep._lock:   # the local table and its version together
        if ep._closed or ep._native is None:
            return None
        ep_ver = int(ep._qc[QC_VERSION])
        local = {}
        for lid, _ in pairs:
            reg = ep._regs.get(int(lid))
            if reg is None:
                return None
            local[lid] = (int(reg.region.addr), int(reg.region.size))
    with ch._lock:   # the remote table, its version and the channel's lock fd together
        if ch._batches.closed:
            return None
        remote = {}
        for _, rid in pairs:
            rem = ch._remote.get(int(rid))
            if rem is None or not rem.accessible or rem.slot < 0 or (rem.kind == KIND_CMA and not ch._cma_ok):
                return None
            remote[rid] = (int(rem.base), int(rem.size), int(rem.kind), int(rem.slot), int(rem.gen))
        ch_ver = int(ch._qc[QC_VERSION])
        if ch._qfd < 0:
            try:
                ch._qfd = _seg.open_fd(ch._ctl_name)
            except OSError:
                return None
        fd = ch._qfd
    body = []
    slots: dict[int, int] = {}
    for lid, rid in pairs:
        laddr, lsize = local[lid]
        raddr, rsize, kind, slot, gen = remote[rid]
        body.append(_PAIR.pack(laddr, lsize, raddr, rsize, kind))
        slots.setdefault(slot, gen)
    slot_lo, slot_hi = min(slots), max(slots) + 1
    head = _HDR.pack(QUICK_MAGIC, ep._qc.ctypes.data, ep_ver, ch._qc.ctypes.data, ch_ver, int(ch._ctl_addr),
                     int(bool(push)), int(ch._pid), int(ch._pidfd), int(fd), bs, su, du, len(pairs), len(slots),
                     int(ch._iov_max), max_bytes, slot_lo, slot_hi)
    plan = head + b"".join(body) + b"".join(_SLOT.pack(s, g) for s, g in sorted(slots.items()))
    return functools.partial(quick, plan)
