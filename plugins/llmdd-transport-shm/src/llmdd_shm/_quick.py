"""The shm channel's planned small transfers (issue 21): one C call per ``pull_blocks`` / ``push_blocks``.

The engine plans a call shape once (which local and remote region each tensor pair uses, the block
size, the two caches' block counts, the direction) and asks the channel for a *prepared transfer* (the seam's ``Channel.prepare``):
:meth:`ShmChannel.prepare <llmdd_shm._channel.ShmChannel.prepare>` resolves the regions against the
endpoint's table (:meth:`ShmEndpoint.quick_locals <llmdd_shm._endpoint.ShmEndpoint.quick_locals>`, under the
endpoint's lock) and its own (under its lock), each as a :class:`QuickTables`, and :func:`pack_plan` packs
what ``_shmfast.quick`` needs (bases, sizes, the peer's slots and generations, the lock range,
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

import struct
from typing import NamedTuple, Sequence

from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

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


class QuickTables(NamedTuple):
    """One side's part of a plan, read under its owner's lock: the address of its counters (word
    :data:`QC_VERSION` the version the C call compares), that version now, and its regions as
    ``region id -> tuple`` (local: ``(address, size)``; remote: ``(base, size, kind, slot, generation)``)."""

    counters_addr: int
    version: int
    regions: dict


def pack_plan(pairs: Sequence[tuple[int, int]], local: QuickTables, remote: QuickTables, *, ctl_addr: int,
              push: bool, pid: int, pidfd: int, lock_fd: int, block_bytes: int, src_units: int, dst_units: int,
              iov_max: int, max_bytes: int) -> bytes:
    """The plan ``_shmfast.quick`` takes for one shape (header, one row per pair, the peer's slots)."""
    body = []
    slots: dict[int, int] = {}
    for lid, rid in pairs:
        laddr, lsize = local.regions[lid]
        raddr, rsize, kind, slot, gen = remote.regions[rid]
        body.append(_PAIR.pack(laddr, lsize, raddr, rsize, kind))
        slots.setdefault(slot, gen)
    slot_lo, slot_hi = min(slots), max(slots) + 1
    head = _HDR.pack(QUICK_MAGIC, local.counters_addr, local.version, remote.counters_addr, remote.version,
                     int(ctl_addr), int(bool(push)), int(pid), int(pidfd), int(lock_fd), block_bytes, src_units,
                     dst_units, len(pairs), len(slots), int(iov_max), max_bytes, slot_lo, slot_hi)
    return head + b"".join(body) + b"".join(_SLOT.pack(s, g) for s, g in sorted(slots.items()))
