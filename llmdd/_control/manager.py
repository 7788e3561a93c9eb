"""The link manager: handshakes, table exchange, requests and notices, keepalive, unlink.

One :class:`LinkManager` per initialized engine.  A link to a peer cluster is a TCP
control connection carrying the sans-io protocol of :mod:`llmdd._control.protocol`, plus a
data channel of the transport both sides agreed on.  The link's state lives in the
link lifecycle (``_lifecycle/tables.py``); this module does the I/O and fires the
outcome triggers.

Threads: the engine's I/O loop (:mod:`llmdd._control.ioloop`) drives listeners, handshakes, every
link's control connection, keepalives and deadlines from one thread; blocking work (transport
plugins, hook subscribers, memory calls) runs on the loop's bounded pool, in order per link
(a :class:`~llmdd._control.ioloop.Strand`), and endpoint registrations and table announcements on one
registrar thread.  The thread count does not grow with links or connections.  All are daemon
threads: they never keep the interpreter alive, and the exit handler's ``finalize`` closes them.

Locks: ``LinkManager._lock`` guards the link, alias and pending tables only; nothing is called
while it is held (no memory manager, region table, plugin, hook, listener or socket call).
``ControlConnection._lock`` is a leaf held around non-blocking socket calls.  The order is
written in docs/architecture.md ("Locks").
"""

from __future__ import annotations

import collections
import concurrent.futures
import ipaddress
import itertools
import random
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from msgspec.structs import replace as msgspec_replace

from llmdd._seam.abc import CAPABILITY_KEY, Endpoint, TransportError
from llmdd._control.ioloop import IoLoop, PoolFull, Strand
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import (
    LINK_BUSY, LINK_CLAIMABLE, LINK_DOWN, LINK_FAILED, LINK_KEEPS_ALIVE, LINK_PROCESSING,
    LINK_SETTING_UP, LINK_UNLINKING, Machine,
)
from llmdd._base.log import get_logger
from llmdd._base.options import is_local_address
from llmdd._base.enums import LLMRole
from llmdd._base.options import EngineOptions
from llmdd._extension.manager import Hooks, LazyCandidates
from llmdd._data.port import DataService, RequestOp, request_op
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.codec import PEER_CLOSED, ProtocolError
from llmdd._control.protocol.handshake import (
    PRE_AUTH_MAX_FRAME_SIZE,
    ClientHandshake,
    HandshakeConfig,
    HandshakeRefused,
    ServerHandshake,
    new_incarnation,
)
from llmdd._base.status import InvalidStateError, LLMException, LLMStatusCode
from llmdd.plugin import LinkInfo
from llmdd._control.connection import ControlConnection, TlsFailed
from llmdd._control.endpoints import DEFERRED_KEY, Registrar, TransportEndpoints
from llmdd._control.link import Link, Pending
from llmdd._control.liveness import Liveness, PeerLost
from llmdd._control.listener import FailedListener, Listener, close_quietly, refuse_busy
from llmdd._control.settings import MAX_CLUSTERS_PER_CALL, LinkSettings

if TYPE_CHECKING:
    from llmdd._lifecycle.machines import Lifecycle
    from llmdd._memory.manager import MemoryManager
    from llmdd._base.profiles import ChipProfile

#: the control plane's own request op: a client's data descriptor for a transport offered by name only
LINK_DESCRIPTOR_OP = "link_descriptor"

__all__ = ["LinkManager", "Link", "LinkSettings"]

_log = get_logger("llmdd.link")

S = LLMStatusCode

class _Refused(Exception):
    """A connection over a cap: closed at once, without work."""


class _CrossLink(Exception):
    """The peer refused our link because its own link to us, started at the same moment, is kept."""


_NO_TRANSPORT = ("no transport is available in this process (no transport plugin installed, or all "
                 "unavailable or disabled): pip install llmdd brings llmdd-transport-shm and llmdd-transport-tcp; "
                 "`llmdd doctor` says what is missing")
_CROSS_LINK_REASON = "cross link: both clusters link to each other; the link the lower cluster id starts is kept"


class _ServerSession:
    """One accepted control connection until its link is LINKED (or it is dropped).

    Pre-authentication it counts against the pending caps; the handshake deadline runs from
    accept to LINKED whatever happens in between.
    """

    __slots__ = ("lm", "conn", "addr", "ip", "listener", "hs", "timer", "pending", "link", "accepted_at", "done")

    def __init__(self, lm: "LinkManager", conn: ControlConnection, addr, listener: Listener) -> None:
        self.lm = lm
        self.conn = conn
        self.addr = addr
        self.ip = addr[0]
        self.listener = listener
        self.hs = ServerHandshake(lm._handshake_config(lm.role, offers=()))
        self.timer = lm.loop.call_later(lm.settings.handshake_s, self.expire)
        self.pending = True
        self.link: Optional[Link] = None
        self.accepted_at = time.monotonic()
        self.done = False

    def on_message(self, msg: Any) -> None:
        for out in self.hs.receive(msg):
            self.conn.send(out)
        if self.hs.refused:
            _log.warning("llmdd.link.refused", peer=str(self.addr),
                         reason=self.hs.refusal.reason if self.hs.refusal else "")
            self.drop()
        elif self.hs.authenticated:
            self.lm._unpend(self)
            self.conn.pause()
            try:
                self.lm.loop.pool.submit(self.lm._server_accept, self)
            except PoolFull as exc:
                self.listener.refused += 1
                _log.warning("llmdd.link.accept_refused", peer=str(self.addr), error=str(exc))
                try:
                    self.conn.send(self.hs.refuse(S.LLM_LINK_FAILED.value, "the server is overloaded; retry"))
                except ProtocolError:
                    pass
                self.drop()

    def on_closed(self, error: BaseException | None) -> None:
        self.lm._unpend(self)
        self.timer.cancel()
        if self.link is None:
            self.done = True
            if isinstance(error, TlsFailed):
                _log.warning("llmdd.link.tls_refused", peer=str(self.addr), error=str(error))
            elif error is not None:
                _log.info("llmdd.link.handshake_failed", peer=str(self.addr), error=str(error))

    def expire(self) -> None:
        """The handshake deadline (loop thread): whatever is not LINKED by now is dropped."""
        if self.done:
            return
        self.done = True
        self.lm._unpend(self)
        link = self.link
        if link is None:
            if not self.conn.closed:
                _log.info("llmdd.link.handshake_deadline", peer=str(self.addr), seconds=self.lm.settings.handshake_s)
            self.conn.close()
            return
        if link.fsm.in_(LINK_SETTING_UP):
            err = TimeoutError(f"link setup did not finish within {self.lm.settings.handshake_s} s")
            self.lm._submit(link, self.lm._abort_setup, link, err)

    def drop(self, *, busy: bool = False) -> None:
        self.done = True
        self.timer.cancel()
        self.lm._unpend(self)
        if busy and not self.conn._tls and not self.conn.closed:
            try:   # evicted to make room: a legitimate client retries on this answer
                self.conn.send(self.hs.refuse(S.LLM_LINK_BUSY.value, "evicted to make room; retry"))
            except (ProtocolError, InvalidStateError):
                pass
        self.conn.close()


# --------------------------------------------------------------------------- manager


