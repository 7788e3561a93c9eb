"""A minimal in-memory transport for engines on one :class:`~llmdd.testing.sim.world.World`.

Every simulated process lives in this one real process, so a region registered by one engine is
reachable by address from every other: a batch is copied at once (``copy_runs``), after the
batch's ops were checked against both sides' registered regions of now, and its completion is
already done (``DoneCompletion``).  What it refuses, as the seam says: ops that are not
``OP_DTYPE`` or out of bounds, a region the owner deregistered, a closed channel or endpoint, a
peer endpoint that closed (``PeerGone``), a deadline already past (``TransportTimeout``).

It is the transport of :func:`llmdd.testing.sim.engines.sim_plugin` (forced with
``llmdd.transport=sim``): one class per world, registered through the ordinary
``llmdd_register_transports`` hook.  It has no latency and no faults of its own; the
simulation's transport plugin with those (``plugins/llmdd-transport-sim``) builds on the same seam.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor, Transport
from llmdd.abc import TransportInfo
from llmdd.lowlevel import (
    DoneCompletion, MemRegion, PeerGone, Refused, TransportError, TransportTimeout, check_ops, copy_runs,
    decode_payload, encode_payload, lazy_numpy as np,
)
from llmdd.testing.sim.world import World

if TYPE_CHECKING:
    from llmdd.testing.sim.runtime import SimRuntime

__all__ = ["transport_for", "open_endpoints", "SimMemTransport"]

NAME = "sim"
VERSION = 1


class _Books:
    """The world's open endpoints of this transport, by id."""

    def __init__(self) -> None:
        self.endpoints: dict[int, "SimMemEndpoint"] = {}
        self.ids = itertools.count(1)


def _books(world: World) -> _Books:
    books = world.shared.get(NAME)
    if books is None:
        books = world.shared[NAME] = _Books()

        def crashed(runtime: SimRuntime) -> None:   # a crashed process's endpoints are gone with it
            for ep in [ep for ep in books.endpoints.values() if ep.runtime is runtime]:
                ep.close()

        world.crash_hooks.append(crashed)
    return books


def open_endpoints(world: World) -> int:
    """Endpoints of this transport open in ``world`` (0 once every engine finalized or crashed)."""
    return len(_books(world).endpoints)


class SimMemChannel(Channel):
    """A channel from a local endpoint to a peer endpoint of the same world."""

    def __init__(self, local: "SimMemEndpoint", peer_id: int) -> None:
        self._local = local
        self._peer_id = peer_id
        self._remote: dict[int, int] = {}   # remote region id -> size (as the peer announced it)
        self._closed = False
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "batches": 0, "failures": 0,
                                       "last_error": None}

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        peer_id, rid, rsize = decode_payload(desc, transport=NAME, version=VERSION, type=tuple[int, int, int])
        if peer_id != self._peer_id or rid != region_id or rsize != size:
            raise Refused(f"region descriptor of endpoint {peer_id} region {rid} does not match region {region_id}")
        self._remote[region_id] = size

    def remove_remote_region(self, region_id: int) -> None:
        self._remote.pop(region_id, None)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return self._batch(ops, deadline, write=False)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        return self._batch(ops, deadline, write=True)

    def _batch(self, ops: np.ndarray, deadline: float, *, write: bool) -> Completion:
        try:
            moved = self._move(ops, deadline, write)
        except TransportError as exc:
            self._stats["failures"] += 1
            self._stats["last_error"] = repr(exc)
            return DoneCompletion(exc)
        self._stats["batches"] += 1
        self._stats["bytes_written" if write else "bytes_read"] += moved
        return DoneCompletion()

    def _move(self, ops: np.ndarray, deadline: float, write: bool) -> int:
        if self._closed or self._local.closed:
            raise PeerGone("the channel is closed")
        if self._local.world.now >= deadline:
            raise TransportTimeout("the batch's deadline has passed")
        peer = _books(self._local.world).endpoints.get(self._peer_id)
        if peer is None or peer.closed:
            raise PeerGone(f"peer endpoint {self._peer_id} is closed")
        remote = {rid: size for rid, size in self._remote.items() if rid in peer.regions}
        arr = check_ops(ops, {rid: r.size for rid, r in self._local.regions.items()}, remote)
        if not len(arr):
            return 0
        local_base = np.array([self._local.regions[int(r)].addr for r in arr["local_region"].tolist()], np.uint64)
        remote_base = np.array([peer.regions[int(r)].addr for r in arr["remote_region"].tolist()], np.uint64)
        local_addr = local_base + arr["local_offset"]
        remote_addr = remote_base + arr["remote_offset"]
        lengths = arr["length"].astype(np.uint64)
        if write:
            copy_runs(remote_addr, local_addr, lengths)
        else:
            copy_runs(local_addr, remote_addr, lengths)
        return int(lengths.sum())

    def close(self) -> None:
        self._closed = True

    def statistics(self) -> dict:
        return dict(self._stats)


class SimMemEndpoint(Endpoint):
    """One engine's endpoint: its registered regions, reachable by its peers' channels."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.runtime = world.current_runtime()   # the process that opened it (closed when it crashes)
        books = _books(world)
        self.id = next(books.ids)
        books.endpoints[self.id] = self
        self.regions: dict[int, MemRegion] = {}
        self.closed = False

    def describe(self) -> EndpointDescriptor:
        return EndpointDescriptor(transport=NAME, version=VERSION, payload=encode_payload(self.id))

    def register(self, region: MemRegion) -> RegionDescriptor:
        if self.closed:
            raise Refused("the endpoint is closed")
        self.regions[region.region_id] = region
        return RegionDescriptor(transport=NAME, version=VERSION,
                                payload=encode_payload((self.id, region.region_id, region.size)))

    def deregister(self, region_id: int) -> None:
        # batches are copied at once: none is in flight on this region when this returns
        self.regions.pop(region_id, None)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> Channel:
        peer_id = decode_payload(peer, transport=NAME, version=VERSION, type=int)
        found = _books(self.world).endpoints.get(peer_id)
        if found is None or found.closed:
            raise PeerGone(f"no open {NAME} endpoint {peer_id} in this world")
        return SimMemChannel(self, peer_id)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.regions.clear()
        _books(self.world).endpoints.pop(self.id, None)

    def statistics(self) -> dict:
        return {"regions": len(self.regions), "closed": self.closed}


class SimMemTransport(Transport):
    """The transport class of one world (made by :func:`transport_for`)."""

    name: ClassVar[str] = NAME
    priority: ClassVar[int] = -100   # never chosen unless forced (llmdd.transport=sim)
    world: ClassVar[Optional[World]] = None

    @classmethod
    def probe(cls) -> TransportInfo:
        if cls.world is None:
            return TransportInfo(name=NAME, available=False, reason="not bound to a simulated world")
        return TransportInfo(name=NAME, available=True)

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> Endpoint:
        world = type(self).world
        if world is None:
            raise Refused("the sim transport is not bound to a simulated world")
        return SimMemEndpoint(world)


def transport_for(world: World) -> type[SimMemTransport]:
    """The in-memory transport class bound to ``world`` (one class per world, made once)."""
    cls = world.shared.get(f"{NAME}.class")
    if cls is None:
        cls = world.shared[f"{NAME}.class"] = type("SimMemTransport", (SimMemTransport,), {"world": world})
    return cls
