"""The ``sim`` endpoint, channel and completion: one-sided batches as timers of the fabric's clock.

A batch is checked against both sides' tables when it is submitted (a refusal moves nothing) and
*lands* later, at one timer of the fabric's clock: the latency drawn for it (base, jitter, bytes over
bandwidth) after submission.  The landing runs under the fabric's lock and re-checks everything at
that moment: the batch is still running (a finished, failed, cancelled or timed-out batch lands
nowhere: what done means), the local regions are still registered with the generation they had at
submission, the owner endpoint is alive, not closed, reachable and not frozen (a frozen owner parks
the landing until it thaws) and still holds each remote region with the descriptor's generation.
Only then are the bytes copied (``ctypes.memmove`` between the simulated processes' memories, which
all live in this Python process).  The deadline is a second timer: when it fires first the batch
fails with :class:`TransportTimeout`.  ``deregister`` and ``close`` fail the batches that touch what
they remove under the same lock, so after they return no landing touches that memory.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Union

import msgspec
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine loads none

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import (Cancelled, Corrupt, DoneCompletion, MemRegion, PeerGone, Refused, RegionTable,
                            TransportError, TransportTimeout, check_ops, decode_payload, encode_payload)

from llmdd_sim._fabric import Fabric

__all__ = ["SimEndpoint", "SimChannel", "SimCompletion", "VERSION"]

NAME = "sim"
#: the version of this transport's descriptor payloads
VERSION = 1
READ, WRITE = "read", "write"


class _EndpointFields(msgspec.Struct, frozen=True):
    fabric: str
    endpoint_id: int
    process: str
    incarnation: int


class _RegionFields(msgspec.Struct, frozen=True):
    endpoint_id: int
    region_id: int
    generation: int
    size: int


class SimCompletion(Completion):
    """One batch: finished by its landing, its deadline timer, a cancel, or a region or channel going."""

    __slots__ = ("_fabric", "id", "deadline", "_done", "_error", "channel", "ops", "kind", "local_gens",
                 "timers")

    def __init__(self, fabric: Fabric, channel: "SimChannel", kind: str, ops: np.ndarray, deadline: float,
                 local_gens: dict[int, int]) -> None:
        self._fabric = fabric
        self.id = fabric.next_id()
        self.deadline = deadline
        self._done = False
        self._error: Optional[TransportError] = None
        self.channel = channel
        self.ops = ops
        self.kind = kind
        self.local_gens = local_gens
        self.timers: list[Any] = []

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: Union[float, None] = None) -> bool:
        clock = self._fabric.clock
        until = self.deadline if timeout is None else min(clock.now() + max(0.0, timeout), self.deadline)
        clock.run_until(self.done, until, self)
        if not self._done and clock.now() >= self.deadline:
            with self._fabric.lock:
                self.finish(TransportTimeout(f"sim batch {self.id} missed its deadline"))
        return self._done

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error

    def cancel(self) -> None:
        with self._fabric.lock:
            self.finish(Cancelled(f"sim batch {self.id} cancelled"))

    def finish(self, error: Optional[TransportError]) -> None:
        """End the batch (under the fabric's lock); a second finish is ignored."""
        if self._done:
            return
        self._error = error
        self._done = True
        for t in self.timers:
            t.cancel()
        self.timers.clear()
        self.channel._inflight.pop(self.id, None)
        self._fabric.emit("finish", self.id, error)
        self._fabric.clock.notify(self)

    def __repr__(self) -> str:
        return f"<SimCompletion {self.id} {self.kind} done={self._done} error={self._error!r}>"


class _Local:
    __slots__ = ("region", "generation")

    def __init__(self, region: MemRegion, generation: int) -> None:
        self.region = region
        self.generation = generation


class SimEndpoint(Endpoint):
    """One simulated process's endpoint: its registered regions and the channels it opened."""

    def __init__(self, fabric: Fabric, process: str) -> None:
        self.fabric = fabric
        self.process = process
        self.incarnation = fabric.incarnation(process)
        self.id = fabric.next_id()
        self.regions: dict[int, _Local] = {}
        self.channels: list[SimChannel] = []
        self.closed = False
        self.dead = False
        self._stats: dict[str, int] = {"regions": 0, "bytes_served": 0, "refused": 0}
        with fabric.lock:
            fabric.endpoints[self.id] = self

    # ------------------------------------------------------------------ the seam
    def describe(self) -> EndpointDescriptor:
        payload = encode_payload(_EndpointFields(self.fabric.name, self.id, self.process, self.incarnation))
        return EndpointDescriptor(transport=NAME, version=VERSION, payload=payload)

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self.fabric.lock:
            if self.closed:
                raise Cancelled("sim endpoint is closed")
            if region.region_id in self.regions:
                raise Refused(f"region {region.region_id} is registered already")
            gen = self.fabric.next_id()
            self.regions[region.region_id] = _Local(region, gen)
            self._stats["regions"] = len(self.regions)
        payload = encode_payload(_RegionFields(self.id, region.region_id, gen, region.size))
        return RegionDescriptor(transport=NAME, version=VERSION, payload=payload)

    def deregister(self, region_id: int) -> None:
        with self.fabric.lock:
            if self.regions.pop(region_id, None) is None:
                return
            self._stats["regions"] = len(self.regions)
            for ch in list(self.channels):
                for c in list(ch._inflight.values()):
                    if region_id in c.local_gens:
                        c.finish(Cancelled(f"local region {region_id} deregistered during the batch"))

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "SimChannel":
        fields = decode_payload(peer, transport=NAME, version=VERSION, type=_EndpointFields)
        with self.fabric.lock:
            if self.closed:
                raise Cancelled("sim endpoint is closed")
            if fields.fabric != self.fabric.name:
                raise Refused(f"a descriptor of sim fabric {fields.fabric!r}, this endpoint is on "
                              f"{self.fabric.name!r}")
            owner = self.fabric.endpoints.get(fields.endpoint_id)
            if owner is None or owner.closed or owner.incarnation != fields.incarnation:
                raise PeerGone(f"sim endpoint {fields.endpoint_id} of {fields.process} is gone")
            if not self.fabric.reachable(self.process, fields.process):
                raise PeerGone(f"{fields.process} is unreachable from {self.process}")
            ch = SimChannel(self, fields.endpoint_id, fields.process, fields.incarnation)
            self.channels.append(ch)
            return ch

    def close(self) -> None:
        with self.fabric.lock:
            if self.closed:
                return
            self.closed = True
            for ch in list(self.channels):
                ch._close_locked(Cancelled("sim endpoint closed"))
            self.regions.clear()
            self.fabric.endpoints.pop(self.id, None)

    def die(self) -> None:
        """The process crashed (under the fabric's lock): closed at once, nothing of it lands."""
        self.dead = True
        for ch in list(self.channels):
            ch._close_locked(PeerGone("sim process crashed"))
        self.closed = True
        self.regions.clear()
        self.fabric.endpoints.pop(self.id, None)

    def statistics(self) -> dict:
        with self.fabric.lock:
            return dict(self._stats)

    # ------------------------------------------------------------------ the owner's side of a landing
    def serve(self, rid: int, generation: int) -> Union[_Local, TransportError]:
        if self.closed:
            return PeerGone(f"sim endpoint of {self.process} closed")
        entry = self.regions.get(rid)
        if entry is None or entry.generation != generation:
            self._stats["refused"] += 1
            return Refused(f"remote region {rid} is not registered (deregistered by its owner)")
        if not entry.region.remote_accessible:
            self._stats["refused"] += 1
            return Refused(f"remote region {rid} is not remote-accessible")
        return entry


class SimChannel(Channel):
    """From one sim endpoint to one peer endpoint (same fabric)."""

    def __init__(self, ep: SimEndpoint, peer_id: int, peer_process: str, peer_incarnation: int) -> None:
        self.ep = ep
        self.fabric = ep.fabric
        self.peer_id = peer_id
        self.peer_process = peer_process
        self.peer_incarnation = peer_incarnation
        self.remote: dict[int, tuple[int, int]] = {}    # region id -> (size, generation)
        self._inflight: dict[int, SimCompletion] = {}
        self.closed = False
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0, "batches": 0,
                       "failures": 0, "last_error": ""}

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = decode_payload(desc, transport=NAME, version=VERSION, type=_RegionFields)
        if fields.endpoint_id != self.peer_id:
            raise Refused(f"region descriptor of sim endpoint {fields.endpoint_id}, this channel reaches "
                          f"{self.peer_id}")
        if fields.region_id != region_id:
            raise Refused(f"region descriptor of region {fields.region_id} given as {region_id}")
        # a size larger than the owner's region is accepted here: the owner refuses what lies outside
        with self.fabric.lock:
            self.remote[region_id] = (size, fields.generation)

    def remove_remote_region(self, region_id: int) -> None:
        with self.fabric.lock:
            self.remote.pop(region_id, None)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return self._submit(READ, ops, deadline)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return self._submit(WRITE, ops, deadline)

    def _submit(self, kind: str, ops: Any, deadline: float) -> Completion:
        fabric = self.fabric
        with fabric.lock:
            try:
                if self.closed or self.ep.closed:
                    raise Cancelled("sim channel is closed")
                local = {rid: e.region.size for rid, e in self.ep.regions.items()}
                arr = check_ops(ops, local, RegionTable({rid: s for rid, (s, _) in self.remote.items()}))
                if fabric.now() >= deadline:
                    raise TransportTimeout("sim batch submitted after its deadline")
            except TransportError as exc:
                self._stats["failures"] += 1
                self._stats["last_error"] = repr(exc)
                return DoneCompletion(exc)
            arr = arr.copy()
            gens = {int(r): self.ep.regions[int(r)].generation for r in np.unique(arr["local_region"]).tolist()}
            c = SimCompletion(fabric, self, kind, arr, deadline, gens)
            self._inflight[c.id] = c
            self._stats["batches"] += 1
            fabric.stats["batches"] += 1
            nbytes = int(arr["length"].sum()) if len(arr) else 0
            delay = fabric.latency(nbytes)
            fault = fabric.draw()
            if fault is not None:
                fabric.stats["faults"] += 1
                fabric.emit("fault", c.id, fault)
            if fault == "late":
                delay = max(delay, deadline - fabric.now()) + fabric.faults.latency_s + delay
            c.timers.append(fabric.clock.call_later(delay, self._land, c, fault))
            if fault == "duplicate":
                fabric.clock.call_later(delay * 2 + fabric.faults.latency_s, self._land, c, "duplicate")
            c.timers.append(fabric.clock.call_later(max(0.0, deadline - fabric.now()), self._expire, c))
            fabric.emit("submit", c.id, (kind, self.ep.process, self.peer_process, len(arr), nbytes))
            return c

    def _expire(self, c: SimCompletion) -> None:
        with self.fabric.lock:
            if not c.done():
                c.finish(TransportTimeout(f"sim batch {c.id} missed its deadline"))

    def _land(self, c: SimCompletion, fault: Optional[str]) -> None:
        fabric = self.fabric
        with fabric.lock:
            if c.done():
                fabric.stats["dropped_after_done"] += 1
                return          # what done means: a finished batch lands nowhere, a duplicate neither
            if self.peer_process in fabric.frozen:
                fabric.park(self.peer_process, self._land, c, fault)
                return
            if not fabric.reachable(self.ep.process, self.peer_process):
                return          # lost in a partition: the deadline ends the batch
            if fault == "fail":
                err: TransportError = (PeerGone if fabric.rng.random() < 0.5 else Corrupt)(
                    f"sim batch {c.id}: injected failure")
                self._fail(c, err)
                return
            owner = fabric.endpoints.get(self.peer_id)
            if owner is None or owner.closed or owner.incarnation != self.peer_incarnation:
                self._fail(c, PeerGone(f"sim peer {self.peer_process} is gone"))
                return
            ops = c.ops
            pairs: list[tuple[int, int, int, int, int]] = []
            ranges: list[tuple[int, int]] = []
            for rid in np.unique(ops["remote_region"]).tolist():
                known = self.remote.get(rid)
                served = owner.serve(rid, known[1]) if known is not None else Refused(f"remote region {rid} unknown")
                if isinstance(served, TransportError):
                    self._fail(c, served)
                    return
                mine = ops[ops["remote_region"] == rid]
                if int((mine["remote_offset"] + mine["length"]).max()) > served.region.size:
                    owner._stats["refused"] += 1
                    self._fail(c, Refused(f"an op lies outside remote region {rid} ({served.region.size} bytes)"))
                    return
            for rid, gen in c.local_gens.items():
                entry = self.ep.regions.get(rid)
                if entry is None or entry.generation != gen:
                    self._fail(c, Cancelled(f"local region {rid} deregistered during the batch"))
                    return
            n = len(ops)
            if fault == "partial" and n:
                n = fabric.rng.randrange(0, n)
            for op in ops[:n].tolist():
                lr, lo, rr, ro, ln = op
                laddr = self.ep.regions[lr].region.addr + lo
                raddr = owner.regions[rr].region.addr + ro
                src, dst = (raddr, laddr) if c.kind == READ else (laddr, raddr)
                if ln:
                    ctypes.memmove(dst, src, ln)
                pairs.append((lr, lo, rr, ro, ln))
                ranges.append((dst, ln))
            fabric.stats["landed"] += 1
            # what landed where: the simulator's byte oracle checks every range against the calls open now
            fabric.emit("land", c.id, {"kind": c.kind, "process": self.ep.process, "peer": self.peer_process,
                                       "dst_process": self.ep.process if c.kind == READ else self.peer_process,
                                       "ranges": ranges})
            if fault == "partial":
                self._fail(c, PeerGone(f"sim batch {c.id}: connection lost after {n} of {len(ops)} ops"))
                return
            nbytes = sum(p[4] for p in pairs)
            key = "read" if c.kind == READ else "written"
            self._stats[f"bytes_{key}"] += nbytes
            self._stats[f"ops_{key}"] += len(pairs)
            owner._stats["bytes_served"] += nbytes
            c.finish(None)

    def _fail(self, c: SimCompletion, err: TransportError) -> None:
        self._stats["failures"] += 1
        self._stats["last_error"] = repr(err)
        c.finish(err)

    def _close_locked(self, err: TransportError) -> None:
        self.closed = True
        for c in list(self._inflight.values()):
            c.finish(err)
        if self in self.ep.channels:
            self.ep.channels.remove(self)

    def close(self) -> None:
        with self.fabric.lock:
            if not self.closed:
                self._close_locked(Cancelled("sim channel closed"))

    def statistics(self) -> dict:
        with self.fabric.lock:
            return dict(self._stats)
