"""The shm endpoint (:class:`ShmEndpoint`): owns a control segment, registers regions (one slot each when
remote-accessible), opens channels to same-host peers and drains readers before a region or the endpoint
goes; with the exit handler that unlinks the control
segments of endpoints never closed."""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from typing import Any, Mapping as TMapping, Optional, Sequence

import msgspec

from llmdd.abc import Endpoint, EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import Cancelled, MemRegion, RegionRegistry, RegionTable, RegisteredRegion, Refused
from llmdd.lowlevel import encode_payload, get_logger, segment_name
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from . import _quick, _seg
from ._batch import PinnedBatch
from ._channel import ShmChannel
from ._cma import FEW, Cma, probe_cma
from ._config import OPT_NATIVE
from ._format import (CTL_CLOSED, CTL_MAGIC, CTL_OPEN, CTL_SIZE, MAX_SLOTS, PROBE_MAGIC, SLOT_DYING, SLOT_FREE, SLOT_LIVE,
                      VERSION, CtlView, EndpointFields, RegionFields, endpoint_fields, id_words)
from ._host import host_identity
from ._hotpath import native


_log = get_logger("llmdd.transport.shm")


_owned_lock = threading.Lock()
_owned_ctl: set[str] = set()  # control segments of endpoints of this process not closed yet


@atexit.register


def _unlink_owned() -> None:
    """A process that never closed its endpoints leaves no control segment behind (owner only)."""
    with _owned_lock:
        names = list(_owned_ctl)
        _owned_ctl.clear()
    for name in names:
        _seg.unlink(name)


class _LocalReg(RegisteredRegion):
    __slots__ = ("slot", "gen")

    def __init__(self, region: MemRegion, slot: int, gen: int) -> None:
        super().__init__(region)
        self.slot = slot
        self.gen = gen


