"""The ucx endpoint: one NIXL agent with the UCX backend, its registrations, its channels to peers,
and the notification loop that speaks the control protocol of :mod:`llmdd_ucx._proto`."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Mapping

from llmdd.abc import Endpoint, EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import Cancelled, Corrupt, MemRegion, PeerGone, RegionRegistry, RegisteredRegion
from llmdd.lowlevel import TransportError, encode_payload, get_logger

from . import _nixl, _proto
from ._channel import UcxChannel
from ._fields import VERSION, EndpointFields, RegionFields, endpoint_fields
from ._nixl import nixl_error
from ._lanes import PostThreads, bind_request
from ._options import OPT_CONTROL_TIMEOUT, OPT_DEVICES, OPT_NOTIF_IDLE_MS, OPT_PROGRESS_THREAD, OPT_SPLIT_MIN
from ._options import OPT_THREADS, THREADS_MAX, ucx_env
from ._regs import LocalReg
from ._xfer import xfer_settings

_log = get_logger("llmdd.transport.ucx")

#: threads that serve owners' DRAIN/BYE requests per endpoint (bounded: not one per peer)
_OWNER_WORKERS = 8

#: the endpoints not closed yet: closed at interpreter exit, before Python finalises.  A process that
#: exits with an endpoint open otherwise tears NIXL down under its notification thread (still inside
#: ``get_new_notifs``): "terminate called without an active exception", SIGABRT, about one exit in
#: fifteen here (0 in 30 with the endpoints closed first)
_open_endpoints: "weakref.WeakSet[UcxEndpoint]" = weakref.WeakSet()


@atexit.register
def _close_open_endpoints() -> None:
    for ep in list(_open_endpoints):
        try:
            ep.close()
        except Exception as exc:  # noqa: BLE001 - exit goes on; the others still close
            _log.warning("llmdd.transport.ucx.exit_close_failed", agent=ep.agent_name, error=repr(exc))


class UcxEndpoint(Endpoint):
    """One NIXL agent: registrations, the notification loop, channels to peers."""

    def __init__(self, *, host: str, cfg: Mapping[str, Any]) -> None:
        api = _nixl.load()
        self.cfg = dict(cfg)
        self.xfer_settings = xfer_settings(self.cfg)   # what each batch needs of the options, read once
        #: bumped (under the lock) on every change of the local region table and at close: a one-call
        #: plan (llmdd_ucx._quick) made on an older version declines
        self.table_version = 0
        self._host = host
        self._name = f"llmdd-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # a large batch is split across `threads` posting threads, each on a UCX worker of its own
        # (llmdd_ucx._lanes): the agent then lets data-path calls run concurrently (RW); one thread
        # keeps one worker and NIXL's strict serialisation of every call
        threads = min(THREADS_MAX, max(1, int(self.cfg.get(OPT_THREADS, 1))))
        try:
            agent = self._make_agent(api, threads)
        except Exception as exc:  # noqa: BLE001
            if threads == 1:
                raise Corrupt(f"could not create a NIXL agent with the UCX backend: {exc!r}") from None
            # e.g. a UCX built without multi-thread support refuses RW mode: one thread, as before
            _log.warning("llmdd.transport.ucx.no_post_threads", threads=threads, error=repr(exc))
            threads = 1
            try:
                agent = self._make_agent(api, 1)
            except Exception as exc2:  # noqa: BLE001
                raise Corrupt(f"could not create a NIXL agent with the UCX backend: {exc2!r}") from None
        self.agent = agent
        self.lock = threading.RLock()
        self.closed = False
        self.regs: RegionRegistry[LocalReg] = RegionRegistry(threading.Condition(self.lock),
                                                               on_rebuild=self._rebuild)
        self._gen = int.from_bytes(os.urandom(6), "little") << 8
        self._channels: set[UcxChannel] = set()
        self._by_peer: dict[str, set] = {}
        self._clients: dict[str, int] = {}
        self._waiters: dict[int, threading.Event] = {}
        self._stranded: list = []
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"regions": 0, "registered_bytes": 0, "clients": 0, "notifs_in": 0,
                                       "notifs_out": 0, "drains": 0, "control_timeouts": 0, "last_error": None}
        # what peers receive: the agent's connection info only (no region keys); a region's remote
        # key travels in its own descriptor, and only when the region is remote-accessible
        self._metadata = agent.get_partial_agent_metadata(
            api.nixlBind.nixlRegDList(agent.nixl_mems["DRAM"], np.empty((0, 3), np.uint64)), True)
        self._log = _log.bind(agent=self._name)
        # the posting threads, bound to their workers before any other thread can use the agent
        self.posters: "PostThreads | None" = None
        self.split_min = max(1, int(self.cfg.get(OPT_SPLIT_MIN, 8 << 20)))
        if threads > 1:
            self.posters = self._start_posters(threads)
            if self.posters is not None:   # an endpoint dropped without close() ends its threads too
                weakref.finalize(self, self.posters.stop)
        self._stats["post_threads"] = len(self.posters.threads) if self.posters is not None else 0
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the notification loop early (a request awaits a reply, close)
        # owners' DRAIN/BYE are served off the notification loop by at most _OWNER_WORKERS threads
        # (started on demand), however many peers ask at once
        self._owner_requests = concurrent.futures.ThreadPoolExecutor(
            max_workers=_OWNER_WORKERS, thread_name_prefix="llmdd-ucx-drain")
        self._notif_thread = threading.Thread(target=self._notif_loop, name=f"llmdd-ucx-ctl-{self._name[-6:]}",
                                              daemon=True)
        self._notif_thread.start()
        _open_endpoints.add(self)

    # ------------------------------------------------------------------ public API

    @property
    def agent_name(self) -> str:
        return self._name

    def describe(self) -> EndpointDescriptor:
        fields = EndpointFields(agent=self._name, metadata=bytes(self._metadata), host=self._host,
                                hostname=socket.gethostname(), pid=os.getpid())
        return EndpointDescriptor(transport="ucx", version=VERSION, payload=encode_payload(fields))

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self.lock:
            if self.closed:
                raise Cancelled("endpoint is closed")
            self.regs.check_new(region.region_id)
            dlist = None
            partial = b""
            if region.size:
                try:
                    dlist = self.agent.register_memory(
                        np.array([[region.addr, region.size, 0]], dtype=np.uint64), "DRAM")
                    if region.remote_accessible:   # a key for peers only where they may reach it
                        partial = self.agent.get_partial_agent_metadata(dlist, False)
                except Exception as exc:  # noqa: BLE001
                    raise nixl_error(exc, f"registering region {region.region_id}") from None
            self._gen += 1
            self.regs.add(LocalReg(region, dlist, self._gen))
        fields = RegionFields(agent=self._name, region_id=region.region_id, addr=region.addr, size=region.size,
                              gen=self._gen, remote_accessible=region.remote_accessible, metadata=bytes(partial))
        return RegionDescriptor(transport="ucx", version=VERSION, payload=encode_payload(fields))

    def deregister(self, region_id: int) -> None:
        # this side: fail the batches touching it and drain them (requests in flight polled out)
        reg = self.regs.deregister(region_id)
        if reg is None:
            return
        # the owner side: every client refuses new ops on it and drains what touches it
        if reg.region.remote_accessible:
            self._broadcast(_proto.DRAIN, _proto.pack_region(region_id, reg.gen))
        with self.lock:
            self._stats["drains"] += 1
            if reg.dlist is not None and not self.closed:
                try:
                    self.agent.deregister_memory(reg.dlist)
                except Exception as exc:  # noqa: BLE001
                    self._log.warning("llmdd.transport.ucx.deregister_failed", region=region_id, error=repr(exc))

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "UcxChannel":
        deadline = time.monotonic() + timeout
        if self.closed:
            raise Cancelled("endpoint is closed")
        fields = endpoint_fields(peer)
        try:
            name = self.agent.add_remote_agent(fields.metadata)
        except Exception as exc:  # noqa: BLE001
            raise PeerGone(f"cannot load the peer's NIXL metadata: {nixl_error(exc, 'add_remote_agent')}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != fields.agent:
            raise Corrupt(f"peer metadata names agent {name!r}, description says {fields.agent!r}")
        ch = UcxChannel(self, name)
        with self.lock:
            self._channels.add(ch)
            self._by_peer.setdefault(name, set()).add(ch)
        try:
            ok = self.request(name, _proto.HELLO, self._metadata,
                               max(0.05, deadline - time.monotonic()))
        except TransportError:
            ok = False
        if not ok:
            ch.mark_gone(PeerGone(f"peer agent {name} did not answer the ucx handshake"), notify=False)
            ch.close()
            raise PeerGone(f"peer agent {name} did not answer the ucx handshake within {timeout:.1f}s")
        return ch

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.table_version += 1
            channels = list(self._channels)
        _open_endpoints.discard(self)
        for ch in channels:
            ch.close()
        self.regs.close()   # what is left: cancel, then drain
        self._broadcast(_proto.BYE, b"")
        self._stop.set()
        self._kick.set()
        if self._notif_thread is not threading.current_thread():
            self._notif_thread.join(5.0)
        self._owner_requests.shutdown(wait=False)
        if self.posters is not None:   # the channels' batches are over (failed and drained above)
            self.posters.close()
        with self.lock:
            for reg in self.regs.entries.values():
                if reg.dlist is not None:
                    try:
                        self.agent.deregister_memory(reg.dlist)
                    except Exception as exc:  # noqa: BLE001
                        self._log.warning("llmdd.transport.ucx.deregister_failed", error=repr(exc))
            self.regs.entries.clear()
            self.regs.rebuild()
            if not self._stranded:
                self.agent = None  # the agent (and its UCX worker) goes with its last reference

    def statistics(self) -> dict:
        with self.lock:
            return dict(self._stats, agent=self._name, channels=len(self._channels), clients=len(self._clients),
                        stranded_requests=len(self._stranded), closed=self.closed)

    # ------------------------------------------------------------------ internals

    def _make_agent(self, api: Any, threads: int) -> Any:
        """A NIXL agent with the UCX backend: ``threads`` workers in RW mode, or one in strict mode."""
        init = {}
        if self.cfg.get(OPT_DEVICES):
            init["ucx_devices"] = str(self.cfg[OPT_DEVICES])
        if threads > 1:
            init["num_workers"] = str(threads)
        # NIXL's progress thread busy-polls the worker when UCX's transports cannot wake it (the
        # same-host shared-memory / cma transports have no event fd): a core per idle engine. Off by
        # default: requests are progressed by whoever waits on them (check_xfer_state) and the
        # notification loop below; cross-host UCX-over-tcp targets may want it (option = 1).
        modes = api.nixl_thread_sync_t
        sync = modes.NIXL_THREAD_SYNC_RW if threads > 1 else modes.NIXL_THREAD_SYNC_STRICT
        conf = api.nixl_agent_config(enable_prog_thread=bool(int(self.cfg.get(OPT_PROGRESS_THREAD, 0))), backends=[],
                                     sync_mode=sync)
        with _nixl.scoped_env(ucx_env(self.cfg)):
            agent = api.nixl_agent(self._name, conf)
            agent.create_backend("UCX", init)
        return agent

    def _start_posters(self, n: int) -> "PostThreads | None":
        """``n`` posting threads, thread ``i`` bound to UCX worker ``i`` (a loopback request each, one
        after another); None (no split) when binding failed."""
        agent = self.agent
        scratch = np.zeros(128, np.uint8)
        try:
            dl = agent.register_memory(np.array([[scratch.ctypes.data, scratch.nbytes, 0]], np.uint64), "DRAM")
        except Exception as exc:  # noqa: BLE001
            self._log.warning("llmdd.transport.ucx.no_post_threads", error=repr(exc))
            return None
        try:
            posters = PostThreads(n, bind_request(agent, self._name, scratch), self._name[-6:])
        finally:
            try:
                agent.deregister_memory(dl)
            except Exception as exc:  # noqa: BLE001
                self._log.warning("llmdd.transport.ucx.deregister_failed", error=repr(exc))
        if not posters.ok:
            posters.close()
            self._log.warning("llmdd.transport.ucx.no_post_threads", error="binding a posting thread failed")
            return None
        return posters

    def _rebuild(self, regs: RegionRegistry) -> None:
        self.table_version += 1   # (the registry's lock is this endpoint's)
        self._stats["regions"] = len(regs)
        self._stats["registered_bytes"] = sum(e.region.size for e in regs.entries.values())

    def _send(self, peer: str, kind: int, token: int, payload: bytes = b"") -> bool:
        try:
            self.agent.send_notif(peer, _proto.pack(kind, token, payload))
        except Exception as exc:  # noqa: BLE001 - a gone peer cannot be told anything
            self._log.info("llmdd.transport.ucx.notify_failed", peer=peer, error=repr(exc))
            return False
        with self.lock:
            self._stats["notifs_out"] += 1
        return True

    def request(self, peer: str, kind: int, payload: bytes, timeout: float) -> bool:
        token = int.from_bytes(os.urandom(8), "little")
        ev = threading.Event()
        with self.lock:
            self._waiters[token] = ev
        self._kick.set()  # poll fast until the reply is in
        try:
            if not self._send(peer, kind, token, payload):
                return False
            return ev.wait(timeout)
        finally:
            with self.lock:
                self._waiters.pop(token, None)

    def _broadcast(self, kind: int, payload: bytes) -> None:
        """Send ``kind`` to every client and wait (bounded) for each one's acknowledgement.

        Every request leaves first, then one deadline covers every answer (the notification loop
        sets each waiter): no thread per client, however many peers are linked."""
        with self.lock:
            clients = list(self._clients)
        if not clients:
            return
        timeout = float(self.cfg[OPT_CONTROL_TIMEOUT])
        waits = {peer: (int.from_bytes(os.urandom(8), "little"), threading.Event()) for peer in clients}
        with self.lock:
            for token, ev in waits.values():
                self._waiters[token] = ev
        self._kick.set()  # poll fast until the replies are in
        results: dict[str, bool] = {}
        try:
            for peer, (token, _ev) in waits.items():
                if not self._send(peer, kind, token, payload):
                    results[peer] = False
            deadline = time.monotonic() + timeout
            for peer, (_token, ev) in waits.items():
                if peer not in results:
                    results[peer] = ev.wait(max(0.0, deadline - time.monotonic()))
        finally:
            with self.lock:
                for token, _ev in waits.values():
                    self._waiters.pop(token, None)
        silent = [p for p, ok in results.items() if not ok]
        if silent:
            with self.lock:
                for p in silent:
                    self._clients.pop(p, None)  # unreachable: it cannot post requests any more either
                self._stats["control_timeouts"] += len(silent)
            self._log.warning("llmdd.transport.ucx.client_silent", kind=kind, clients=silent)

    def _notif_loop(self) -> None:
        """Poll NIXL's notifications (which also progresses the worker): every 0.5 ms while a reply
        is awaited or messages arrive, backing off to ``notif_idle_ms`` when idle (no busy polling)."""
        idle = 0.0005
        longest = max(0.0005, float(self.cfg.get(OPT_NOTIF_IDLE_MS, 20.0)) / 1000.0)
        kick = self._kick
        while not self._stop.is_set():
            try:
                agent = self.agent
                notifs = agent.get_new_notifs() if agent is not None else {}
            except Exception as exc:  # noqa: BLE001
                self._log.warning("llmdd.transport.ucx.notif_failed", error=repr(exc))
                notifs = {}
            if not notifs:
                if self._waiters:
                    idle = 0.0005  # a request of ours awaits its reply
                kick.wait(idle)
                if kick.is_set():
                    kick.clear()
                    idle = 0.0005
                else:
                    idle = min(idle * 2, longest)
                continue
            idle = 0.0005
            for sender, msgs in notifs.items():
                sender = sender.decode() if isinstance(sender, bytes) else str(sender)
                for msg in msgs:
                    try:
                        self._on_notif(sender, msg)
                    except Exception as exc:  # noqa: BLE001 - a bad message never kills the loop
                        self._log.warning("llmdd.transport.ucx.bad_notif", peer=sender, error=repr(exc))

    def _on_notif(self, sender: str, msg: bytes) -> None:
        parsed = _proto.unpack(msg)
        if parsed is None:
            return
        kind, token, payload = parsed
        with self.lock:
            self._stats["notifs_in"] += 1
        if kind in (_proto.WELCOME, _proto.DRAINED, _proto.BYE_ACK, _proto.GOODBYE_ACK):
            with self.lock:
                ev = self._waiters.get(token)
            if ev is not None:
                ev.set()
        elif kind == _proto.HELLO:
            if self.closed:
                return
            try:
                self.agent.add_remote_agent(payload)
            except Exception as exc:  # noqa: BLE001
                self._log.warning("llmdd.transport.ucx.hello_failed", peer=sender, error=repr(exc))
                return
            with self.lock:
                self._clients[sender] = self._clients.get(sender, 0) + 1
                self._stats["clients"] = len(self._clients)
            self._send(sender, _proto.WELCOME, token)
        elif kind == _proto.GOODBYE:
            with self.lock:
                n = self._clients.get(sender, 0) - 1
                if n > 0:
                    self._clients[sender] = n
                else:
                    self._clients.pop(sender, None)
                self._stats["clients"] = len(self._clients)
            self._send(sender, _proto.GOODBYE_ACK, token)
        elif kind in (_proto.DRAIN, _proto.BYE):
            # served off the loop (draining polls NIXL and must not hold it up), on a bounded pool
            try:
                self._owner_requests.submit(self._serve_owner_request, sender, kind, token, payload)
            except RuntimeError as exc:  # closing, or no thread to be had: the owner counts us silent
                self._log.warning("llmdd.transport.ucx.owner_request_dropped", peer=sender, error=repr(exc))

    def _serve_owner_request(self, sender: str, kind: int, token: int, payload: bytes) -> None:
        with self.lock:
            channels = list(self._by_peer.get(sender, ()))
        if kind == _proto.DRAIN:
            region = _proto.unpack_region(payload)
            if region is None:
                return
            for ch in channels:
                ch.revoke(*region)
            self._send(sender, _proto.DRAINED, token)
        else:
            for ch in channels:
                ch.mark_gone(PeerGone(f"peer agent {sender} closed its endpoint"), notify=False)
            self._send(sender, _proto.BYE_ACK, token)

    def strand(self, requests: list) -> None:
        """Keep NIXL requests that did not drain alive as long as this endpoint (a request is never released
        while in flight: ai-dynamo/nixl#2067); ``statistics()`` counts them."""
        self._stranded.extend(requests)

    def forget_channel(self, ch: "UcxChannel") -> None:
        with self.lock:
            self._channels.discard(ch)
            peers = self._by_peer.get(ch.peer_name)
            if peers is not None:
                peers.discard(ch)
                if not peers:
                    self._by_peer.pop(ch.peer_name, None)

