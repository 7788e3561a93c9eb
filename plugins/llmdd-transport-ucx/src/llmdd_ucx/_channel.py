"""The ucx channel: requests from the local NIXL agent to one peer agent, checked against the regions
the peer granted, turned into descriptor arrays and posted as one batch (:mod:`llmdd_ucx._xfer`)."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Protocol, Sequence

from llmdd.abc import Channel, Completion, PreparedTransfer, RegionDescriptor
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import BatchSet, Cancelled, DoneCompletion, PeerGone, RegionRegistry, RegionTable, Refused
from llmdd.lowlevel import TransportError
from llmdd.lowlevel import TransportTimeout, check_ops, coalesce_ops, submitted

from . import _proto, _quick
from ._fields import region_fields
from ._nixl import nixl_error
from ._options import OPT_CHUNK_BYTES, OPT_CHUNK_DESCS, OPT_CONTROL_TIMEOUT
from ._lanes import PARTS_PER_THREAD, PostThreads, Split, split_bounds
from ._regs import LocalReg
from ._xfer import Xfer, XferEndpoint, chunk, split_big

class ChannelOwner(XferEndpoint, _quick.QuickEndpoint, Protocol):
    """What a channel uses of the endpoint that opened it (:class:`~llmdd_ucx._endpoint.UcxEndpoint`): what
    its batches and its prepared path use (:class:`~llmdd_ucx._xfer.XferEndpoint`,
    :class:`~llmdd_ucx._quick.QuickEndpoint`), its lock (taken before the channel's), registry and
    closed flag, the split threshold and posting threads, a control request to the peer (``request``) and
    the channel's close (``forget_channel``)."""

    @property
    def lock(self) -> threading.RLock: ...

    @property
    def closed(self) -> bool: ...

    @property
    def regs(self) -> RegionRegistry[LocalReg]: ...

    @property
    def split_min(self) -> int: ...

    @property
    def posters(self) -> Optional[PostThreads]: ...

    def request(self, peer: str, kind: int, payload: bytes, timeout: float) -> bool: ...

    def forget_channel(self, ch: UcxChannel) -> None: ...


#: batches of at most this many ops (checked) are turned into descriptors in plain Python (_few_descs)
_FEW_OPS = 8


def _few_descs(rows: list, local: dict, remote: dict, max_bytes: int, max_descs: int) -> Optional[tuple]:
    """``(chunks, bytes, ops, local ids, remote ids)`` of a few checked op rows, merged as
    :func:`~llmdd.lowlevel.coalesce_ops` merges them (zero-length ops dropped; ordered by remote
    region, remote offset, local region, local offset; ops continuing each other on both sides made
    one), as one chunk of ``(addr, len, dev)`` descriptor lists; None when they need more than one
    chunk (the numpy path cuts them)."""
    rows = sorted((r for r in rows if r[4] > 0), key=lambda r: (r[2], r[3], r[0], r[1]))
    merged: list[list[int]] = []
    for lr, lo, rr, ro, ln in rows:
        if merged:
            m = merged[-1]
            if m[0] == lr and m[2] == rr and m[1] + m[4] == lo and m[3] + m[4] == ro:
                m[4] += ln
                continue
        merged.append([lr, lo, rr, ro, ln])
    total = sum(m[4] for m in merged)
    if total > max_bytes or len(merged) > max_descs:
        return None
    ldesc = []
    rdesc = []
    for lr, lo, rr, ro, ln in merged:
        r = remote[rr]
        ldesc.append((local[lr].region.addr + lo, ln, 0))
        rdesc.append((r.addr + ro, ln, r.dev))
    return ([(ldesc, rdesc)], total, len(merged), frozenset(m[0] for m in merged),
            frozenset(m[2] for m in merged))


class _Remote:
    __slots__ = ("size", "addr", "dev", "gen", "accessible")

    def __init__(self, size: int, addr: int, dev: int, gen: int, accessible: bool) -> None:
        self.size, self.addr, self.dev, self.gen, self.accessible = size, addr, dev, gen, accessible


class UcxChannel(Channel):
    """Requests from the local agent to one peer agent."""

    def __init__(self, endpoint: ChannelOwner, peer_name: str) -> None:
        self.endpoint = endpoint
        self.peer_name = peer_name
        self._lock = threading.RLock()
        self._remote: dict[int, _Remote] = {}
        self._table = RegionTable()
        self._ids = np.empty(0, np.int64)
        self._addrs = np.empty(0, np.uint64)
        self._devs = np.empty(0, np.uint64)
        self._gone: Optional[TransportError] = None
        self._batches: BatchSet[Xfer] = BatchSet(threading.Condition(self._lock))
        #: bumped (under the lock) on every change of the remote table, when the peer is gone and at
        #: close: a one-call plan (llmdd_ucx._quick) made on an older version declines
        self.table_version = 0
        # int counters, and last_error (str or None); quick_batches: batches of the one-call path
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0,
                                       "batches": 0, "quick_batches": 0, "split_batches": 0, "requests": 0, "failed": 0,
                                       "refused": 0, "last_error": None}

    # ------------------------------------------------------------------ public API

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = region_fields(desc)
        if fields.agent != self.peer_name:
            raise Refused(f"descriptor of region {region_id} belongs to another endpoint")
        md = fields.metadata
        if md:
            try:  # the region's remote key (registered after the link may have been made)
                self.endpoint.agent.add_remote_agent(bytes(md))
            except Exception as exc:  # noqa: BLE001
                raise nixl_error(exc, f"loading the key of remote region {region_id}") from None
        r = _Remote(min(int(size), fields.size), fields.addr, fields.dev_id, fields.gen, fields.remote_accessible)
        with self._lock:
            self._remote[int(region_id)] = r
            self._rebuild()

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            self._remote.pop(int(region_id), None)
            self._rebuild()

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        return submitted(self._submit, "READ", ops, deadline)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return submitted(self._submit, "WRITE", ops, deadline)

    def close(self) -> None:
        with self._lock:
            self.table_version += 1   # one-call plans decline from now on (the batch set refuses them too)
        if not self._batches.close(Cancelled("channel closed")):   # fail the batches in flight, drain them
            return
        if self._gone is None and self.endpoint.agent is not None:
            self.endpoint.request(self.peer_name, _proto.GOODBYE, b"", float(self.endpoint.cfg[OPT_CONTROL_TIMEOUT]))
        self.endpoint.forget_channel(self)

    def prepare(self, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int, dst_units: int,
                push: bool, *, timeout_s: float) -> Optional[PreparedTransfer]:
        """The seam's prepared path (``Channel.prepare``): the one-call path of one small-transfer shape
        (:func:`llmdd_ucx._quick.prepare`), or None; each call has ``timeout_s`` to finish (the
        engine's sync_kv_timeout)."""
        return _quick.prepare(self, pairs, block_bytes, src_units, dst_units, push, timeout_s)

    def prepared_rows(self, pairs: Sequence[tuple[int, int]], local_min: int,
                      remote_min: int) -> Optional[tuple[int, int, list]]:
        """For a one-call plan (:func:`llmdd_ucx._quick.prepare`): the endpoint's and this channel's table
        versions and ``(local address, remote address, remote device)`` of each pair, read together under
        both locks; None when either is closed, the peer is gone, a local region is not registered (or
        smaller than ``local_min``) or a remote one not announced, not remote-accessible or smaller than
        ``remote_min``."""
        ep = self.endpoint
        rows = []
        with ep.lock, self._lock:   # both tables and their versions together
            if ep.closed or self._batches.closed or self._gone is not None:
                return None
            for lid, rid in pairs:
                reg = ep.regs.get(int(lid))
                rem = self._remote.get(int(rid))
                if (reg is None or reg.dlist is None or rem is None or not rem.accessible
                        or local_min > int(reg.region.size) or remote_min > rem.size):
                    return None
                rows.append((int(reg.region.addr), int(rem.addr), int(rem.dev)))
            return ep.table_version, self.table_version, rows

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, peer=self.peer_name, remote_regions=len(self._remote),
                        closed=self._batches.closed, gone=self._gone is not None)

    # ------------------------------------------------------------------ internals

    def _rebuild(self) -> None:
        self.table_version += 1
        ids = sorted(i for i, r in self._remote.items() if r.accessible)
        self._table = RegionTable({i: self._remote[i].size for i in ids},
                                  private=[i for i, r in self._remote.items() if not r.accessible])
        self._ids = np.array(ids, dtype=np.int64)
        self._addrs = np.array([self._remote[i].addr for i in ids], dtype=np.uint64)
        self._devs = np.array([self._remote[i].dev for i in ids], dtype=np.uint64)

    def gone_error(self) -> Optional[TransportError]:
        return self._gone

    def transfer_error(self) -> TransportError:
        """What a request in state ERR means: with UCX's peer error handling, a lost peer."""
        return self._gone or PeerGone(f"transfer to {self.peer_name} failed (peer unreachable or gone)")

    def revoke(self, region_id: int, gen: int) -> None:
        with self._lock:
            r = self._remote.get(region_id)
            if r is not None and r.gen == gen:
                del self._remote[region_id]
                self._rebuild()
            touching = self._batches.matching(lambda b: region_id in b.remote_ids)
        for b in touching:
            b.fail(Cancelled(f"remote region {region_id} was deregistered by its owner"))

    def mark_gone(self, err: TransportError, *, notify: bool) -> None:
        with self._lock:
            if self._gone is None:
                self._gone = err
                self.table_version += 1
            active = list(self._batches)
        for b in active:
            b.fail(err)

    def batch_done(self, batch: Xfer, err: Optional[TransportError]) -> None:
        self.endpoint.regs.untrack(batch)   # not under the channel's lock: _submit takes the endpoint's first
        done: "Xfer | Split" = batch
        with self._lock:
            self._batches.discard_locked(batch)
            stats = self._stats
            parent = batch.parent
            if parent is not None:   # a part: the split batch is counted once, when its last part ends
                if not parent.note(err):
                    return
                done, err = parent, parent.first_err
                stats["split_batches"] += 1
            stats["batches"] += 1
            if done.quick:
                stats["quick_batches"] += 1
            if err is None:
                if done.op == "READ":
                    stats["bytes_read"] += done.nbytes
                    stats["ops_read"] += done.nops
                else:
                    stats["bytes_written"] += done.nbytes
                    stats["ops_written"] += done.nops
            else:
                self._stats["failed"] += 1
                self._stats["last_error"] = str(err)

    def _submit(self, op: str, ops: np.ndarray, deadline: float) -> Completion:
        ep = self.endpoint
        with ep.lock, self._lock:
            if self._batches.closed or ep.closed:
                raise Cancelled("channel closed")
            try:
                arr = check_ops(ops, ep.regs.table, self._table)
            except Refused as exc:
                self._stats["refused"] += 1
                self._stats["last_error"] = str(exc)
                raise
            if self._gone is not None:
                return DoneCompletion(self._gone)
            if time.monotonic() >= deadline:
                return DoneCompletion(TransportTimeout("deadline passed before the batch started"))
            max_bytes, max_descs = int(ep.cfg[OPT_CHUNK_BYTES]), int(ep.cfg[OPT_CHUNK_DESCS])
            few = (_few_descs(arr.tolist(), ep.regs.entries, self._remote, max_bytes, max_descs)
                   if len(arr) <= _FEW_OPS else None)
            if few is not None and few[1] >= ep.split_min and ep.posters is not None:
                few = None   # large enough to split: the array path below cuts it
            if few is not None:
                chunks, total, nops, local_ids, remote_ids = few
                if not nops:
                    return DoneCompletion(None)
                batch = Xfer(self, op, chunks, deadline, total, nops, local_ids, remote_ids)
                self._batches.add(batch)
                ep.regs.track(batch)
                self._stats["requests"] += 1
                batch.start()   # as below: posted under the locks
                return batch
            arr = coalesce_ops(arr)
            if not len(arr):
                return DoneCompletion(None)
            lpos = np.searchsorted(ep.regs.ids, arr["local_region"].astype(np.int64))
            rpos = np.searchsorted(self._ids, arr["remote_region"].astype(np.int64))
            n = len(arr)
            ldesc = np.empty((n, 3), dtype=np.uint64)
            rdesc = np.empty((n, 3), dtype=np.uint64)
            np.add(ep.regs.addrs[lpos], arr["local_offset"], out=ldesc[:, 0])
            ldesc[:, 1] = arr["length"]
            ldesc[:, 2] = 0
            np.add(self._addrs[rpos], arr["remote_offset"], out=rdesc[:, 0])
            rdesc[:, 1] = arr["length"]
            rdesc[:, 2] = self._devs[rpos]
            total = int(arr["length"].sum(dtype=np.uint64))
            local_ids = frozenset(np.unique(arr["local_region"]).tolist())
            remote_ids = frozenset(np.unique(arr["remote_region"]).tolist())
            if total >= ep.split_min and ep.posters is not None:
                return self._submit_split(op, ldesc, rdesc, total, len(arr), local_ids, remote_ids, deadline)
            chunks = chunk(ldesc, rdesc, max_bytes, max_descs)
            batch = Xfer(self, op, chunks, deadline, total, len(arr), local_ids, remote_ids)
            self._batches.add(batch)
            ep.regs.track(batch)   # the endpoint's deregistration / close fails it
            self._stats["requests"] += len(chunks)
            # posted under the locks: a DRAIN/deregistration either sees this batch or refuses it
            batch.start()
        return batch

    def _submit_split(self, op: str, ldesc: Any, rdesc: Any, total: int, nops: int, local_ids: frozenset,
                      remote_ids: frozenset, deadline: float) -> Completion:
        """Cut a batch (descriptor arrays, both locks held) by bytes into ``PARTS_PER_THREAD`` parts per
        posting thread and queue them for the threads.  Every part is tracked here, under the locks,
        before any is posted: a DRAIN, deregistration, close or lost peer either came first (refused
        above) or fails the parts, and a part failed before a thread runs it posts nothing."""
        ep = self.endpoint
        posters = ep.posters
        assert posters is not None
        n = len(posters.threads) * PARTS_PER_THREAD
        max_bytes, max_descs = int(ep.cfg[OPT_CHUNK_BYTES]), int(ep.cfg[OPT_CHUNK_DESCS])
        ldesc, rdesc = split_big(ldesc, rdesc, -(-total // n))   # one huge op is cut too
        cuts = split_bounds(ldesc[:, 1], n)
        split = Split(op, total, nops, deadline)
        for a, b in zip(cuts, cuts[1:]):
            chunks = chunk(ldesc[a:b], rdesc[a:b], max_bytes, max_descs)
            part = Xfer(self, op, chunks, deadline, int(ldesc[a:b, 1].sum(dtype=np.uint64)), b - a,
                         local_ids, remote_ids, parent=split)
            split.parts.append(part)
            self._stats["requests"] += len(chunks)
        split.left = len(split.parts)
        for part in split.parts:
            self._batches.add(part)
            ep.regs.track(part)   # the endpoint's deregistration / close fails it
        for part in split.parts:
            posters.submit(part)
        return split

    def quick_run(self, op: str, ldesc: Any, rdesc: Any, nbytes: int, nops: int, local_ids: frozenset,
                   remote_ids: frozenset, ev: int, cv: int, deadline: float) -> int:
        """Post one batch of one request (two NIXL transfer descriptor lists of ``nops`` entries) made by a one-call
        plan of table versions ``ev`` / ``cv`` and wait for it in this thread: ``nbytes``, or
        :data:`~llmdd_ucx._quick.STALE` (nothing done) when a table changed, the channel, the endpoint
        or the peer went since; raises the batch's error when it failed (deadline, peer gone, a
        deregistration or DRAIN that failed it)."""
        ep = self.endpoint
        with ep.lock, self._lock:
            # the versions are read under the locks their bumps take: a deregistration, DRAIN, BYE or
            # close either came first (the plan declines) or finds this batch tracked (and fails it)
            if (ep.table_version != ev or self.table_version != cv or ep.closed or self._batches.closed
                    or self._gone is not None):
                return _quick.STALE
            batch = Xfer(self, op, [(ldesc, rdesc)], deadline, nbytes, nops, local_ids, remote_ids, quick=True)
            self._batches.add(batch)
            ep.regs.track(batch)   # the endpoint's deregistration / close fails it
            self._stats["requests"] += 1
            batch.start()   # posted under the locks, as _submit does (one chunk: no driver thread)
        if not batch.finished:
            batch.wait()    # polls in this thread until done, failed by another, or the deadline
        err = batch.error
        if err is not None:
            raise err
        return nbytes