class LinkManager:
    """Links of one engine, server side and client side."""

    def __init__(self, *, cluster_id: int, role: LLMRole, options: EngineOptions, hooks: Hooks,
                 links: "Lifecycle", memory: "MemoryManager", profile: "ChipProfile",
                 engine: Optional[Tracked] = None, listeners: Optional["Lifecycle"] = None) -> None:
        self._options = options
        self._engine = engine   # the engine's lifecycle: a listener that cannot continue is recorded there
        self._hooks = hooks
        self._lc = links
        # the engine's listening sockets (control port, comm group ports, failed data ports)
        self._listeners = listeners if listeners is not None else Lifecycle(Machine.LISTENER)
        self._memory = memory
        self._profile = profile
        self.role = role
        self._data: Optional[DataService] = None   # bound once by the composition root (bind_data_service)
        self.settings = LinkSettings.from_options(options)
        self.cluster_id = cluster_id
        self.incarnation = new_incarnation()
        self.host = m.HostIdentity.local()
        self._lock = threading.RLock()
        self._links: dict[int, Link] = {}           # peer cluster id -> live link
        self._aliases: dict[int, int] = {}          # remote_cluster_id given by the user -> peer id
        self._linking: set[int] = set()             # remote_cluster_ids with a link_clusters in progress
        self._accepting: dict[int, threading.Event] = {}   # peers whose incoming link is being accepted
        # remote_cluster_id -> why its last link_clusters attempt failed (dropped when one succeeds);
        # a failed link is never made, so it has no Link.last_error (LLMDataDist.statistics()["link_failures"])
        self._link_failures: dict[int, dict] = {}
        self._request_ids = itertools.count(1)
        self._closed = False
        self._listener: Optional[Listener] = None
        self._listen_addr: Optional[tuple[str, int]] = None
        self._group_listeners: dict[socket.socket, Listener] = {}
        self._failed_listeners: list = []          # Listener or FailedListener (a data port)
        self._pending: dict[_ServerSession, None] = {}            # pre-authentication sessions (loop thread)
        self._pending_by_ip: collections.Counter = collections.Counter()
        self._counters: collections.Counter[str] = collections.Counter()
        self._io_error: Optional[str] = None
        self._client_host: Optional[str] = None
        # endpoint registrations and table announcements, one at a time, in order, with no lock held
        self._registrar = Registrar(f"registrar-{self.cluster_id & 0xffff:x}")
        self.endpoints = TransportEndpoints(
            registry=self._hooks.register_transports(), options=options, settings=self.settings, memory=memory,
            registrar=self._registrar, data_host=self._data_host, on_data_port_failed=self._data_listener_failed)
        self._message_handlers: dict[type, Callable[[Link, Any], None]] = {
            m.RegionsUpdate: self._on_tables,
            m.CacheTableUpdate: self._on_tables,
            m.Keepalive: self._on_keepalive,
            m.KeepaliveAck: self._on_keepalive_ack,
            m.UnlinkRequest: self._on_unlink_request,
            m.UnlinkAck: self._on_reply,
            m.TransferReply: self._on_reply,
            m.TransferRequest: self._on_transfer_request,
            m.ReadDone: self._on_data_notice,
            m.KeyConsumed: self._on_data_notice,
            m.ReleaseKey: self._on_data_notice,
            m.PushDone: self._on_data_notice,
            m.TaggedDone: self._on_tagged_done,
            m.Error: self._on_error,
            m.Refuse: self._on_refuse,
        }
        self.loop = IoLoop(f"{self.cluster_id & 0xffff:x}", workers=self.settings.io_workers)
        self.loop.on_dead(self._on_loop_dead)
        self.loop.call_later(self.settings.keepalive_s, self._keepalive_tick)
        memory.regions.add_listener(self.endpoints.on_regions_changed)
        memory.add_change_listener(self.announce_all)
        if options.listen is not None:
            try:
                self.listen(*options.listen)
            except BaseException:
                self.close()
                raise

    def bind_data_service(self, service: DataService) -> None:
        """The data plane that serves this engine's data requests and notices (once, by the engine)."""
        if self._data is not None:
            raise RuntimeError("a data service is bound already")
        self._data = service

    def set_role(self, role: LLMRole) -> None:
        """The engine's role after ``switch_role`` (offered in later handshakes)."""
        self.role = role

    # ------------------------------------------------------------------ transports and endpoints
    @property
    def registry(self):
        return self.endpoints.registry

    def endpoint(self, name: str) -> Endpoint:
        """The endpoint of transport ``name`` (opened when it is not yet): :class:`TransportEndpoints`."""
        return self.endpoints.endpoint(name)

    def offers(self) -> tuple[m.TransportOffer, ...]:
        """The transports this engine offers in a handshake (:meth:`TransportEndpoints.offers`)."""
        return self.endpoints.offers()

    def _data_host(self) -> str:
        """Where network transports' data endpoints bind: the option, the listen IP, the local IP a
        client named in ``append_local_ip_info``, else loopback (never a wildcard by default)."""
        if self.settings.data_host:
            return self.settings.data_host
        if self._listen_addr is not None and self._listen_addr[0] not in ("0.0.0.0", ""):
            return self._listen_addr[0]
        return self._client_host or "127.0.0.1"

    def _data_listener_failed(self, name: str, ep: Endpoint, error: str) -> None:
        """An endpoint's data port cannot continue (on the endpoint's thread; never blocks): the
        registrar records it, fails the links over it typed and drops it, so the next link opens a
        fresh endpoint (a new data port)."""
        # finalizing (the endpoint closes with the engine) or no registrar thread to be had: here
        self._registrar.post(self._retire_endpoint, name, ep, error, run_here_if_full=not self._closed)

    def _retire_endpoint(self, name: str, ep: Endpoint, error: str) -> None:
        try:
            desc = ep.describe()
            address = (str(desc.get("host", "?")), desc.get("port", "?"))
        except Exception:  # noqa: BLE001 - recorded without its address
            address = ("?", "?")
        self.endpoints.forget(name, ep)
        kind = f"{name}-data"
        record = FailedListener(self._listeners.create(f"{kind}@{address[0]}:{address[1]}", kind=kind),
                                 kind, address, error)
        self._failed_listeners.append(record)
        self._fire_listener_failed(record.kind, record.address, error)
        err = LLMException(f"the {name} data port of this engine cannot continue: {error}",
                           status_code=S.LLM_LINK_FAILED)
        for link in self.links():
            if link.transport == name:
                self._fail(link, err, trigger="peer_lost")
                link.control.close()
        try:
            ep.close()
        except TransportError:
            pass

    def _serve_link_descriptor(self, link: Link, args: dict) -> tuple[int, dict]:
        """Server side: the descriptor of the client's endpoint for a transport it offered deferred."""
        desc = args.get("descriptor")
        if (link.is_client or not link.fsm.in_(LINK_SETTING_UP) or link.session is None
                or args.get("name") != link.transport or not isinstance(desc, dict)
                or not (link.setup_descriptor or {}).get(DEFERRED_KEY) or desc.get(DEFERRED_KEY)):
            return S.LLM_PARAM_INVALID.value, {"error": "no deferred transport offer waits for a descriptor"}
        link.setup_descriptor = desc
        return 0, {}

    # ------------------------------------------------------------------ table announcements
    def _local_tables(self) -> tuple[dict, dict, dict]:
        """Current regions, caches and keys of this engine, in wire form."""
        memory = self._memory
        # memory peers may not access is not announced at all: they cannot even learn it exists
        regions = {r.region_id: self.endpoints.region_descriptor(r) for r in memory.regions.regions() if self.endpoints.granted(r)}
        caches: dict[int, m.CacheEntry] = {}
        keys: dict[m.KeyRef, m.KeyEntry] = {}
        for rec in memory.records():
            if not rec.live and not rec.release_pending:
                continue
            if not any(self.endpoints.granted(r) for r in rec.regions):
                continue
            caches[rec.cache_id] = m.CacheEntry(
                cache_id=rec.cache_id, addrs=tuple(rec.addrs), tensor_size=rec.tensor_size,
                shape=tuple(int(x) for x in rec.desc.shape), data_type=rec.desc.data_type.value,
                placement=rec.placement, is_blocks=rec.is_blocks)
            if rec.blocks_model_id is not None and rec.live:
                ref = m.KeyRef.for_blocks(rec.blocks_model_id)
                keys[ref] = m.KeyEntry(key=ref, cache_id=rec.cache_id, batch_index=0)
        for index, (cache_id, batch_index) in memory.key_items():
            if cache_id not in caches:
                continue
            ref = _index_to_ref(index)
            keys[ref] = m.KeyEntry(key=ref, cache_id=cache_id, batch_index=batch_index)
        return regions, caches, keys

    def _announce(self, link: Link, regions: dict, caches: dict, keys: dict, *, full: bool = False) -> None:
        # the grant covers what this announcement names before the peer can learn it (a removed region is
        # already deregistered from every endpoint)
        self.endpoints.grant(link, regions)
        ann = link.announcer
        done = ann.announced
        if full:
            updates = [ann.regions_update(added=regions.values(), full=True),
                       ann.cache_table_update(caches_added=caches.values(), keys_added=keys.values(), full=True)]
        else:
            old_r, old_c, old_k = done.regions, done.caches, done.keys
            r_added = [d for rid, d in regions.items() if old_r.get(rid) != d]
            r_removed = [rid for rid in old_r if rid not in regions or old_r[rid] != regions[rid]]
            c_added = [e for cid, e in caches.items() if old_c.get(cid) != e]
            c_removed = [cid for cid in old_c if cid not in caches or old_c[cid] != caches[cid]]
            k_removed = [k for k, e in old_k.items() if keys.get(k) != e and e.cache_id not in c_removed]
            k_added = [e for k, e in keys.items() if old_k.get(k) != e or e.cache_id in c_removed]
            updates = []
            if r_added or r_removed:
                updates.append(ann.regions_update(added=r_added, removed=r_removed))
            if c_added or c_removed or k_added or k_removed:
                updates.append(ann.cache_table_update(caches_added=c_added, caches_removed=c_removed,
                                                      keys_added=k_added, keys_removed=k_removed))
        for update in updates:
            link.control.send(update)

    def announce_all(self) -> None:
        """Send every linked peer what changed in this engine's regions, caches and keys."""
        self._registrar.call(self._announce_all)

    def _announce_all(self) -> None:
        with self._lock:
            links = [lk for lk in self._links.values() if lk.tables_ready.is_set() or lk.linked]
        if not links:
            return
        regions, caches, keys = self._local_tables()
        for link in links:
            if link.announcer.announced.regions_version == 0:
                continue  # initial full tables not sent yet: they will carry this change
            try:
                self._announce(link, regions, caches, keys)
            except (ProtocolError, LLMException) as exc:
                _log.warning("llmdd.link.announce_failed", peer=link.peer_cluster_id, error=str(exc))

    def _send_initial_tables(self, link: Link) -> None:
        def send() -> None:
            regions, caches, keys = self._local_tables()
            self._announce(link, regions, caches, keys, full=True)

        self._registrar.call(send)

    # ------------------------------------------------------------------ server side
    def listen(self, host: str, port: int) -> tuple[str, int]:
        if self._listener is not None:
            self.stop_listening()
        sock = self._bind(host, port, backlog=128, status=S.LLM_PARAM_INVALID)
        self._listener = Listener(self, sock, comm_id=None, kind="control")
        self._listen_addr = self._listener.address
        _log.info("llmdd.link.listening", host=self._listen_addr[0], port=self._listen_addr[1])
        return self._listen_addr

    @staticmethod
    def _bind(host: str, port: int, *, backlog: int, status: LLMStatusCode) -> socket.socket:
        try:
            return socket.create_server((host, port), backlog=backlog, reuse_port=False)
        except OSError as exc:
            raise LLMException(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                               status_code=status) from None

    @property
    def listen_address(self) -> Optional[tuple[str, int]]:
        return self._listen_addr

    def stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        self._listen_addr = None
        if listener is not None:
            listener.close()

    def _admit(self, listener: Listener, sock: socket.socket, addr) -> None:
        """A connection was accepted (loop thread): refuse it at once over a cap, else start its handshake."""
        ip = addr[0] if isinstance(addr, tuple) else str(addr)
        try:
            if self._closed or self._io_error is not None:
                raise _Refused("the engine is closing")
            if self._pending_by_ip[ip] >= self.settings.max_pending_per_address:
                self._counters["refused_per_address"] += 1
                raise _Refused(f"{ip} already has {self._pending_by_ip[ip]} connections in their handshake")
            if len(self._pending) >= self.settings.max_pending:
                victim = self._eviction_victim(ip)
                if victim is None:
                    self._counters["refused_pending"] += 1
                    raise _Refused(f"{len(self._pending)} connections are in their handshake")
                self._counters["evicted"] += 1
                victim.drop(busy=True)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self.settings.server_tls
            if tls is not None:
                sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = ControlConnection(self.loop, sock, name=f"{ip}:{addr[1]}", tls_handshake=tls is not None)
            conn.codec.max_frame_size = PRE_AUTH_MAX_FRAME_SIZE
            sess = _ServerSession(self, conn, addr, listener)
        except _Refused as exc:
            listener.refused += 1
            _log.debug("llmdd.link.connection_refused", peer=ip, reason=str(exc))
            refuse_busy(sock, self.settings.server_tls is not None)
            return
        except Exception as exc:  # noqa: BLE001 - no memory, no TLS, a bad socket: refuse this one and go on
            listener.refused += 1
            self._counters["admit_failures"] += 1
            _log.warning("llmdd.link.connection_refused", peer=ip, error=repr(exc))
            close_quietly(sock)
            return
        self._pending[sess] = None
        self._pending_by_ip[ip] += 1
        sess.conn.attach(sess.on_message, sess.on_closed)

    def _eviction_victim(self, ip: str) -> Optional[_ServerSession]:
        """With every pending slot taken, the oldest connection of the address holding the most
        slots makes room, unless the newcomer's address already holds as many (a flood from some
        addresses never locks out another address)."""
        busiest, count = None, self._pending_by_ip[ip]
        for addr, n in self._pending_by_ip.items():
            if n > count:
                busiest, count = addr, n
        if busiest is None:
            return None
        oldest = None
        for sess in self._pending:
            if sess.ip == busiest and (oldest is None or sess.accepted_at < oldest.accepted_at):
                oldest = sess
        return oldest

    def _unpend(self, sess: _ServerSession) -> None:
        if not sess.pending:
            return
        sess.pending = False
        if self._pending.pop(sess, 0) is None:
            self._pending_by_ip[sess.ip] -= 1
            if self._pending_by_ip[sess.ip] <= 0:
                del self._pending_by_ip[sess.ip]

    def _listener_failed(self, listener: Listener, exc: BaseException) -> None:
        """A listener cannot continue (loop thread): logged once, recorded, its socket closed."""
        error = f"{type(exc).__name__}: {exc}"

        def record() -> None:
            listener.error = error

        if not listener.fsm.offer("fail", error=exc, reason=error, on_accept=record):
            return   # failed or closed already
        self._failed_listeners.append(listener)
        _log.error("llmdd.link.listener_failed", listener=listener.kind,
                   address=f"{listener.address[0]}:{listener.address[1]}", error=listener.error)
        listener.close()
        try:
            self.loop.pool.submit(self._record_listener_failure, listener)
        except PoolFull:
            self._record_listener_failure(listener)

    def _record_listener_failure(self, listener: Listener) -> None:
        self._fire_listener_failed(listener.kind, listener.address, listener.error or "")

    def _fire_listener_failed(self, kind: str, address: tuple, error: str) -> None:
        fsm = self._engine
        if fsm is not None:
            fsm.offer("listener_failed", error=RuntimeError(error), listener=kind,
                      address=f"{address[0]}:{address[1]}", reason=error)

    def _on_loop_dead(self, exc: BaseException) -> None:
        """The I/O loop cannot continue (on its dying thread): every listener and link fails."""
        self._io_error = f"{type(exc).__name__}: {exc}"
        for listener in [self._listener, *self._group_listeners.values()]:
            if listener is not None:
                self._listener_failed(listener, exc)
        for link in self.links():
            err = LLMException(f"the engine's I/O loop stopped: {self._io_error}", status_code=S.LLM_LINK_FAILED)
            self._fail(link, err, trigger="peer_lost")
            link.control.close()

    def listener_status(self) -> list[dict]:
        """Every listener of the engine, live or failed (``llmdd doctor`` and statistics report it)."""
        out = [lst.describe() for lst in [self._listener, *self._group_listeners.values()] if lst is not None]
        out += [lst.describe() for lst in self._failed_listeners if lst.describe() not in out]
        return out

    def open_group_listener(self, host: str, port: int, *, comm_id: int) -> socket.socket:
        """A listener for the members of one comm group (links accepted there carry ``comm_id``)."""
        sock = self._bind(host, port, backlog=16, status=S.LLM_LINK_FAILED)
        self._group_listeners[sock] = Listener(self, sock, comm_id=comm_id, kind=f"comm-{comm_id}")
        return sock

    def close_group_listener(self, sock: socket.socket) -> None:
        listener = self._group_listeners.pop(sock, None)
        if listener is not None:
            listener.close()
        else:
            close_quietly(sock)

    def _handshake_config(self, role, *, offers: Optional[tuple] = None) -> HandshakeConfig:
        return HandshakeConfig(cluster_id=self.cluster_id, role=role, incarnation=self.incarnation, host=self.host,
                               transports=self.offers() if offers is None else offers, secret=self.settings.secret)

    def _server_accept(self, sess: _ServerSession) -> None:
        """Server side, once the peer authenticated (on the pool): choose the transport, adopt the link.

        The rest of the setup runs when the peer's tables arrive (:meth:`_server_finish`, on the
        link's strand); the session's deadline bounds all of it."""
        hs, conn, addr = sess.hs, sess.conn, sess.addr
        link: Optional[Link] = None
        accepting: Optional[threading.Event] = None
        grant_name: Optional[str] = None
        grant_id: Optional[int] = None
        capability: Optional[bytes] = None
        hello: Optional[m.Hello] = None
        try:
            if sess.done or conn.closed:
                return
            hello = hs.hello
            if hello is None:   # a session is handed here only once its handshake authenticated the peer
                raise ProtocolError(f"link accept from {addr} before the peer authenticated")
            with self._lock:
                over = self._link_limit_reached() and hello.cluster_id not in self._links
                cross = self._is_cross_link(hello)
                if not over and not cross and hello.cluster_id not in self._accepting:
                    accepting = self._accepting[hello.cluster_id] = threading.Event()
            if cross:
                # both engines link to each other at once: the link the lower cluster id starts is the one
                # kept; the peer's own link_clusters returns that link once it is up
                conn.send(hs.refuse(S.LLM_ALREADY_LINK.value, _CROSS_LINK_REASON))
                sess.drop()
                return
            if over:
                conn.send(hs.refuse(S.LLM_CLUSTER_NUM_EXCEED_LIMIT.value,
                                    f"this engine has reached its link limit ({self._profile.max_links})"))
                sess.drop()
                return
            offered = {o.name: o for o in hello.transports}
            info = LinkInfo(local_cluster_id=self.cluster_id, peer_cluster_id=hello.cluster_id,
                            same_host=self.host.same_ipc_domain(hello.host),
                            forced=self.settings.forced_transport, peer_transports=tuple(offered))
            candidates = LazyCandidates(self.endpoints.registry, offered)   # probed only as far as the policy looks
            name = self._hooks.select_transport(info, candidates)
            if name is None:
                none_here = "" if self.endpoints.registry.candidates() else f"; the server: {_NO_TRANSPORT}"
                conn.send(hs.refuse(S.LLM_LINK_FAILED.value,
                                    f"no common transport (offered {sorted(offered)}, here "
                                    f"{[c.name for c in candidates]}, forced {info.forced}){none_here}"))
                sess.drop()
                return
            ep = self.endpoint(name)
            desc = ep.describe()
            if ep.capabilities:
                grant_id, capability = self.endpoints.mint()
                ep.grant(grant_id, capability, ())
                grant_name = name
                desc = dict(desc, **{CAPABILITY_KEY: capability})
            welcome = hs.accept(m.TransportOffer(name=name, descriptor=desc))
            link = self._adopt(hs.result(), conn, is_client=False, transport=name, reason=_reason(info, name),
                               start=False)
            link.grant_id, link.capability = grant_id, capability
            link.comm_id = sess.listener.comm_id
            link.session = sess
            link.setup_descriptor = offered[name].descriptor
            sess.link = link
            conn.codec.max_frame_size = 16 * 1024 * 1024
            conn.send(welcome)
            frame_key = hs.result().frame_key
            if frame_key is not None and self.settings.server_tls is None:
                # a secret and no TLS: every frame after the Welcome carries a MAC with a sequence number
                conn.codec.enable_frame_mac(frame_key, client=False)
            conn.resume(lambda msg: self._dispatch(link, msg))
            if sess.done:   # the deadline passed meanwhile
                raise TimeoutError(f"link setup did not finish within {self.settings.handshake_s} s")
        except (TimeoutError, ProtocolError, HandshakeRefused, TransportError, LLMException, OSError) as exc:
            _log.warning("llmdd.link.accept_failed", peer=str(addr), error=str(exc))
            if link is not None:
                if link.grant_id is None:
                    self.endpoints.revoke(grant_name, grant_id)
                self._submit(link, self._abort_setup, link, exc)
            else:
                self.endpoints.revoke(grant_name, grant_id)
                sess.drop()
        finally:
            if accepting is not None and hello is not None:   # accepting is set only after hello is
                with self._lock:
                    if self._accepting.get(hello.cluster_id) is accepting:
                        del self._accepting[hello.cluster_id]
                accepting.set()

    def _is_cross_link(self, hello) -> bool:
        """Under ``_lock``: is ``hello`` the peer's half of a simultaneous mutual link that this side,
        the lower cluster id, keeps its own half of?  (A peer with a new incarnation is a restart, not
        a cross link: its link replaces the old one.)"""
        peer_id = hello.cluster_id
        if self.cluster_id >= peer_id:
            return False
        if peer_id in self._linking:
            return True
        existing = self._links.get(peer_id)
        return (existing is not None and existing.is_client and not existing.fsm.is_final
                and not existing.fsm.in_(LINK_FAILED) and existing.peer is not None
                and existing.peer.incarnation == hello.incarnation)

    def _server_finish(self, link: Link) -> None:
        """Server side, on the link's strand once the peer's tables are in: data channel, our tables, LINKED."""
        sess = link.session
        try:
            if not link.fsm.in_(LINK_SETTING_UP) or sess is None or sess.done:
                raise ProtocolError(f"the peer went away during the link setup ({link.last_error})")
            deadline = sess.accepted_at + self.settings.handshake_s
            if (link.setup_descriptor or {}).get(DEFERRED_KEY):
                raise ProtocolError(f"the peer chose {link.transport!r} from a deferred offer but sent no descriptor")
            self._connect_channel(link, link.setup_descriptor or {}, deadline)
            link.liveness.restart(time.monotonic())   # liveness counts from LINKED, not from a slow handshake
            # LINKED before our tables leave: the peer is LINKED only once they arrive, so by the time its
            # link_clusters returns this side already is
            link.fsm.fire("handshake_succeeded", transport=link.transport, reason=link.transport_reason)
            link.settled.set()
            self._send_initial_tables(link)
            sess.done = True
            sess.timer.cancel()
            link.session = None
            link.setup_descriptor = None
        except (TimeoutError, ProtocolError, TransportError, LLMException, OSError, InvalidStateError) as exc:
            self._abort_setup(link, exc)

    def _abort_setup(self, link: Link, exc: BaseException) -> None:
        """A server-side link whose setup failed leaves nothing behind."""
        if not link.fsm.in_(LINK_SETTING_UP):
            return
        _log.warning("llmdd.link.accept_failed", peer=link.peer_cluster_id, error=str(exc))
        sess = link.session
        if sess is not None:
            sess.done = True
            sess.timer.cancel()
        self._fail(link, exc, trigger="handshake_failed")
        self._close_link(link, trigger="force_unlink", reason=f"link setup failed: {exc}")

    def _submit(self, link: Link, fn: Callable, *args: Any) -> None:
        """Run ``fn`` on the link's strand (in order with its other tasks)."""
        try:
            link.strand.submit(fn, *args)
        except PoolFull as exc:
            # no worker can be had: do it here rather than lose a link's state change
            _log.warning("llmdd.link.pool_unavailable", peer=link.peer_cluster_id, error=str(exc))
            fn(*args)

    def _adopt(self, peer, conn: ControlConnection, *, is_client: bool, transport: str, reason: str,
               start: bool = True) -> Link:
        """Create the link object for an authenticated peer, replacing a stale one.

        ``start=False`` (server side): the connection stays paused until the caller sends the
        Welcome and resumes it."""
        fsm = self._lc.create(peer.cluster_id, peer=peer.cluster_id)
        link = Link(peer_cluster_id=peer.cluster_id, fsm=fsm, control=conn, peer=peer, is_client=is_client,
                    transport=transport, transport_reason=reason, strand=Strand(self.loop.pool),
                    liveness=Liveness(peer=peer.cluster_id, timeout_s=self.settings.peer_timeout_s,
                                      last_rx=time.monotonic()))
        with self._lock:
            old = self._links.get(peer.cluster_id)
            self._links[peer.cluster_id] = link
        if old is not None:
            # the peer relinks: it has no entity any more (restart = new incarnation, or a force unlink)
            self._close_link(old, trigger="force_unlink", reason="replaced by a new link from the same cluster")
        fsm.fire("link" if is_client else "accept", transport=transport)
        on_closed = lambda err: self._submit(link, self._on_closed, link, err)  # noqa: E731
        if start:
            conn.attach(lambda msg: self._dispatch(link, msg), on_closed)
        else:
            conn.attach(None, on_closed)
        return link

    def _connect_channel(self, link: Link, peer_desc: dict, deadline: float) -> None:
        ep = self.endpoint(link.transport)
        channel = ep.connect(peer_desc, timeout=max(0.1, deadline - time.monotonic()))
        link.channel = channel
        self._sync_remote_regions(link)

    def _sync_remote_regions(self, link: Link) -> None:
        channel = link.channel
        if channel is None:
            return
        name = link.transport
        current = link.tables.regions
        for rid in list(link.remote_regions):
            desc = current.get(rid)
            if desc is None:
                channel.remove_remote_region(rid)
                link.remote_regions.discard(rid)
        for rid, desc in current.items():
            if rid not in link.remote_regions and name in desc.transports:
                channel.add_remote_region(rid, desc.size, desc.transports[name])
                link.remote_regions.add(rid)

    # ------------------------------------------------------------------ client side
    def link_clusters(self, clusters: list, timeout_ms: int) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        if not clusters:
            return S.LLM_SUCCESS, []
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            codes = [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
            return S.LLM_CLUSTER_NUM_EXCEED_LIMIT, codes
        deadline = time.monotonic() + timeout_ms / 1000.0
        if len(clusters) == 1:
            codes = [self._link_one_safe(clusters[0], deadline)]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(clusters)),
                                                       thread_name_prefix="llmdd-link") as pool:
                codes = list(pool.map(lambda c: self._link_one_safe(c, deadline), clusters))
        overall = S.LLM_SUCCESS
        for code in codes:
            if code is not S.LLM_SUCCESS:
                overall = code
        return overall, codes

    def _link_one_safe(self, cluster, deadline: float) -> LLMStatusCode:
        remote = cluster.remote_cluster_id
        try:
            code = self._link_one(cluster, deadline)
            error = None if code in (S.LLM_SUCCESS, S.LLM_ALREADY_LINK) else code.name
        except LLMException as exc:
            _log.warning("llmdd.link.failed", remote=remote, error=str(exc))
            code = exc.status_code if exc.status_code is not S.LLM_SUCCESS else S.LLM_LINK_FAILED
            error = str(exc)
        except Exception as exc:  # never raise out of link_clusters
            _log.warning("llmdd.link.failed", remote=remote, error=repr(exc))
            code, error = S.LLM_LINK_FAILED, repr(exc)
        with self._lock:
            if error is None:
                self._link_failures.pop(remote, None)
            else:
                self._link_failures[remote] = {"status": code.name, "error": error, "at": time.time()}
        return code

    def link_failures(self) -> dict:
        """remote_cluster_id -> {"status", "error", "at"} of its last failed link_clusters attempt
        (kept until a later attempt succeeds)."""
        with self._lock:
            return {k: dict(v) for k, v in self._link_failures.items()}

    def _link_limit_reached(self) -> bool:
        limit = self._profile.max_links
        return limit is not None and sum(1 for lk in self._links.values() if not lk.fsm.is_final) >= limit

    def _link_one(self, cluster, deadline: float) -> LLMStatusCode:
        remote_id = cluster.remote_cluster_id
        if self._io_error is not None:
            raise LLMException(f"the engine's I/O loop stopped ({self._io_error}); finalize and init again",
                               status_code=S.LLM_LINK_FAILED)
        stale = None
        with self._lock:
            existing = self._links.get(self._aliases.get(remote_id, remote_id))
            peer_started = (existing is not None and not existing.is_client and not existing.claimed
                            and existing.fsm.in_(LINK_CLAIMABLE)) \
                or (existing is None and remote_id in self._accepting)
        if peer_started:
            # the peer linked to this engine first (or is doing so now): that link serves both directions
            return self._claim_peer_link(remote_id, deadline)
        with self._lock:
            if self._link_limit_reached():
                return S.LLM_CLUSTER_NUM_EXCEED_LIMIT
            existing = self._links.get(self._aliases.get(remote_id, remote_id))
            if existing is not None:
                if existing.linked:
                    return S.LLM_ALREADY_LINK
                if existing.fsm.in_(LINK_PROCESSING):
                    return S.LLM_PROCESSING_LINK
                stale = existing  # FAILED: the caller relinks without unlinking first; replace it
            if remote_id in self._linking:
                # another call is linking this cluster: its handshake would be replaced by ours
                return S.LLM_PROCESSING_LINK
            self._linking.add(remote_id)
        try:
            if stale is not None:
                self._close_link(stale, trigger="force_unlink", reason="relink after failure")
            return self._link_one_unreserved(cluster, remote_id, deadline)
        finally:
            with self._lock:
                self._linking.discard(remote_id)

    def _link_one_unreserved(self, cluster, remote_id: int, deadline: float) -> LLMStatusCode:
        if not cluster.remote_ip_info_list:
            raise LLMException("remote_ip_info_list is empty. Call append_remote_ip_info to set the server's "
                               "listen address.", status_code=S.LLM_PARAM_INVALID)
        ip_int, port = cluster.remote_ip_info_list[0]
        host = socket.inet_ntoa(int(ip_int).to_bytes(4, "little"))
        if self._client_host is None and cluster.local_ip_info_list:
            local = socket.inet_ntoa(int(cluster.local_ip_info_list[0][0]).to_bytes(4, "little"))
            if local not in ("0.0.0.0",) and is_local_address(local):
                self._client_host = local
        try:
            link = self.connect_peer(host, port, deadline)
        except _CrossLink:
            # the peer links to this engine at the same moment and keeps its own link: use that one
            return self._claim_peer_link(remote_id, deadline)
        with self._lock:
            self._aliases[remote_id] = link.peer_cluster_id
        return S.LLM_SUCCESS

    def _claim_peer_link(self, remote_id: int, deadline: float) -> LLMStatusCode:
        """Wait (until ``deadline``) for the link the peer ``remote_id`` started to this engine, and
        return it from this side's ``link_clusters`` (one link per pair, transfers both ways)."""
        while True:
            with self._lock:
                link = self._links.get(remote_id)
                accepting = self._accepting.get(remote_id)
            left = deadline - time.monotonic()
            if link is not None and not link.is_client:
                if link.fsm.in_(LINK_SETTING_UP) and left > 0:
                    link.settled.wait(left)
                    continue
                if not link.linked:
                    raise LLMException(f"the link cluster {remote_id} started to this engine did not come up "
                                       f"({link.last_error or link.state.value})", status_code=S.LLM_LINK_FAILED)
                with self._lock:
                    if link.claimed:
                        return S.LLM_ALREADY_LINK
                    link.claimed = True
                    self._aliases[remote_id] = link.peer_cluster_id
                return S.LLM_SUCCESS
            if link is not None and link.linked:
                return S.LLM_ALREADY_LINK
            if left <= 0:
                raise LLMException(f"cluster {remote_id} links to this engine at the same moment; its link did not "
                                   f"come up in time", status_code=S.LLM_LINK_FAILED)
            if accepting is not None:
                accepting.wait(min(left, 0.5))
            else:
                time.sleep(min(left, 0.01))   # the peer's connection has not arrived yet

    def connect_peer(self, host: str, port: int, deadline: float, *, comm_id: Optional[int] = None) -> Link:
        """Client side of one link: connect and handshake (retrying), tables, data channel.

        Runs in the caller's thread; the connection moves to the I/O loop once authenticated."""
        if self._io_error is not None:
            raise LLMException(f"the engine's I/O loop stopped ({self._io_error})", status_code=S.LLM_LINK_FAILED)
        if not any(True for _ in LazyCandidates(self.endpoints.registry)):   # probes until one transport can run
            raise LLMException(f"cannot link to {host}:{port}: {_NO_TRANSPORT}", status_code=S.LLM_LINK_FAILED)
        if self.settings.total_time_s is not None and comm_id is not None:
            deadline = min(deadline, time.monotonic() + self.settings.total_time_s)
        grant_id, capability = self.endpoints.mint()
        while True:
            conn, peer, offers = self._client_handshake(host, port, deadline, capability=capability)
            deferred = next((o for o in offers if o.name == peer.transport.name and o.descriptor.get(DEFERRED_KEY)),
                            None)
            if deferred is None or self.endpoints.open_deferred(deferred.name) is not None:
                break
            # the server chose a transport offered deferred that cannot run here: hand the server's
            # half-made link back (it fails and goes) and offer again without it
            conn.close()
            if time.monotonic() >= deadline:
                raise LLMException(f"link to {host}:{port} failed: no time left after {deferred.name!r} turned out "
                                   f"unusable here", status_code=S.LLM_LINK_FAILED)
        link: Optional[Link] = None
        try:
            info = LinkInfo(local_cluster_id=self.cluster_id, peer_cluster_id=peer.cluster_id,
                            same_host=self.host.same_ipc_domain(peer.host), forced=self.settings.forced_transport,
                            peer_transports=tuple(o.name for o in peer.offered))
            link = self._adopt(peer, conn, is_client=True, transport=peer.transport.name,
                               reason=_reason(info, peer.transport.name))
            link.comm_id = comm_id
            # the peer connects its data channel to us once our tables are in: grant before they leave
            link.grant_id, link.capability = grant_id, capability
            self.endpoints.grant(link, ())
            if deferred is not None:   # our endpoint's descriptor, before the tables the server waits for
                desc = self.endpoint(link.transport).describe()
                (offer,) = self.endpoints.with_capability((m.TransportOffer(name=link.transport, descriptor=desc),),
                                                 capability)
                self.notify(link, m.TransferRequest(request_id=0, op=LINK_DESCRIPTOR_OP,
                                                    args={"name": link.transport, "descriptor": offer.descriptor}))
            self._send_initial_tables(link)
            link.tables_ready.wait(max(0.0, deadline - time.monotonic()))
            if not link.tables_ready.is_set():
                raise TimeoutError("the peer did not send its tables in time")
            if not link.fsm.in_(LINK_SETTING_UP):
                raise ProtocolError(f"the peer went away during the link setup ({link.last_error})")
            self._connect_channel(link, peer.transport.descriptor, deadline)
            link.liveness.restart(time.monotonic())   # liveness counts from LINKED, not from a slow handshake
            link.fsm.fire("handshake_succeeded", transport=link.transport, reason=link.transport_reason)
            link.settled.set()
            return link
        except (TimeoutError, ProtocolError, TransportError, OSError, InvalidStateError) as exc:
            if link is not None:
                self._fail(link, exc, trigger="handshake_failed")
                self._close_link(link, trigger="force_unlink", reason="link setup failed")
            else:
                conn.close()
            raise LLMException(f"link to {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None

    def _client_handshake(self, host: str, port: int, deadline: float, *,
                          capability: bytes) -> tuple[ControlConnection, Any, tuple]:
        """Connect and authenticate; returns the (blocking, not yet attached) connection, the peer and
        the transports offered.

        A server over its pending-connection caps closes a new connection at once, before any
        answer: that attempt is retried, with a growing jittered pause, while the deadline
        allows.  Connection failures are retried ``link_retry_count`` times (the contract's option)."""
        attempts = max(1, self.settings.retry_count)
        failures = 0
        busy = 0
        last: BaseException | None = None
        offers = self.endpoints.with_capability(self.offers(), capability)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if last is None:
                    last = TimeoutError("no time left")
                break
            try:
                sock = socket.create_connection((host, port), timeout=left)
            except OSError as exc:
                last = exc
                failures += 1
                if failures >= attempts:
                    raise LLMException(f"cannot connect to {host}:{port}: {exc}",
                                       status_code=S.LLM_LINK_FAILED) from None
                time.sleep(min(0.05 * failures, max(0.0, deadline - time.monotonic())))
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client_tls = self.settings.client_tls
                if client_tls is not None:
                    sock.settimeout(max(0.1, deadline - time.monotonic()))
                    sock = self._wrap_client_tls(client_tls, sock, host)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                if _closed_at_once(exc):
                    last = exc
                    busy += 1
                    self._busy_pause(busy, deadline)
                    continue
                raise LLMException(f"TLS with {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None
            conn = ControlConnection(self.loop, sock, name=f"{host}:{port}")
            try:
                hs = ClientHandshake(self._handshake_config(self.role, offers=offers))
                conn.send(hs.start())
                while not hs.finished:
                    msg = conn.recv_message(deadline)
                    if msg is PEER_CLOSED:
                        raise ProtocolError("the server closed the connection before answering")
                    for out in hs.receive(msg):
                        conn.send(out)
                peer = hs.result()   # raises HandshakeRefused
                if peer.frame_key is not None and self.settings.client_tls is None:
                    # a secret and no TLS: every frame after the Welcome carries a MAC with a sequence number
                    conn.codec.enable_frame_mac(peer.frame_key, client=True)
                return conn, peer, offers
            except HandshakeRefused as exc:
                conn.close()
                if exc.by_peer and exc.refusal.status_code == S.LLM_ALREADY_LINK.value \
                        and exc.refusal.reason == _CROSS_LINK_REASON:
                    raise _CrossLink(str(exc)) from None
                if not (exc.by_peer and exc.refusal.status_code == S.LLM_LINK_BUSY.value):
                    raise LLMException(f"link to {host}:{port} refused: {exc}",
                                       status_code=S.LLM_LINK_FAILED) from None
                last = exc   # over the server's pending-connection caps: retry while time allows
                busy += 1
                self._busy_pause(busy, deadline)
            except (ProtocolError, OSError, TimeoutError) as exc:
                conn.close()
                raise LLMException(f"link to {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None
        if busy:
            reason = f"the server kept refusing new connections ({busy} refused; last: {last})"
        elif failures:
            reason = f"the link timeout passed while connecting ({failures} failed attempts; last: {last})"
        else:   # the deadline passed before this thread tried once: it did not get to run in time
            reason = "the link timeout passed before a connection could be tried (this process did not run in time)"
        raise LLMException(f"link to {host}:{port} failed: {reason}", status_code=S.LLM_LINK_FAILED)

    def _wrap_client_tls(self, client_tls: ssl.SSLContext, sock: socket.socket, host: str) -> socket.socket:
        """TLS on a client socket: the server's certificate must name ``llmdd.tls_server_name`` when it
        is set, else ``host`` when that is a name rather than an IP literal (with a CA; see docs)."""
        name = self.settings.tls_server_name
        if name is None and self.settings.client_tls_named is not None and not _is_ip_literal(host):
            name = host
        if name is not None and self.settings.client_tls_named is not None:
            return self.settings.client_tls_named.wrap_socket(sock, server_hostname=name)
        return client_tls.wrap_socket(sock)

    @staticmethod
    def _busy_pause(attempt: int, deadline: float) -> None:
        pause = min(0.5, 0.01 * (2 ** min(attempt, 6))) * (0.5 + random.random())
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))

    # ------------------------------------------------------------------ lookups for the data plane
    def get(self, cluster_id: int) -> Optional[Link]:
        with self._lock:
            link = self._links.get(cluster_id)
            if link is None:
                alias = self._aliases.get(cluster_id)
                if alias is not None:
                    link = self._links.get(alias)
            return link

    def require(self, cluster_id: int) -> Link:
        """The LINKED link to ``cluster_id``, or the contract's error."""
        link = self.get(cluster_id)
        if link is None:
            raise LLMException(f"cluster {cluster_id} is not linked", status_code=S.LLM_NOT_YET_LINK)
        if link.fsm.in_(LINK_FAILED):
            raise LLMException(f"link to cluster {cluster_id} has failed ({link.last_error}); unlink and relink it",
                               status_code=link.failure_status or S.LLM_LINK_FAILED)
        if not link.linked:
            raise LLMException(f"link to cluster {cluster_id} is {link.state.value}",
                               status_code=S.LLM_PROCESSING_LINK if link.fsm.in_(
                                   LINK_BUSY) else S.LLM_NOT_YET_LINK)
        return link

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def has_links(self) -> bool:
        with self._lock:
            return any(not lk.fsm.is_final for lk in self._links.values())

    def request(self, link: Link, op: RequestOp, args: dict, *, deadline: float) -> tuple[int, dict]:
        """Send a data-plane request (a TransferRequest) and wait for its reply until ``deadline``."""
        return self._exchange(link, op.value, lambda rid: m.TransferRequest(request_id=rid, op=op.value, args=args),
                              deadline)

    def ask(self, link: Link, message: m.TaggedDone, *, deadline: float) -> tuple[int, dict]:
        """Send an acknowledged notice (its request id is this side's) and wait for the reply."""
        return self._exchange(link, message.op, lambda rid: msgspec_replace(message, request_id=rid), deadline)

    def _exchange(self, link: Link, op: str, build: Callable[[int], Any], deadline: float) -> tuple[int, dict]:
        rid = next(self._request_ids)
        pending = Pending()
        link.pending[rid] = pending
        try:
            # registered first, then checked: a failure either releases this waiter or is seen here
            # (a request on a link that already failed must not wait out its deadline)
            if link.fsm.in_(LINK_DOWN):
                raise LLMException(f"link to {link.peer_cluster_id} is {link.state.value}",
                                   status_code=link.failure_status or S.LLM_LINK_FAILED)
            link.control.send(build(rid))
            if not pending.event.wait(max(0.0, deadline - time.monotonic())):
                raise LLMException(f"peer {link.peer_cluster_id} did not answer {op!r} in time",
                                   status_code=S.LLM_TIMEOUT)
            reply = pending.reply
            if reply is None:
                raise LLMException(f"link to {link.peer_cluster_id} went down during {op!r}",
                                   status_code=S.LLM_LINK_FAILED)
            return reply.status_code, dict(reply.result)
        except ProtocolError as exc:
            # the connection is gone: the link is FAILED by the time the caller hears it
            self._fail(link, LLMException(f"control connection lost: {exc}", status_code=S.LLM_LINK_FAILED),
                       trigger="peer_lost")
            raise LLMException(f"link to {link.peer_cluster_id} failed: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None
        finally:
            link.pending.pop(rid, None)

    def notify(self, link: Link, msg: Any) -> None:
        """Best-effort one-way message (ReadDone, KeyConsumed...)."""
        try:
            link.control.send(msg)
        except ProtocolError as exc:
            _log.debug("llmdd.link.notify_failed", peer=link.peer_cluster_id, error=str(exc))

    # ------------------------------------------------------------------ message dispatch
    #: cheap messages handled on the loop thread when the link's strand has nothing queued (in order)
    _INLINE = frozenset({m.Keepalive, m.KeepaliveAck, m.TransferReply, m.UnlinkAck})

    def _dispatch(self, link: Link, msg: Any) -> None:
        """A message arrived (loop thread): cheap ones now, the rest on the link's strand, in order."""
        if self._hooks.drops_control_message(link.peer_cluster_id, msg):
            return  # a plugin (fault injection) dropped it: as if the network lost it
        link.liveness.received(time.monotonic())
        if type(msg) in self._INLINE and link.strand.idle():
            self._handle(link, msg)
        else:
            self._submit(link, self._handle_on_strand, link, msg)

    def _handle(self, link: Link, msg: Any) -> None:
        handler = self._message_handlers.get(type(msg))
        if handler is None:
            _log.warning("llmdd.link.unexpected_message", peer=link.peer_cluster_id, type=type(msg).__name__)
            return
        handler(link, msg)

    def _handle_on_strand(self, link: Link, msg: Any) -> None:
        try:
            self._handle(link, msg)
        except (OSError, ProtocolError, ValueError) as exc:   # e.g. a table update that does not apply
            self._on_closed(link, exc)   # fails the link and tells the peer (a fatal Error) first
            link.control.close()
        except Exception as exc:  # a handler bug must not kill the link silently
            _log.error("llmdd.link.handler_failed", peer=link.peer_cluster_id, error=repr(exc))
            self._on_closed(link, exc)
            link.control.close()

    def _on_tables(self, link: Link, msg: Any) -> None:
        link.tables.apply(msg)  # raises TableUpdateError (a ProtocolError): the link fails
        if isinstance(msg, m.CacheTableUpdate) and link.tables.regions_version > 0:
            first = not link.tables_ready.is_set()
            link.tables_ready.set()
            if first and link.session is not None:
                self._server_finish(link)   # server side: the peer's tables were the last thing missing
                return
        if link.channel is not None and isinstance(msg, m.RegionsUpdate):
            self._sync_remote_regions(link)
        if link.linked and isinstance(msg, m.RegionsUpdate):
            link.fsm.fire("regions_updated", version=msg.version)

    def _on_keepalive(self, link: Link, msg: m.Keepalive) -> None:
        self.notify(link, m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns,
                                         sent_at_ns=time.monotonic_ns()))

    def _on_keepalive_ack(self, link: Link, msg: m.KeepaliveAck) -> None:
        link.liveness.acked(time.monotonic_ns(), msg.echo_sent_at_ns)

    def _on_reply(self, link: Link, msg: Any) -> None:
        pending = link.pending.get(msg.request_id)
        if pending is not None:
            pending.reply = msg
            pending.event.set()

    def _on_unlink_request(self, link: Link, msg: m.UnlinkRequest) -> None:
        self.notify(link, m.UnlinkAck(request_id=msg.request_id, status_code=0))
        self._close_link(link, trigger="peer_unlinked", reason=msg.reason or "peer unlinked")

    def _on_transfer_request(self, link: Link, msg: m.TransferRequest) -> None:
        if msg.op == LINK_DESCRIPTOR_OP:   # the control plane's own request (deferred transport offers)
            self._reply(link, msg.request_id, msg.op, self._serve_link_descriptor, link, dict(msg.args))
            return
        op = request_op(msg.op)
        if op is None or self._data is None:
            self.notify(link, m.TransferReply(request_id=msg.request_id, status_code=S.LLM_PARAM_INVALID.value,
                                              result={"error": f"unknown op {msg.op!r}"}))
            return
        self._reply(link, msg.request_id, msg.op, self._data.serve, link, op, dict(msg.args))

    def _on_tagged_done(self, link: Link, msg: m.TaggedDone) -> None:
        if self._data is not None:
            self._reply(link, msg.request_id, "tagged_done", self._data.serve_tagged, link, msg)

    def _reply(self, link: Link, request_id: int, op: str, serve: Callable[..., tuple[int, dict]],
               *args: Any) -> None:
        """Run a request's server and send its TransferReply (an exception answers its status)."""
        try:
            status, result = serve(*args)
        except LLMException as exc:
            status, result = exc.status_code.value, {"error": str(exc)}
        except Exception as exc:
            _log.error("llmdd.link.request_failed", op=op, error=repr(exc))
            status, result = S.LLM_FAILED.value, {"error": repr(exc)}
        self.notify(link, m.TransferReply(request_id=request_id, status_code=status, result=result))

    def _on_data_notice(self, link: Link, msg: Any) -> None:
        if self._data is not None:
            self._data.on_notice(link, msg)

    def _on_refuse(self, link: Link, msg: m.Refuse) -> None:
        """The client refused our Welcome (e.g. it requires a secret this side does not use)."""
        _log.warning("llmdd.link.refused_by_peer", peer=link.peer_cluster_id, reason=msg.reason)
        if link.fsm.in_(LINK_SETTING_UP):
            if link.session is not None:
                self._abort_setup(link, ProtocolError(f"the peer refused the link: {msg.reason}"))
            else:
                self._fail(link, ProtocolError(f"the peer refused the link: {msg.reason}"), trigger="handshake_failed")

    def _on_error(self, link: Link, msg: m.Error) -> None:
        _log.warning("llmdd.link.peer_error", peer=link.peer_cluster_id, code=msg.status_code, message=msg.message)
        if msg.fatal:
            self._fail(link, LLMException(msg.message, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    def _on_closed(self, link: Link, error: BaseException | None) -> None:
        if link.fsm.is_final:
            return
        reason = f"control connection lost: {error}" if error else "peer closed the control connection"
        if link.session is not None and link.fsm.in_(LINK_SETTING_UP):
            # a server-side link still in its setup leaves nothing behind
            self._abort_setup(link, ProtocolError(f"the peer went away during the link setup ({reason})"))
            return
        if link.fsm.in_(LINK_UNLINKING):
            # the peer acknowledged our unlink and closed: the unlink in progress ends the link
            for pending in list(link.pending.values()):
                pending.event.set()
            return
        self._fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")
        if isinstance(error, ProtocolError):
            # the peer sent something this side refuses (a bad frame, an invalid table update): tell it
            # the link is dead at once, instead of letting it find out from its liveness timeout
            self.notify(link, m.Error(status_code=S.LLM_LINK_FAILED.value, message=f"link failed: {error}",
                                      fatal=True))

    # ------------------------------------------------------------------ failure and teardown
    def fail_link(self, link: Link, error: BaseException, *, status: LLMStatusCode = S.LLM_LINK_FAILED) -> None:
        """The link can no longer be trusted (its data channel broke, its peer sent out-of-table
        numbers): FAILED, its waiters released and its transfers cancelled; a link already down
        stays as it is."""
        self._fail(link, error, trigger="peer_lost", status=status)

    def record_transfer(self, link: Link, *, read: int = 0, written: int = 0, failed: bool = False) -> None:
        """Count one transfer on the link's statistics: bytes read or written, or a failure."""
        if failed:
            link.failures += 1
            return
        link.bytes_read += read
        link.bytes_written += written
        link.transfers += 1

    def _fail(self, link: Link, error: BaseException, *, trigger: str,
              status: LLMStatusCode = S.LLM_LINK_FAILED) -> None:
        """Move a link to FAILED, release waiters, cancel its transfers (no lock held).  A link that
        is down already (or not set up) absorbs the trigger (``ABSORBED``) and stays as it is."""

        def record() -> None:   # visible no later than FAILED (the data plane reads failure_status)
            link.last_error = str(error)
            link.failure_status = status

        if not link.fsm.offer(trigger, error=error, reason=str(error), on_accept=record):
            return
        # the capability dies with the link: the peer's data connections to us are closed now
        self.endpoints.revoke(link.transport, link.grant_id)
        for pending in list(link.pending.values()):
            pending.event.set()
        link.tables_ready.set()
        link.settled.set()
        if self._data is not None:
            self._data.on_link_down(link)

    def transfer_timed_out(self, link: Link, error: BaseException) -> None:
        """A transfer exceeded ``sync_kv_timeout``: the link is unusable until relinked (contract)."""
        self._fail(link, error, trigger="transfer_timed_out", status=S.LLM_TIMEOUT)

    def _close_link(self, link: Link, *, trigger: str, reason: str) -> None:
        with self._lock:
            if self._links.get(link.peer_cluster_id) is link:
                del self._links[link.peer_cluster_id]
        # a link always ends CLOSED: when the wanted trigger no longer applies (the state moved
        # meanwhile, e.g. FAILED), the teardown is a force unlink; a closed link absorbs both
        link.fsm.offer_first((trigger, "force_unlink"), reason=reason)
        sess = link.session
        if sess is not None:
            sess.done = True
            sess.timer.cancel()
        for pending in list(link.pending.values()):
            pending.event.set()
        link.tables_ready.set()
        link.settled.set()
        if self._data is not None:
            self._data.on_link_down(link)
        self.endpoints.revoke(link.transport, link.grant_id)
        channel, link.channel = link.channel, None
        if channel is not None:
            try:
                channel.close()
            except TransportError:
                pass
        link.control.close()

    def unlink_clusters(self, clusters: list, timeout_ms: int, force: bool) -> tuple[LLMStatusCode, list]:
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            return S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
        deadline = time.monotonic() + timeout_ms / 1000.0
        codes = []
        for cluster in clusters:
            try:
                codes.append(self.unlink_one(cluster.remote_cluster_id, deadline, force=force))
            except Exception as exc:  # never raise out of unlink_clusters
                _log.warning("llmdd.link.unlink_failed", remote=cluster.remote_cluster_id, error=repr(exc))
                codes.append(S.LLM_UNLINK_FAILED)
        overall = S.LLM_SUCCESS
        for code in codes:
            if code is not S.LLM_SUCCESS:
                overall = code
        return overall, codes

    def unlink_one(self, cluster_id: int, deadline: float, *, force: bool) -> LLMStatusCode:
        link = self.get(cluster_id)
        if link is None:
            return S.LLM_SUCCESS if force else S.LLM_NOT_YET_LINK
        if force:
            self._close_link(link, trigger="force_unlink", reason="force unlink")
            return S.LLM_SUCCESS
        if link.fsm.in_(LINK_BUSY):
            return S.LLM_PROCESSING_LINK
        if link.fsm.in_(LINK_FAILED):
            # the peer cannot be told: tear down here; the other side must unlink too
            self._close_link(link, trigger="force_unlink", reason="unlink of a failed link")
            return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        if self._data is not None and not self._data.quiesce(link):
            return S.LLM_LINK_BUSY
        link.fsm.fire("unlink")   # no lock held: the data plane starts no transfer on a quiesced link
        rid = next(self._request_ids)
        pending = Pending()
        link.pending[rid] = pending
        try:
            link.control.send(m.UnlinkRequest(request_id=rid, force=False, reason="unlink_clusters"))
            acked = pending.event.wait(max(0.0, deadline - time.monotonic())) and pending.reply is not None
        except ProtocolError:
            acked = False
        if acked:
            self._close_link(link, trigger="unlink_succeeded", reason="unlinked")
            return S.LLM_SUCCESS
        self._close_link(link, trigger="force_unlink", reason="peer did not acknowledge the unlink")
        return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED

    # ------------------------------------------------------------------ liveness
    def _keepalive_tick(self) -> None:
        """Every ``keepalive_s`` on the loop thread: silent peers fail, live ones get a keepalive."""
        if self._closed:
            return
        now = time.monotonic()
        for link in self.links():
            if not link.fsm.in_(LINK_KEEPS_ALIVE):
                continue
            action = link.liveness.tick(now, link.control.stalled_since)
            if isinstance(action, PeerLost):
                self._submit(link, self._check_liveness, link)   # failing a link is blocking work
                continue
            self.notify(link, m.Keepalive(seq=action.seq, sent_at_ns=time.monotonic_ns()))
        self.loop.call_later(self.settings.keepalive_s, self._keepalive_tick)

    def _check_liveness(self, link: Link) -> None:
        """On the link's strand: still lost now (a message may have arrived meanwhile)? Fail it."""
        reason = link.liveness.lost(time.monotonic(), link.control.stalled_since)
        if reason is not None:
            self._fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Finalize: stop listening, tear every link down silently, close endpoints and the loop."""
        if self._closed:
            return
        self._closed = True
        self.stop_listening()
        for sock in list(self._group_listeners):
            self.close_group_listener(sock)
        for link in self.links():
            self._close_link(link, trigger="finalize", reason="finalize")
        for sess in list(self._pending):
            sess.drop()
        try:
            self._memory.regions.remove_listener(self.endpoints.on_regions_changed)
        except (KeyError, ValueError):
            pass
        self._memory.remove_change_listener(self.announce_all)
        self._registrar.close()
        self.endpoints.close()
        self.loop.close()

    def statistics(self) -> dict:
        out = {}
        for link in self.links():
            out[link.peer_cluster_id] = {
                "state": link.state.value, "transport": link.transport, "transport_reason": link.transport_reason,
                "client": link.is_client, "bytes_read": link.bytes_read, "bytes_written": link.bytes_written,
                "transfers": link.transfers, "failures": link.failures, "last_error": link.last_error,
                "rtt_s": link.rtt_s, "comm_id": link.comm_id,
            }
        return out

    def io_statistics(self) -> dict:
        """The loop's view: listeners, pending handshakes, refusals, threads (``llmdd doctor``, tests)."""
        return {"listeners": self.listener_status(), "pending": len(self._pending),
                "pending_addresses": len(self._pending_by_ip), "io_error": self._io_error,
                "threads": self.loop.threads() + self._registrar.threads(),
                "watched": self.loop.watched(), **dict(self._counters)}

def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _closed_at_once(exc: BaseException) -> bool:
    """A TLS server closed a new connection before its TLS handshake (over a cap)."""
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError)):
        return True
    return isinstance(exc, ssl.SSLError) and "EOF" in str(exc)




def _reason(info: LinkInfo, name: str) -> str:
    if info.forced:
        return f"forced by option ({info.forced})"
    where = "same host" if info.same_host else "different host"
    return f"{where}: chosen {name} among {list(info.peer_transports)}"


def _index_to_ref(index) -> m.KeyRef:
    """Memory's CacheKey index ``(req_id or prefix_id, model_id)`` as a wire KeyRef.

    Upstream keeps req ids and prefix ids in one index space, so does llmdd: the
    puller computes the same index from its ``CacheKey`` and looks up a REQ ref.
    """
    return m.KeyRef.for_req(index[0], index[1])
