"""The shm channel (:class:`ShmChannel`): one same-host peer, its control segment and pool segments mapped,
its pid attached; a batch goes to the C hot path in one call, else through a copy plan (:mod:`._plans`)
under the peer's slot locks, split across the copy threads when large.

Over 500 lines as one concept: the class is the channel, and its parts (the mapped-segment table, the
native submit, the Python submit with its between-chunk peer checks) share its lock, tables and counters.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

from llmdd.abc import Channel, Completion, PreparedTransfer, RegionDescriptor
from llmdd.lowlevel import BatchSet, Cancelled, Corrupt, DoneCompletion, PeerGone, RegionTable, Refused
from llmdd.lowlevel import ThreadCompletion, TransportError, TransportTimeout, as_ops, map_os_error, submitted
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.status import LLMStatusCode

from . import _quick, _seg
from ._batch import PinnedBatch
from ._cma import Cma, CmaError, iovecs, probe_cma
from ._config import OPT_CHUNK, OPT_GIL, OPT_SPLIT, OPT_THREADS
from ._copypool import copy_pool
from ._format import (CTL_SIZE, SLOT_LIVE, CTL_MAGIC, CTL_OPEN, PROBE_MAGIC, KIND_CMA, KIND_SHM, MAX_SLOTS, VERSION,
                      EndpointFields, RegionFields, CtlView, id_words, region_fields)
from ._host import Liveness, host_identity
from ._hotpath import ST_BUSY, ST_CLOSED, ST_CMA, ST_DEAD, ST_FALLBACK, ST_LOCKERR, ST_NOPROGRESS, ST_OK
from ._hotpath import ST_STALE
from ._plans import AnyPlan, FewPlan, Part, Plan


class ChannelOwner(Protocol):
    """What a channel uses of the endpoint that opened it (:class:`~llmdd_shm._endpoint.ShmEndpoint`): its
    configuration and C hot path, a batch's pins (``begin_batch`` / ``end_batch``), a native batch's
    snapshot of its table (``begin_native`` / ``end_native``), a prepared transfer's view of its table
    (``quick_locals``), and the channel's close (``forget_channel``)."""

    @property
    def cfg(self) -> Mapping[str, Any]: ...

    @property
    def native(self) -> Any: ...

    def begin_batch(self, ops: np.ndarray, remote: RegionTable) -> tuple[np.ndarray, PinnedBatch, np.ndarray]: ...

    def end_batch(self, batch: PinnedBatch) -> None: ...

    def begin_native(self) -> tuple[tuple, int]: ...

    def end_native(self, epoch: int, counted: bool) -> None: ...

    def quick_locals(self, region_ids: Sequence[int]) -> Optional[_quick.QuickTables]: ...

    def forget_channel(self, ch: ShmChannel) -> None: ...


_DONE_OK = DoneCompletion(None)  # immutable: one shared instance for every successful native batch

#: batches with more ops than this skip the native single-call path (the numpy plan coalesces them)
_NATIVE_MAX_OPS = 4096


class _Remote:
    __slots__ = ("size", "kind", "base", "slot", "gen", "mapping", "accessible")

    def __init__(self, size: int, kind: int, base: int, slot: int, gen: int,
                 mapping: Optional[_seg.Mapping], accessible: bool) -> None:
        self.size = size
        self.kind = kind
        self.base = base
        self.slot = slot
        self.gen = gen
        self.mapping = mapping
        self.accessible = accessible


