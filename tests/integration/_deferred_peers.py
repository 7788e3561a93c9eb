"""Child-side helpers of test_deferred_offers (run inside harness children)."""

from __future__ import annotations

import time
from typing import Optional

from llmdd import LLMConfig, LLMDataDist, LLMRole
from llmdd.abc import Endpoint, EndpointDescriptor, RegionDescriptor, Transport, TransportInfo
from llmdd.plugin import hookimpl
from llmdd._protocol import messages as m

HOST = "127.0.0.1"


class Unusable(Transport):
    """A registered transport that cannot run here (its probe says so), preferred above everything."""

    name = "unusable"
    priority = 1000
    same_host_only = False

    @classmethod
    def probe(cls) -> TransportInfo:
        return TransportInfo(name=cls.name, available=False, reason="test: never available here")

    def open_endpoint(self, *, host: str, secret: Optional[bytes] = None):   # pragma: no cover - never reached
        raise AssertionError("the endpoint of an unavailable transport was opened")


class _IdleEndpoint(Endpoint):
    """An endpoint that describes itself and registers nothing; it never connects (the link that
    chose it is handed back by the client before any channel exists)."""

    opened = 0

    def __init__(self) -> None:
        type(self).opened += 1

    def describe(self) -> EndpointDescriptor:
        return EndpointDescriptor(transport="unusable", version=1, payload=b"idle")

    def register(self, region) -> RegionDescriptor:
        return RegionDescriptor(transport="unusable", version=1, payload=b"")

    def deregister(self, region_id: int) -> None:
        return None

    def connect(self, peer, *, timeout: float):
        raise AssertionError("a channel of the idle test transport was asked for")

    def close(self) -> None:
        return None

    def statistics(self) -> dict:
        return {}


class Usable(Unusable):
    """The same name, runnable: the server side's copy (it never moves a byte: the policy below
    only picks it when the peer offers it, and the test checks the link ends on another one)."""

    @classmethod
    def probe(cls) -> TransportInfo:
        return TransportInfo(name=cls.name, available=True)

    def open_endpoint(self, *, host: str, secret: Optional[bytes] = None):
        return _IdleEndpoint()


class _Register:
    def __init__(self, cls) -> None:
        self.cls = cls

    @hookimpl
    def llmdd_register_transports(self, register) -> None:
        register(self.cls)


class _PreferUnusable:
    """Server policy: choose 'unusable' whenever the client offers it."""

    @hookimpl(tryfirst=True)
    def llmdd_select_transport(self, link, candidates):
        return "unusable" if "unusable" in link.peer_transports else None


def setup(state: dict, role: str, cluster_id: int, *, listen: bool = False, transport: Optional[str] = None,
          fake: Optional[str] = None, prefer_fake: bool = False) -> Optional[int]:
    old = state.get("dd")
    if old is not None:
        old.finalize()
        state.clear()
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 3000
    if listen:
        cfg.listen_ip_info = f"{HOST}:0"
    options = cfg.generate_options()
    if transport:
        options["llmdd.transport"] = transport
    dd = LLMDataDist(LLMRole[role], cluster_id)
    if fake == "usable":
        dd.add_plugin(_Register(Usable), name="test-usable")
    elif fake == "unusable":
        dd.add_plugin(_Register(Unusable), name="test-unusable")
    if prefer_fake:
        dd.add_plugin(_PreferUnusable(), name="test-prefer-unusable")
    dd.init(options)
    state.update(dd=dd, caches={}, arrays={}, events=[], tasks={}, syncs={})
    return dd.statistics()["listen"][1] if listen else None


def transports(state: dict) -> dict:
    """What this engine probed and opened, and the offers a client handshake would carry now."""
    lm = state["dd"]._core.link_manager
    return {"probed": sorted(lm.registry._infos), "open": sorted(lm.endpoints.open),
            "offers": {o.name: _offer_view(o) for o in lm.offers()}, "unusable": sorted(lm.endpoints.unavailable),
            "idle_endpoints_opened": _IdleEndpoint.opened}


def _offer_view(offer) -> dict:
    """An offer as the tests read it: ``{"deferred": True}`` when offered by name only, else its descriptor."""
    if offer.deferred:
        return {"deferred": True}
    d = offer.descriptor
    return {"transport": d.transport, "version": d.version, "payload": d.payload}


def timed_link(state: dict, remote: int, port: int) -> dict:
    from _dataplane_peers import link

    t0 = time.perf_counter()
    status = link(state, remote, port)
    return {"status": status, "ms": (time.perf_counter() - t0) * 1e3,
            "transport": state["dd"].statistics()["links"].get(remote, {}).get("transport")}


def descriptor_request(state: dict, remote: int) -> int:
    """A ``link_descriptor`` request on an established link (nothing waits for one): its status."""
    lm = state["dd"]._core.link_manager
    link = lm.require(remote)
    args = {"name": link.transport, "descriptor": {"x": 1}}
    status, _ = lm.exchange._exchange(link, "link_descriptor",
                                      lambda rid: m.TransferRequest(request_id=rid, op="link_descriptor", args=args),
                                      time.monotonic() + 3)
    return status
