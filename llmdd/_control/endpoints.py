"""This engine's transport endpoints: opened on demand, offered in handshakes, granted per link.

* :class:`Registrar`: one thread that runs endpoint registrations and table announcements one at
  a time, in submission order, with no lock held (plugins, the memory manager and sockets are
  called from there, never under a lock).
* :class:`TransportEndpoints`: opens each transport's endpoint once (its data port serves linked
  peers' grants only), keeps every local region registered on every open endpoint, builds the
  handshake's transport offers (deferred ones in automatic mode: by name, neither probed nor
  opened), and grants or revokes a link's capability on its transport's data port.

Descriptors: the seam's :class:`~llmdd.abc.EndpointDescriptor` / :class:`~llmdd.abc.RegionDescriptor`
travel as :class:`~llmdd._protocol.messages.TransportDescriptor` (:func:`to_wire`,
:func:`endpoint_descriptor`, :func:`peer_region_descriptor`); the control plane's own facts about an
offer (deferred, the link's capability) are typed fields of the offer, never keys inside a
transport's payload.

What a data port that cannot continue means for the links over it is the link manager's
business: it is told through ``on_data_port_failed`` and calls :meth:`TransportEndpoints.forget`.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import types
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional

import attrs
import msgspec

from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions
from llmdd._runtime.runtime import PoolFull, Runtime
from llmdd._runtime.ioloop import Strand
from llmdd._control.link import Link
from llmdd._protocol import messages as m
from llmdd._control.settings import LinkSettings
from llmdd._seam.errors import Refused
from llmdd._base.status import TransportError
from llmdd._seam.abc import CAPABILITY_BYTES, Endpoint, EndpointDescriptor, MemRegion, RegionDescriptor

if TYPE_CHECKING:
    from llmdd._memory.manager import MemoryManager
    from llmdd._memory.regions import Region
    from llmdd.plugin import TransportRegistry

__all__ = ["Registrar", "TransportEndpoints", "to_wire", "endpoint_descriptor", "peer_region_descriptor", "offer_args",
           "offer_from_args"]

_log = get_logger("llmdd.link")



# ---------------------------------------------------------------------- descriptors on the wire
def to_wire(desc: "EndpointDescriptor | RegionDescriptor") -> m.TransportDescriptor:
    """A seam descriptor as the wire carries it (an endpoint descriptor's capability is not carried:
    the control plane sends the link's own in :attr:`TransportOffer.capability`)."""
    return m.TransportDescriptor(transport=desc.transport, version=desc.version, payload=desc.payload)


def endpoint_descriptor(offer: m.TransportOffer) -> EndpointDescriptor:
    """The peer endpoint's descriptor in ``offer``, with the capability the peer granted the link:
    what ``Endpoint.connect`` takes.  :class:`~llmdd.lowlevel.Refused` for a deferred offer."""
    d = offer.descriptor
    if d is None:
        raise Refused(f"the peer offered {offer.name!r} deferred and has sent no descriptor for it")
    return EndpointDescriptor(transport=d.transport, version=d.version, payload=d.payload,
                              capability=offer.capability)


def peer_region_descriptor(region: m.RegionDescriptor, name: str) -> Optional[RegionDescriptor]:
    """The descriptor of transport ``name`` in a peer's region announcement (what
    ``Channel.add_remote_region`` takes), or None when the peer registered the region without it."""
    d = region.transport(name)
    if d is None:
        return None
    return RegionDescriptor(transport=d.transport, version=d.version, payload=d.payload)


def offer_args(offer: m.TransportOffer) -> dict:
    """``offer`` (not deferred) as the arguments of a ``link_descriptor`` request."""
    d = offer.descriptor
    if d is None:
        raise ValueError(f"offer {offer.name!r} is deferred: no descriptor to send")
    return {"name": offer.name, "transport": d.transport, "version": d.version, "payload": d.payload,
            "capability": offer.capability}


def offer_from_args(args: Mapping[str, Any]) -> m.TransportOffer:
    """The offer a ``link_descriptor`` request carries; :class:`~llmdd._protocol.messages.InvalidMessage`
    when its arguments do not make one (types and bounds as the typed wire checks them)."""
    try:
        desc = m.TransportDescriptor(transport=args["transport"], version=args["version"], payload=args["payload"])
        return m.TransportOffer(name=args["name"], descriptor=desc, capability=args.get("capability"))
    except KeyError as exc:
        raise m.InvalidMessage(f"link_descriptor request without {exc.args[0]!r}") from None


class Registrar:
    """One thread running endpoint registrations and table announcements, in order, no lock held."""

    def __init__(self, name: str, runtime: Runtime) -> None:
        self._runtime = runtime
        self._pool = runtime.make_pool(1, name)
        self._strand = Strand(self._pool)
        self._local = runtime.local()

    def _run_marked(self, fn: Callable, *args: Any) -> Any:
        self._local.active = True
        try:
            return fn(*args)
        finally:
            self._local.active = False

    def call(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn`` on the registrar (inline when already there) and return its result."""
        if getattr(self._local, "active", False):
            return fn(*args)
        done = self._runtime.event()
        outcome: list = []   # [True, result] or [False, exception], set once by run()

        def run() -> None:
            try:
                outcome[:] = [True, self._run_marked(fn, *args)]
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome[:] = [False, exc]
            done.set()

        try:
            self._strand.submit(run)
        except PoolFull:
            run()  # closed (finalize) or no thread to be had: run here, still outside any lock
        done.wait()
        ok, value = outcome
        if not ok:
            raise value
        return value

    def post(self, fn: Callable, *args: Any, run_here_if_full: bool) -> None:
        """Queue ``fn`` without waiting for it; when the registrar takes nothing more (closed or no
        thread to be had) run it here if ``run_here_if_full``, else drop it."""
        try:
            self._strand.submit(functools.partial(self._run_marked, fn, *args))
        except PoolFull:
            if run_here_if_full:
                fn(*args)

    def threads(self) -> int:
        return self._pool.threads()

    def close(self) -> None:
        self._pool.close()


class TransportEndpoints:
    """The transport endpoints of one engine and what links need of them."""

    def __init__(self, *, registry: "TransportRegistry", options: EngineOptions, settings: LinkSettings,
                 memory: "MemoryManager", registrar: Registrar, data_host: Callable[[], str],
                 on_data_port_failed: Callable[[str, Endpoint, str], None]) -> None:
        self.registry = registry
        self._options = options
        self._settings = settings
        self._memory = memory
        self._registrar = registrar
        self._data_host = data_host
        self._on_data_port_failed = on_data_port_failed
        self._endpoints: dict[str, Endpoint] = {}
        # local region id -> {transport: its descriptor} (registrar only)
        self._region_descs: dict[int, dict[str, RegionDescriptor]] = {}
        self._unavailable: set[str] = set()          # transports found unusable here after a deferred offer
        self._grant_ids = itertools.count(1)
        self._opening = True

    # ------------------------------------------------------------------ endpoints
    @property
    def open(self) -> Mapping[str, Endpoint]:
        """The endpoints open now, by transport name (read-only)."""
        return types.MappingProxyType(self._endpoints)

    @property
    def unavailable(self) -> frozenset:
        """Transports offered deferred that turned out unusable here (never offered again)."""
        return frozenset(self._unavailable)

    def get(self, name: Optional[str]) -> Optional[Endpoint]:
        return self._endpoints.get(name) if name else None

    def endpoint(self, name: str) -> Endpoint:
        """The endpoint of transport ``name``, opened (on the registrar) when it is not yet."""
        ep = self._endpoints.get(name)
        if ep is not None:
            return ep
        return self._registrar.call(self._open_endpoint, name)

    def _open_endpoint(self, name: str) -> Endpoint:
        ep = self._endpoints.get(name)
        if ep is not None:
            return ep
        if not self._opening:
            raise TransportError(f"the engine is finalizing; no {name} endpoint")
        cls = self.registry.get(name)
        transport = cls(self._options.raw)
        ep = transport.open_endpoint(host=self._data_host(), secret=self._settings.secret)
        try:
            # before any region is registered: the data port serves linked peers' grants only
            ep.serve_links_only()
            for region in self._memory.regions.regions():
                self._region_descs.setdefault(region.region_id, {})[name] = ep.register(self.mem_region(region))
        except BaseException:
            try:
                ep.close()
            except TransportError:
                pass
            raise
        self._endpoints[name] = ep
        ep.on_listener_failed(functools.partial(self._on_data_port_failed, name, ep))
        return ep

    def forget(self, name: str, ep: Endpoint) -> None:
        """``ep`` (the endpoint of ``name``) cannot continue: the next link opens a fresh one."""
        if self._endpoints.get(name) is ep:
            del self._endpoints[name]

    def offers(self) -> tuple[m.TransportOffer, ...]:
        """The transports this engine offers in a handshake (only the forced one when forced, so a
        forcing client is honoured even though the server side decides).

        In automatic mode a transport whose endpoint is not open yet is offered *deferred*: by name,
        without a descriptor (``TransportOffer.deferred``), neither probed nor opened (a probe or an
        endpoint may be costly: NIXL's take about half a second).  When the server picks a
        deferred offer the client probes and opens that one transport and sends the endpoint's
        descriptor in a ``link_descriptor`` request before its tables (``LinkManager.connect_peer``)."""
        offers = []
        forced = self._settings.forced_transport
        for name in self.registry.names():
            if forced and name != forced:
                continue
            if not forced and name not in self._endpoints:
                if name not in self._unavailable:
                    offers.append(m.TransportOffer(name=name, deferred=True))
                continue
            if not self.registry.probe(name).available:
                continue
            try:
                desc = self.endpoint(name).describe()
            except (TransportError, OSError) as exc:
                _log.warning("llmdd.transport.endpoint_failed", transport=name, error=str(exc))
                continue
            offers.append(m.TransportOffer(name=name, descriptor=to_wire(desc)))
        return tuple(offers)

    def open_deferred(self, name: str) -> Optional[Endpoint]:
        """The endpoint of a transport this side offered deferred and the server chose: probed and
        opened now; None (and never offered deferred again) when it cannot run here."""
        if not self.registry.probe(name).available:
            self._unavailable.add(name)
            return None
        try:
            return self.endpoint(name)
        except (TransportError, OSError) as exc:
            _log.warning("llmdd.transport.endpoint_failed", transport=name, error=str(exc))
            self._unavailable.add(name)
            return None

    # ------------------------------------------------------------------ per-link capabilities
    def mint(self) -> tuple[int, bytes]:
        """A fresh grant id and capability (256 bits from a CSPRNG) for one link and incarnation."""
        return next(self._grant_ids), secrets.token_bytes(CAPABILITY_BYTES)

    def with_capability(self, offers: tuple, capability: bytes) -> tuple:
        """``offers`` with ``capability`` in the offer of every open transport that uses capabilities."""
        out = []
        for offer in offers:
            ep = self._endpoints.get(offer.name)
            if ep is not None and ep.capabilities and not offer.deferred:
                offer = msgspec.structs.replace(offer, capability=capability)
            out.append(offer)
        return tuple(out)

    def grant(self, link: Link, regions: Iterable[int]) -> None:
        """(Re)grant the link's capability on its transport's endpoint, for ``regions`` (ids)."""
        grant_id, capability = link.grant_id, link.capability
        if grant_id is None:
            return
        if capability is None:   # minted together with the grant id (mint), set together on the link
            raise RuntimeError(f"link to {link.peer_cluster_id}: grant {grant_id} has no capability")
        ep = self.get(link.transport)
        if ep is not None and ep.capabilities:
            ep.grant(grant_id, capability, tuple(regions))

    def revoke(self, name: Optional[str], grant_id: Optional[int]) -> None:
        if grant_id is None:
            return
        ep = self.get(name)
        if ep is None:
            return
        try:
            ep.revoke(grant_id)
        except TransportError as exc:
            _log.warning("llmdd.link.revoke_failed", transport=name, error=str(exc))

    # ------------------------------------------------------------------ regions
    def granted(self, region: "Region") -> bool:
        """May linked peers access ``region``?  In remote-accessible mode only regions registered
        remote-accessible; otherwise every cache of the engine is served to linked peers, as
        upstream's engine serves pulls of any cache in that mode."""
        return bool(region.remote_accessible) or not self._options.remote_cache_accessible

    def mem_region(self, region: "Region") -> MemRegion:
        return attrs.evolve(region.to_mem_region(), remote_accessible=self.granted(region))

    def region_descriptor(self, region: "Region") -> m.RegionDescriptor:
        return m.RegionDescriptor(
            region_id=region.region_id, cache_id=region.cache_id, addr=region.addr, size=region.size,
            placement=region.placement, remote_accessible=self.granted(region),
            transports=tuple(to_wire(d) for d in self._region_descs.get(region.region_id, {}).values()))

    def on_regions_changed(self, kind: str, regions: tuple, version: int) -> None:
        """The memory manager's region listener: synchronous, so a removed region is deregistered
        from every endpoint before this returns."""
        self._registrar.call(self._apply_region_change, kind, regions)

    def _apply_region_change(self, kind: str, regions: tuple) -> None:
        endpoints = list(self._endpoints.items())
        for region in regions:
            if kind in ("remove", "remap"):
                descs = self._region_descs.get(region.region_id, {})
                for name, ep in endpoints:
                    if name in descs or kind == "remove":
                        ep.deregister(region.region_id)
                if kind == "remove":
                    self._region_descs.pop(region.region_id, None)
                    continue
                descs.clear()
            descs = self._region_descs.setdefault(region.region_id, {})
            for name, ep in endpoints:
                if name not in descs:
                    descs[name] = ep.register(self.mem_region(region))
        # announcements follow the memory manager's change notice, once caches and keys are consistent

    # ------------------------------------------------------------------ teardown
    def stop_opening(self) -> None:
        """Finalize has begun: no endpoint is opened any more."""
        self._opening = False

    def close(self) -> None:
        """Close every endpoint (after the registrar is closed: nothing registers meanwhile)."""
        self._opening = False
        endpoints, self._endpoints = self._endpoints, {}
        for ep in endpoints.values():
            try:
                ep.close()
            except TransportError:
                pass