class ShmEndpoint(Endpoint):
    """Owns a control segment; registers regions; opens channels to same-host peers."""

    def __init__(self, *, cfg: TMapping[str, Any]) -> None:
        self.cfg = dict(cfg)
        self._id = os.urandom(16)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._nb_epoch = 0                 # bumped by every _rebuild: native batches use one snapshot
        self._regs: RegionRegistry[_LocalReg] = RegionRegistry(self._cond, on_rebuild=self._rebuild)
        self._free_slots = list(range(MAX_SLOTS - 1, -1, -1))
        self._gens = np.zeros(MAX_SLOTS, np.uint32)
        self._user_regions = 0
        self._channels: set[ShmChannel] = set()
        self._closed = False
        self._cma = Cma()
        self._cma_info = probe_cma()
        self.native = None if self.cfg.get(OPT_NATIVE) == "off" else native
        self._nb_count: dict[int, int] = {}  # epoch -> native batches running on that snapshot
        self._qc = _quick.counters()  # the quick path's table version and counters (llmdd_shm._quick)
        self._rebuild(self._regs)
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"regions": 0, "channels": 0, "batches": 0, "refused": 0, "last_error": None}
        self._ctl_name = segment_name("shmctl", self._id.hex()[:12])
        self._ctl_map = _seg.create(self._ctl_name, CTL_SIZE)
        with _owned_lock:
            _owned_ctl.add(self._ctl_name)
        self._ctl = CtlView(self._ctl_map)
        lo, hi = id_words(self._id)
        self._ctl.hdr[:] = [0, VERSION, CTL_OPEN, os.getpid(), lo, hi, MAX_SLOTS, 0]
        self._ctl.hdr[0] = CTL_MAGIC  # written last: a reader seeing the magic sees the rest
        self._probe = ctypes.c_uint64(PROBE_MAGIC ^ lo)
        self._log = _log.bind(endpoint=self._id.hex()[:8])

    # ------------------------------------------------------------------ public API

    def describe(self) -> EndpointDescriptor:
        fields = EndpointFields(endpoint_id=self._id, pid=os.getpid(), uid=os.getuid(), ctl=self._ctl_name,
                                probe_addr=ctypes.addressof(self._probe), user_regions=self._user_regions,
                                cma=bool(self._cma_info["cma"]), **host_identity())
        return EndpointDescriptor(transport="shm", version=VERSION, payload=encode_payload(fields))

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.check_new(region.region_id)
            slot, gen = -1, 0
            if region.remote_accessible:
                if not self._free_slots:
                    raise Refused(f"too many remote-accessible regions (at most {MAX_SLOTS})")
                slot = self._free_slots.pop()
                gen = int(self._gens[slot]) + 1
                self._gens[slot] = gen
                s = self._ctl.slots[slot]
                s[1] = gen
                s[2] = region.region_id
                s[0] = SLOT_LIVE
            if region.remote_accessible and region.backing is None:
                self._user_regions += 1
            self._regs.add(_LocalReg(region, slot, gen))
            self._stats["regions"] = len(self._regs)
        fields = RegionFields(endpoint_id=self._id, region_id=region.region_id, size=region.size,
                              remote_accessible=region.remote_accessible)
        if region.backing is not None and region.remote_accessible:
            fields = msgspec.structs.replace(fields, slot=slot, gen=gen, kind="shm", shm_name=region.backing.name,
                                             shm_offset=region.backing.offset)
        elif region.remote_accessible:
            fields = msgspec.structs.replace(fields, slot=slot, gen=gen, kind="cma", pid=os.getpid(), addr=region.addr)
        return RegionDescriptor(transport="shm", version=VERSION, payload=encode_payload(fields))

    def deregister(self, region_id: int) -> None:
        epoch = [0]

        def dying(reg: _LocalReg) -> None:   # under the lock, the region already out of the tables
            if reg.slot >= 0:
                self._ctl.slots[reg.slot][0] = SLOT_DYING
                if reg.region.backing is None:
                    self._user_regions -= 1
            self._stats["regions"] = len(self._regs)
            epoch[0] = self._nb_epoch

        # cancel the batches touching it, then drain: its pins, and the native batches (short and
        # uninterruptible) that may use it from an older table snapshot
        reg = self._regs.deregister(region_id, locked=dying,
                                    also_wait=lambda: any(e < epoch[0] for e in self._nb_count))
        if reg is None:
            return
        if reg.slot >= 0:
            self._drain_slots(reg.slot, 1)
            with self._lock:
                self._ctl.slots[reg.slot][0] = SLOT_FREE
                self._free_slots.append(reg.slot)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "ShmChannel":
        if self._closed:
            raise Cancelled("endpoint is closed")
        fields = endpoint_fields(peer)
        try:
            ch = ShmChannel(self, fields, time.monotonic() + timeout)
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(f"bad shm endpoint description: {exc!r}") from None
        with self._lock:
            if self._closed:
                ch.close()
                raise Cancelled("endpoint is closed")
            self._channels.add(ch)
            self._stats["channels"] += 1
        return ch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _quick.bump(self._qc)
            self._ctl.hdr[2] = CTL_CLOSED
            channels = list(self._channels)
        for ch in channels:
            ch.close()
        self._regs.close(also_wait=lambda: bool(self._nb_count))   # cancel, then drain (native batches too)
        self._drain_slots(0, MAX_SLOTS)  # every remote reader has left its batch
        with _owned_lock:
            _owned_ctl.discard(self._ctl_name)
        try:
            _seg.unlink(self._ctl_name)
        except FileNotFoundError:
            pass
        self._ctl_map.close()

    def statistics(self) -> dict:
        with self._lock:
            return _quick.merged(dict(self._stats, closed=self._closed, active_batches=len(self._regs.batches),
                                      cma=self._cma_info["cma"], control_segment=self._ctl_name),
                                 self._qc, channel=False)

    # ------------------------------------------------------------------ internals

    def _rebuild(self, regs: RegionRegistry) -> None:
        items = sorted(regs.entries.items())
        self._addr_of = {k: int(r.region.addr) for k, r in items}
        # the native path's snapshot: rows (id, addr, size) sorted by id, kept alive by the tuple
        tab = np.zeros((len(items), 3), np.uint64)
        for i, (k, r) in enumerate(items):
            tab[i] = (k, r.region.addr, r.region.size)
        self._ntab = (tab, tab.ctypes.data, len(items))
        self._nb_epoch += 1
        _quick.bump(self._qc)

    def begin_native(self) -> tuple[tuple, int]:
        """A native batch starts: the local snapshot it uses, and its epoch (see :meth:`deregister`)."""
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            e = self._nb_epoch
            c = self._nb_count
            c[e] = c.get(e, 0) + 1
            return self._ntab, e

    def end_native(self, epoch: int, counted: bool) -> None:
        """A native batch ended (``counted``: it was not handed to the Python path, which counts it)."""
        with self._cond:
            if counted:
                self._stats["batches"] += 1
            c = self._nb_count
            left = c[epoch] - 1
            if left:
                c[epoch] = left
            else:
                del c[epoch]
                if self._regs.waiting:
                    self._cond.notify_all()

    def quick_locals(self, region_ids: Sequence[int]) -> Optional[_quick.QuickTables]:
        """What a prepared transfer (:meth:`ShmChannel.prepare`) needs of this endpoint, read together under
        its lock: its counters' address, its table's version and ``(address, size)`` of each of
        ``region_ids``; None when it is closed, has no C path or one of them is not registered."""
        with self._lock:
            if self._closed or self.native is None:
                return None
            local = {}
            for lid in region_ids:
                reg = self._regs.get(int(lid))
                if reg is None:
                    return None
                local[lid] = (int(reg.region.addr), int(reg.region.size))
            return _quick.QuickTables(self._qc.ctypes.data, int(self._qc[_quick.QC_VERSION]), local)

    def _drain_slots(self, start: int, count: int) -> None:
        """Wait until no reader (any process) holds a shared lock on these slots."""
        try:
            fd = _seg.open_fd(self._ctl_name)
        except FileNotFoundError:
            return  # the segment is already gone (exit handler): no reader can hold a lock on it
        try:
            _seg.lock(fd, _seg.F_WRLCK, start, count, wait=True)
            _seg.lock(fd, _seg.F_UNLCK, start, count)
        finally:
            os.close(fd)

    def begin_batch(self, ops: np.ndarray, remote: RegionTable) -> tuple[np.ndarray, PinnedBatch, np.ndarray]:
        """Validate ``ops`` (both sides) and pin the local regions; return ops, batch, local addrs
        (a list of ints for at most ``FEW`` ops, else a numpy array)."""
        batch = PinnedBatch()
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            try:
                ops = self._regs.pin(ops, remote, batch)
            except Refused:
                self._stats["refused"] += 1
                raise
            if 0 < len(ops) <= FEW:
                # a few ops (the latency path): Python ints, returned as a list
                addr_of = self._addr_of
                laddr = [addr_of[r] for r in ops["local_region"].tolist()]
            else:
                regs = self._regs
                pos = np.searchsorted(regs.ids, ops["local_region"].astype(np.int64))
                laddr = regs.addrs[pos] if len(ops) else np.empty(0, np.uint64)
            self._stats["batches"] += 1
        return ops, batch, laddr

    def end_batch(self, batch: PinnedBatch) -> None:
        self._regs.unpin(batch)

    def forget_channel(self, ch: "ShmChannel") -> None:
        with self._lock:
            self._channels.discard(ch)