class ShmChannel(Channel):
    """A same-host peer: its control segment and pool segments mapped, its pid attached."""

    def __init__(self, endpoint: ChannelOwner, peer: EndpointFields, deadline: float) -> None:
        self._ep = endpoint
        self._cfg = endpoint.cfg
        self._peer_id = peer.endpoint_id
        self.pid = peer.pid
        mine = host_identity()
        for key in ("boot_id", "machine_id", "pidns", "ipcns"):
            if str(getattr(peer, key)) != str(mine[key]):
                raise Refused(f"peer endpoint is not on this host (its {key} {getattr(peer, key)!r} differs from "
                              f"ours {mine[key]!r}); the shm transport is same-host only",
                              status_code=LLMStatusCode.LLM_LINK_FAILED)
        if time.monotonic() > deadline:
            raise TransportTimeout("deadline passed before connecting")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._remote: dict[int, _Remote] = {}
        self._maps: dict[str, _seg.Mapping] = {}
        self._fds: list[int] = []
        self._batches: BatchSet[PinnedBatch] = BatchSet(self._cond)   # py batches tracked, native ones counted
        self._nbusy = 0                      # native batches running (they use table snapshots)
        self._deferred: list = []            # mappings released while a native batch ran
        self.native = endpoint.native
        self._qc = _quick.counters()  # the quick path's table version and counters (llmdd_shm._quick)
        self._qfd = -1                # the quick path's lock fd (used under the GIL only)
        self._nrtab: tuple = (np.zeros((0, 6), np.uint64), 0, 0)
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0,
                                       "batches": 0, "failed": 0, "cma_calls": 0, "segments_mapped": 0,
                                       "last_error": None, "native_batches": 0, "native_fallbacks": 0}
        self._ctl_name = peer.ctl
        try:
            ctl_map = _seg.attach(self._ctl_name)
        except FileNotFoundError:
            raise PeerGone(f"peer endpoint {self._peer_id.hex()[:8]} is closed (no control segment)") from None
        except OSError as exc:
            raise PeerGone(f"cannot map the peer's control segment: {exc}") from None
        self._ctl_map = ctl_map
        try:
            if ctl_map.size < CTL_SIZE:
                raise Corrupt("peer control segment is too small")
            self._ctl = CtlView(ctl_map)
            hdr = self._ctl.hdr
            if int(hdr[0]) != CTL_MAGIC or int(hdr[1]) != VERSION:
                raise Corrupt(f"peer does not speak llmdd-shm v{VERSION}")
            if (int(hdr[4]), int(hdr[5])) != id_words(self._peer_id) or int(hdr[3]) != self.pid:
                raise PeerGone("the control segment belongs to another endpoint incarnation")
            if int(hdr[2]) != CTL_OPEN:
                raise PeerGone("peer endpoint is closed")
            self._live = Liveness(self.pid)
        except BaseException:
            ctl_map.close()
            raise
        self._pidfd = self._live.fd if self._live.fd is not None else -1
        self._ctl_addr = ctl_map.addr
        # the native single call covers one chunk of an unsplit batch (the Python path does the rest)
        #: the most bytes of one chunk (the copy plans check the peer between chunks)
        self.chunk_bytes = int(self._cfg[OPT_CHUNK])
        limit = self.chunk_bytes
        if int(self._cfg[OPT_THREADS]) > 1:
            limit = min(limit, int(self._cfg[OPT_SPLIT]) - 1)
        self._nlimit = max(0, limit)
        self._ngil = int(self._cfg[OPT_GIL])
        self.cma = Cma()
        self._iov_max = self.cma.iov_max
        self._cma_ok, self._cma_reason = self._check_cma(peer)
        if not self._cma_ok and peer.user_regions > 0:
            self._teardown()
            raise Refused(f"peer {self.pid} has user-memory regions but cross-memory attach to it does not "
                          f"work: {self._cma_reason}", status_code=LLMStatusCode.LLM_LINK_FAILED)
        self._rebuild()

    def _check_cma(self, peer: EndpointFields) -> tuple[bool, str]:
        if not self.cma.available:
            return False, "process_vm_readv is not available"
        out = np.zeros(1, np.uint64)
        liov = iovecs(np.array([out.ctypes.data], np.uint64), np.array([8], np.uint64))
        riov = iovecs(np.array([peer.probe_addr], np.uint64), np.array([8], np.uint64))
        try:
            self.cma.transfer(self.pid, liov, riov, write=False)
        except CmaError as exc:
            scope = probe_cma()["ptrace_scope"]
            extra = f" (kernel.yama.ptrace_scope={scope})" if scope else ""
            return False, f"{exc.strerror or exc}{extra}"
        if int(out[0]) != PROBE_MAGIC ^ id_words(self._peer_id)[0]:
            return False, "cross-memory attach reached a process that is not the peer endpoint"
        return True, "ok"

    # ------------------------------------------------------------------ public API

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = region_fields(desc)
        if fields.endpoint_id != self._peer_id:
            raise Refused(f"descriptor of region {region_id} belongs to another endpoint")
        region_id = int(region_id)
        size = min(int(size), fields.size)
        if not fields.remote_accessible or not fields.kind:
            rem = _Remote(size, KIND_CMA, 0, -1, 0, None, False)
        else:
            rem = self._remote_of(region_id, size, fields)
        with self._lock:
            if rem.mapping is not None:
                rem.mapping.refs += 1
            old = self._remote.pop(region_id, None)
            self._remote[region_id] = rem
            self._rebuild()
        if old is not None and old.mapping is not None:
            self._release_map(old.mapping, ref=True)

    def _remote_of(self, region_id: int, size: int, desc: RegionFields) -> _Remote:
        """A remote-accessible peer region: its segment mapped (kind shm) or its pid checked (kind cma)."""
        slot, gen = desc.slot, desc.gen
        if not 0 <= slot < MAX_SLOTS:
            raise Refused(f"descriptor of region {region_id} names slot {slot}")
        if desc.kind == "shm":
            name, off = desc.shm_name, desc.shm_offset
            with self._lock:
                if self._batches.closed:
                    raise Cancelled("channel closed")
                m = self._maps.get(name)
            if m is None:
                try:
                    m = _seg.attach(name)
                except (OSError, ValueError) as exc:
                    if not self._live.alive():
                        raise PeerGone(f"peer process {self.pid} is gone") from None
                    raise Refused(f"cannot map segment {name} of region {region_id}: {exc}") from None
                with self._lock:
                    other = self._maps.get(name)
                    if other is None:
                        self._maps[name] = m
                        self._stats["segments_mapped"] += 1
                    else:
                        m.close()
                        m = other
            if off < 0 or off + size > m.size:
                self._drop_map_if_unused(m)
                raise Refused(f"region {region_id} ({off}+{size}) exceeds segment {name} ({m.size} bytes)")
            return _Remote(size, KIND_SHM, m.addr + off, slot, gen, m, True)
        if desc.kind == "cma":
            if desc.pid != self.pid:
                raise Refused(f"descriptor of region {region_id} names pid {desc.pid}, peer is {self.pid}")
            if not self._cma_ok:
                raise Refused(f"user-memory region {region_id} needs cross-memory attach to pid {self.pid}, "
                              f"which does not work: {self._cma_reason}")
            return _Remote(size, KIND_CMA, desc.addr, slot, gen, None, True)
        raise Refused(f"descriptor of region {region_id} has unknown kind {desc.kind!r}")

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            old = self._remote.pop(int(region_id), None)
            self._rebuild()
        if old is not None and old.mapping is not None:
            self._release_map(old.mapping, ref=True)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        return submitted(self._submit, False, ops, deadline)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return submitted(self._submit, True, ops, deadline)

    def close(self) -> None:
        # the quick path's plans of this channel are void from now on (llmdd_shm._quick)
        _quick.bump(self._qc)
        # refuse new batches, fail those in flight, wait until every one (native ones too) left
        if not self._batches.close(Cancelled("channel closed")):
            return
        self._teardown()
        self._ep.forget_channel(self)

    def statistics(self) -> dict:
        with self._lock:
            # cma_calls: every process_vm_* call of this channel (the connect-time probe included)
            return _quick.merged(dict(self._stats, remote_regions=len(self._remote), mapped_segments=len(self._maps),
                                      closed=self._batches.closed, cma=self._cma_ok, cma_reason=self._cma_reason,
                                      peer_pid=self.pid, cma_calls=self.cma.calls), self._qc, channel=True)

    def prepare(self, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int, dst_units: int,
                push: bool, *, timeout_s: Optional[float] = None) -> Optional[PreparedTransfer]:
        """The seam's prepared path (``Channel.prepare``): ``_shmfast.quick`` bound to the plan of one
        small-transfer shape (:func:`llmdd_shm._quick.pack_plan`), or None when the C path cannot take it (no
        extension, no pidfd, a region not in the tables now, too many pairs, a block larger than the
        single-call limit).  The endpoint resolves the local regions under its lock
        (:meth:`ShmEndpoint.quick_locals`), this channel the remote ones under its own.  ``timeout_s`` is
        not used: a call never waits (the owner's lock held, it declines and the engine's batch path waits)."""
        nat = self.native
        quick = getattr(nat, "quick", None)
        if nat is None or quick is None or self._pidfd < 0 or not 0 < len(pairs) <= nat.QUICK_MAX_PAIRS:
            return None
        bs, su, du = int(block_bytes), int(src_units), int(dst_units)
        max_bytes = min(self._nlimit, self._ngil)
        if bs <= 0 or su <= 0 or du <= 0 or bs > max_bytes:
            return None
        local = self._ep.quick_locals([lid for lid, _ in pairs])
        if local is None:
            return None
        with self._lock:   # the remote table, its version and the channel's lock fd together
            if self._batches.closed:
                return None
            remote = {}
            for _, rid in pairs:
                rem = self._remote.get(int(rid))
                if rem is None or not rem.accessible or rem.slot < 0 or (rem.kind == KIND_CMA and not self._cma_ok):
                    return None
                remote[rid] = (int(rem.base), int(rem.size), int(rem.kind), int(rem.slot), int(rem.gen))
            remote_tables = _quick.QuickTables(self._qc.ctypes.data, int(self._qc[_quick.QC_VERSION]), remote)
            if self._qfd < 0:
                try:
                    self._qfd = _seg.open_fd(self._ctl_name)
                except OSError:
                    return None
            fd = self._qfd
        plan = _quick.pack_plan(pairs, local, remote_tables, ctl_addr=self._ctl_addr, push=push, pid=self.pid,
                                pidfd=self._pidfd, lock_fd=fd, block_bytes=bs, src_units=su, dst_units=du,
                                iov_max=self._iov_max, max_bytes=max_bytes)
        return functools.partial(quick, plan)

    # ------------------------------------------------------------------ mappings and tables

    def _teardown(self) -> None:
        with self._lock:
            _quick.bump(self._qc)
            if self._qfd >= 0:
                self._fds.append(self._qfd)   # closed below with the others
                self._qfd = -1
            maps = list(self._maps.values()) + self._deferred
            self._maps.clear()
            self._deferred = []
            self._remote.clear()
            fds, self._fds = self._fds, []
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)
        self._live.close()
        self._ctl_map.close()

    def _drop_map_if_unused(self, m: _seg.Mapping) -> None:
        with self._lock:
            if m.refs or m.pins or self._maps.get(m.name) is not m:
                return
            del self._maps[m.name]
            if self._nbusy:
                self._deferred.append(m)  # a native batch may hold an older table snapshot
                return
        m.close()

    def _release_map(self, m: _seg.Mapping, *, ref: bool = False, pin: bool = False) -> None:
        with self._lock:
            m.refs -= int(ref)
            m.pins -= int(pin)
            if m.refs or m.pins:
                return
            if self._maps.get(m.name) is m:
                del self._maps[m.name]
            if self._nbusy:
                self._deferred.append(m)  # a native batch may hold an older table snapshot
                return
        m.close()

    def _rebuild(self) -> None:
        items = sorted((k, r) for k, r in self._remote.items() if r.accessible)
        self._table = RegionTable({k: r.size for k, r in items},
                                  private=[k for k, r in self._remote.items() if not r.accessible])
        n = len(items)
        self._rids = np.fromiter((k for k, _ in items), np.int64, n)
        self._rbase = np.fromiter((r.base for _, r in items), np.uint64, n)
        self._rkind = np.fromiter((r.kind for _, r in items), np.uint8, n)
        self._rslot = np.fromiter((r.slot for _, r in items), np.int64, n)
        self._rgen = np.fromiter((r.gen for _, r in items), np.uint32, n)
        self._rmaps = [r.mapping for _, r in items]
        self._rinfo = {k: (r.base, r.kind, r.slot, r.gen, r.mapping) for k, r in items}
        # the native path's snapshot: rows (id, base, kind, slot, gen, size) sorted by id
        tab = np.zeros((n, 6), np.uint64)
        for i, (k, r) in enumerate(items):
            tab[i] = (k, r.base, r.kind, r.slot, r.gen, r.size)
        self._nrtab = (tab, tab.ctypes.data, n)
        _quick.bump(self._qc)

    # ------------------------------------------------------------------ batches

    def _submit(self, write: bool, ops: np.ndarray, deadline: float) -> Completion:
        nat = self.native
        if nat is not None:
            ops = as_ops(ops)
            if 0 < len(ops) <= _NATIVE_MAX_OPS:
                done = self._submit_native(nat, write, ops, deadline)
                if done is not None:
                    return done
        return self._submit_py(write, ops, deadline)

    def _submit_native(self, nat: Any, write: bool, ops: np.ndarray, deadline: float) -> Optional[Completion]:
        """One C call: lookup, bounds, pidfd, lock, slot checks, copy, unlock.  ``None`` when the
        batch needs the Python path (nothing was done): more than one chunk, a region or bound the C
        side is not sure of (the Python path produces the refusal), or the owner holding its lock."""
        ep = self._ep
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            rtab = self._nrtab
            fd = self._fds.pop() if self._fds else -1
            self._batches.enter()
            self._nbusy += 1
        epoch = -1
        res: tuple = (-1, 0, 0)  # -1: the C side was not called
        err: Optional[TransportError] = None
        try:
            ltab, epoch = ep.begin_native()  # Cancelled when the endpoint is closed, as the Python path
            if fd < 0:
                try:
                    fd = self._take_fd()
                except TransportError as exc:
                    err = exc
            if err is not None:
                pass
            elif time.monotonic() >= deadline:
                err = TransportTimeout("deadline passed before the batch started")
            elif self._pidfd < 0 and not self._live.alive():
                err = PeerGone(f"peer process {self.pid} is gone")
            else:
                res = nat.batch(write, self.pid, self._pidfd, fd, self._ctl_addr, ops, ltab[1], ltab[2], rtab[1],
                                rtab[2], self._iov_max, self._nlimit, self._ngil)
        finally:
            if epoch >= 0:
                ep.end_native(epoch, res[0] != ST_FALLBACK and res[0] != ST_BUSY)
            deferred = None
            with self._lock:
                if fd >= 0 and not self._batches.closed and len(self._fds) < 8:
                    self._fds.append(fd)
                    fd = -1
                self._batches.leave()   # wakes a close() draining the channel
                self._nbusy -= 1
                if not self._nbusy and self._deferred:
                    deferred, self._deferred = self._deferred, []
                if res[0] == ST_FALLBACK or res[0] == ST_BUSY:
                    self._stats["native_fallbacks"] += 1
                elif res[0] == ST_OK and err is None:
                    st = self._stats
                    st["batches"] += 1
                    st["native_batches"] += 1
                    if write:
                        st["bytes_written"] += res[1]
                        st["ops_written"] += len(ops)
                    else:
                        st["bytes_read"] += res[1]
                        st["ops_read"] += len(ops)
                    if res[2]:
                        self.cma.calls += res[2]
                        st["cma_calls"] = self.cma.calls
            if fd >= 0:
                os.close(fd)
            for m in deferred or ():
                m.close()
        st = res[0]
        if err is None:
            if st == ST_OK:
                return _DONE_OK
            if st == ST_FALLBACK or st == ST_BUSY:
                return None
            err = self._native_error(write, res)
        with self._lock:
            self._stats["batches"] += 1
            self._stats["native_batches"] += 1
            self._stats["failed"] += 1
            self._stats["last_error"] = str(err)
        return DoneCompletion(err)

    def _native_error(self, write: bool, res: tuple) -> TransportError:
        st, a, b = res
        call = f"process_vm_{'writev' if write else 'readv'}(pid={self.pid})"
        if st == ST_DEAD:
            return PeerGone(f"peer process {self.pid} is gone")
        if st == ST_CLOSED:
            return PeerGone("peer endpoint closed")
        if st == ST_STALE:
            return Refused(f"remote region {a} is not registered by its owner any more")
        if st == ST_CMA:
            return self._map_exc(CmaError(a, f"{call}: {os.strerror(a)} ({b} bytes moved before)"))
        if st == ST_NOPROGRESS:
            return self._map_exc(CmaError(errno.EFAULT, f"{call} made no progress ({a} bytes left)"))
        if st == ST_LOCKERR:
            return self._map_exc(OSError(a, f"locking the peer's slots: {os.strerror(a)}"))
        return Corrupt(f"native shm path returned status {st}")

    def _submit_py(self, write: bool, ops: np.ndarray, deadline: float) -> Completion:
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            table, rids, rbase = self._table, self._rids, self._rbase
            rkind, rslot, rgen, rmaps = self._rkind, self._rslot, self._rgen, self._rmaps
            rinfo = self._rinfo
        ops, batch, laddr = self._ep.begin_batch(ops, table)  # Refused before a byte moves
        small = type(laddr) is list
        try:
            if small:
                rl = ops["remote_region"].tolist()
                used_ids = sorted(set(rl))
                maps = [m for r in used_ids if (m := rinfo[r][4]) is not None]
            else:
                pos = np.searchsorted(rids, ops["remote_region"].astype(np.int64))
                used = np.unique(pos)
                maps = [m for i in used.tolist() if (m := rmaps[i]) is not None]
            with self._lock:
                if self._batches.closed:
                    raise Cancelled("channel closed")
                for m in maps:
                    m.pins += 1
                batch.maps = maps
                self._batches.add(batch)
        except BaseException:
            self._ep.end_batch(batch)
            raise
        plan: Union[Plan, FewPlan]
        if small:
            plan = FewPlan(ops, laddr, rl, rinfo, used_ids)
            if plan.total >= int(self._cfg[OPT_SPLIT]) and int(self._cfg[OPT_THREADS]) > 1:
                plan = plan.full()  # big enough to split across the copy threads
        else:
            plan = Plan(ops, laddr, rbase[pos], rkind[pos], rslot[used], rgen[used], rids[used])
        total = plan.total
        if time.monotonic() >= deadline:
            return self._done(batch, write, plan, TransportTimeout("deadline passed before the batch started"))
        if total < int(self._cfg[OPT_SPLIT]) or int(self._cfg[OPT_THREADS]) <= 1:
            err = None
            try:
                self._run(batch, write, plan, deadline)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes the batch's error
                err = self._map_exc(exc)
            return self._done(batch, write, plan, err)
        parts = plan.share(int(self._cfg[OPT_THREADS]), self.chunk_bytes, self.cma.iov_max)
        workers = [(lambda p=p: self._run_mapped(batch, write, p, deadline)) for p in parts]
        # part 0 in this thread, the others on the copy pool (no thread start per batch)
        completion = ThreadCompletion(
            workers, deadline=deadline, abort=lambda: batch.abort(Cancelled("batch aborted")),
            on_done=lambda c: self._done(batch, write, plan,
                                         self._map_exc(c.recorded_error) if c.recorded_error else None),
            pool=copy_pool.submit, start=False)
        batch.completion = completion  # set before any part runs: close() and deregister() fail it
        return completion.start()

    def _map_exc(self, exc: BaseException) -> TransportError:
        if isinstance(exc, CmaError):
            if exc.errno == errno.ESRCH or not self._live.alive():
                return PeerGone(f"peer process {self.pid} is gone")
            if exc.errno == errno.EPERM:
                return Refused(f"cross-memory attach to pid {self.pid} not permitted: {exc}")
            return Corrupt(f"cross-memory attach failed: {exc}")
        return map_os_error(exc, what="peer endpoint unreachable", peer_alive=self._live.alive)

    def _done(self, batch: PinnedBatch, write: bool, plan: Union[Plan, FewPlan], err: Optional[TransportError]) -> Completion:
        self._ep.end_batch(batch)
        for m in batch.maps:
            self._release_map(m, pin=True)
        batch.maps = []
        with self._cond:
            self._batches.discard_locked(batch)
            self._stats["batches"] += 1
            self._stats["cma_calls"] = self.cma.calls
            if err is None:
                key = "written" if write else "read"
                self._stats[f"bytes_{key}"] += plan.total
                self._stats[f"ops_{key}"] += plan.n
            else:
                self._stats["failed"] += 1
                self._stats["last_error"] = str(err)
            self._cond.notify_all()
        return DoneCompletion(err)

    def _take_fd(self) -> int:
        with self._lock:
            if self._fds:
                return self._fds.pop()
        try:
            return _seg.open_fd(self._ctl_name)
        except FileNotFoundError:
            raise PeerGone("peer endpoint closed (control segment removed)") from None

    def _give_fd(self, fd: int) -> None:
        with self._lock:
            if not self._batches.closed and len(self._fds) < 8:
                self._fds.append(fd)
                return
        os.close(fd)

    def check_peer(self, plan: "AnyPlan", batch: PinnedBatch, deadline: float, *, first: bool) -> None:
        """Between chunks: abort, deadline, peer endpoint closed, regions deregistered."""
        if batch.aborted:
            raise batch.why or Cancelled("batch aborted")
        if time.monotonic() >= deadline:
            raise TransportTimeout("batch missed its deadline")
        if int(self._ctl.hdr[2]) != CTL_OPEN:
            raise PeerGone("peer endpoint closed")
        if type(plan.slots) is list:  # a FewPlan: a few slots, Python ints
            slots = self._ctl.slots
            for slot, gen, rid in zip(plan.slots, plan.gens, plan.rids):
                if int(slots[slot, 0]) != SLOT_LIVE or int(slots[slot, 1]) != gen:
                    if first:
                        raise Refused(f"remote region {rid} is not registered by its owner any more")
                    raise Cancelled(f"remote region {rid} was deregistered by its owner")
        elif len(plan.slots):
            st = self._ctl.slots[plan.slots]
            ok = (st[:, 0] == SLOT_LIVE) & (st[:, 1] == plan.gens)
            if not ok.all():
                rid = int(plan.rids[int(np.argmin(ok))])
                if first:
                    raise Refused(f"remote region {rid} is not registered by its owner any more")
                raise Cancelled(f"remote region {rid} was deregistered by its owner")

    def _run_mapped(self, batch: PinnedBatch, write: bool, plan: "Part", deadline: float) -> None:
        try:
            self._run(batch, write, plan, deadline)
        except BaseException as exc:  # noqa: BLE001 - typed errors reach the completion
            raise self._map_exc(exc) from None

    def _run(self, batch: PinnedBatch, write: bool, plan: "AnyPlan", deadline: float) -> None:
        if not self._live.alive():
            raise PeerGone(f"peer process {self.pid} is gone")
        if int(self._ctl.hdr[2]) != CTL_OPEN:
            raise PeerGone("peer endpoint closed")
        if plan.n == 0:
            return
        lo, hi = plan.slot_range
        fd = self._take_fd()
        locked = False
        try:
            delay = 2e-5
            while not _seg.lock(fd, _seg.F_RDLCK, lo, hi - lo):
                # the owner is deregistering or closing (or stalled holding its lock)
                if batch.aborted:
                    raise batch.why or Cancelled("batch aborted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("batch missed its deadline waiting for the peer's regions")
                self.check_peer(plan, batch, deadline, first=True)
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2e-3)
            locked = True
            self.check_peer(plan, batch, deadline, first=True)
            plan.execute(self, batch, write, deadline)
        finally:
            if locked:
                _seg.lock(fd, _seg.F_UNLCK, lo, hi - lo)
            self._give_fd(fd)
