"""The control plane: listener, link handshake, table exchange, keepalive, unlink.

One :class:`LinkManager` per initialized engine.  A link to a peer cluster is a TCP
control connection carrying the sans-io protocol of :mod:`llmdd._protocol`, plus a
data channel of the transport both sides agreed on.  The link's state lives in the
link lifecycle (``_lifecycle/tables.py``); this module does the I/O and fires the
outcome triggers.

Threads: an acceptor (only while listening), one reader per link, one keepalive
thread.  All are daemon threads: they never keep the interpreter alive, and the exit
handler's ``finalize`` closes them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import socket
import ssl
import threading
import time
from typing import Any, Callable, Optional

import attrs

from ._abc import Channel, Endpoint, MemRegion, TransportError
from ._lifecycle.machines import Tracked
from ._lifecycle.tables import LinkState
from ._log import get_logger
from ._options import is_local_address
from ._protocol import messages as m
from ._protocol.codec import NEED_DATA, PEER_CLOSED, Connection, ProtocolError
from ._protocol.handshake import (
    PRE_AUTH_MAX_FRAME_SIZE,
    ClientHandshake,
    DescriptorTables,
    HandshakeConfig,
    HandshakeRefused,
    HandshakeState,
    ServerHandshake,
    TableAnnouncer,
    new_incarnation,
)
from ._status import InvalidStateError, LLMException, LLMStatusCode
from .plugin import LinkInfo

__all__ = ["LinkManager", "Link", "LinkSettings"]

_log = get_logger("llmdd.link")

S = LLMStatusCode

#: llmdd's own option keys (documented in docs/configuration.md)
OPT_TRANSPORT = "llmdd.transport"
OPT_SECRET = "llmdd.auth_secret"
OPT_TLS_CERT = "llmdd.tls_cert"
OPT_TLS_KEY = "llmdd.tls_key"
OPT_TLS_CA = "llmdd.tls_ca"
OPT_KEEPALIVE_MS = "llmdd.keepalive_interval_ms"
OPT_PEER_TIMEOUT_MS = "llmdd.peer_timeout_ms"
OPT_DATA_HOST = "llmdd.data_host"
OPT_HANDSHAKE_MS = "llmdd.handshake_timeout_ms"

MAX_CLUSTERS_PER_CALL = 16


def _ms_option(options, key: str, default: int) -> int:
    text = options.get(key)
    if text is None:
        return default
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise LLMException(f"option {key} must be an integer (milliseconds), got {text!r}",
                           status_code=S.LLM_PARAM_INVALID) from None
    if value <= 0:
        raise LLMException(f"option {key} must be > 0, got {value}", status_code=S.LLM_PARAM_INVALID)
    return value


@attrs.frozen(kw_only=True)
class LinkSettings:
    secret: Optional[bytes]
    forced_transport: Optional[str]
    keepalive_s: float
    peer_timeout_s: float
    retry_count: int
    total_time_s: Optional[float]
    server_tls: Optional[ssl.SSLContext]
    client_tls: Optional[ssl.SSLContext]
    data_host: Optional[str]
    handshake_s: float

    @classmethod
    def from_options(cls, options) -> "LinkSettings":
        raw = options.raw
        secret = raw.get(OPT_SECRET) or os.environ.get("LLMDD_AUTH_SECRET") or None
        forced = raw.get(OPT_TRANSPORT) or None
        if forced is None and options.transfer_backend:
            # "hixl" is upstream's one-sided host-side engine: llmdd's counterpart is the tcp transport
            forced = "tcp" if options.transfer_backend == "hixl" else options.transfer_backend
        server_tls = client_tls = None
        cert, key, ca = raw.get(OPT_TLS_CERT), raw.get(OPT_TLS_KEY), raw.get(OPT_TLS_CA)
        if cert or ca:
            server_tls, client_tls = _tls_contexts(cert, key, ca)
        total = options.link_total_time_s
        return cls(
            secret=secret.encode() if isinstance(secret, str) else secret,
            forced_transport=forced,
            keepalive_s=_ms_option(raw, OPT_KEEPALIVE_MS, 1000) / 1000.0,
            peer_timeout_s=_ms_option(raw, OPT_PEER_TIMEOUT_MS, 5000) / 1000.0,
            retry_count=options.link_retry_count or 1,
            total_time_s=float(total) if total else None,
            server_tls=server_tls,
            client_tls=client_tls,
            data_host=raw.get(OPT_DATA_HOST) or None,
            handshake_s=_ms_option(raw, OPT_HANDSHAKE_MS, 10000) / 1000.0,
        )


def _tls_contexts(cert: Optional[str], key: Optional[str], ca: Optional[str]):
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        if cert:
            server.load_cert_chain(cert, key)
            client.load_cert_chain(cert, key)
        if ca:
            server.load_verify_locations(ca)
            server.verify_mode = ssl.CERT_REQUIRED  # mutual TLS when a CA is given
            client.load_verify_locations(ca)
            client.verify_mode = ssl.CERT_REQUIRED
        else:
            client.verify_mode = ssl.CERT_NONE
    except (OSError, ssl.SSLError) as exc:
        raise LLMException(f"cannot set up TLS from llmdd.tls_* options: {exc}",
                           status_code=S.LLM_PARAM_INVALID) from None
    return server, client


# --------------------------------------------------------------------------- control connection


class ControlConnection:
    """A socket carrying protocol frames: blocking sends under a lock, one reader thread.

    Once the reader runs, the socket's timeout is fixed (:attr:`IO_TIMEOUT`) and never changed
    again: changing it while another thread is blocked reading breaks TLS sockets.  The reader
    treats a timeout as "nothing yet" and reads on; a send that cannot progress for that long
    fails the link.
    """

    IO_TIMEOUT = 5.0

    def __init__(self, sock: socket.socket, *, name: str) -> None:
        self.sock = sock
        self.codec = Connection()
        self.name = name
        self._send_lock = threading.Lock()
        self._closed = False
        self._reading = False
        self._reader: Optional[threading.Thread] = None

    def send(self, msg: Any, *, timeout: float = 5.0) -> None:
        data = self.codec.send(msg)
        with self._send_lock:
            if self._closed:
                raise ProtocolError("control connection is closed")
            try:
                if not self._reading:
                    self.sock.settimeout(timeout)
                self.sock.sendall(data)
            except (OSError, ValueError) as exc:
                raise ProtocolError(f"control send failed: {exc}") from None

    def recv_message(self, deadline: float) -> Any:
        """Block until one message (handshake phase, before the reader starts)."""
        while True:
            msg = self.codec.next_message()
            if msg is not NEED_DATA:
                return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake timed out")
            try:
                self.sock.settimeout(left)
                data = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError("handshake timed out") from None
            except OSError as exc:
                raise ProtocolError(f"control receive failed: {exc}") from None
            self.codec.receive_data(data)

    def start_reader(self, on_message: Callable[[Any], None], on_closed: Callable[[BaseException | None], None]):
        def run() -> None:
            error: BaseException | None = None
            try:
                while True:
                    msg = self.codec.next_message()
                    if msg is NEED_DATA:
                        try:
                            data = self.sock.recv(1 << 20)
                        except socket.timeout:
                            if self._closed:
                                break
                            continue  # idle: liveness is the keepalive's business
                        self.codec.receive_data(data)
                        continue
                    if msg is PEER_CLOSED:
                        break
                    on_message(msg)
            except (OSError, ProtocolError, ValueError) as exc:
                error = exc
            except BaseException as exc:  # a handler bug must not kill the link silently
                _log.error("llmdd.link.reader_failed", conn=self.name, error=repr(exc))
                error = exc
            if not self._closed:
                on_closed(error)

        with self._send_lock:
            self.sock.settimeout(self.IO_TIMEOUT)
            self._reading = True
        reader = threading.Thread(target=run, name=f"llmdd-ctl-{self.name}", daemon=True)
        reader.start()
        self._reader = reader   # only once started: a concurrent close() may join it from then on

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=2.0)


# --------------------------------------------------------------------------- link


class _Pending:
    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: Any = None


@attrs.define(eq=False)
class Link:
    """One live link to a peer cluster (keyed by the cluster id the peer reports)."""

    peer_cluster_id: int
    fsm: Tracked
    control: ControlConnection
    peer: Any = None                                   # handshake PeerInfo
    tables: DescriptorTables = attrs.field(factory=DescriptorTables)
    announcer: TableAnnouncer = attrs.field(factory=TableAnnouncer)
    transport: Optional[str] = None
    transport_reason: str = ""
    channel: Optional[Channel] = None
    tables_ready: threading.Event = attrs.field(factory=threading.Event)
    transfer_lock: threading.Lock = attrs.field(factory=threading.Lock)
    async_busy: int = 0
    last_rx: float = attrs.field(factory=time.monotonic)
    pending: dict = attrs.field(factory=dict)
    remote_regions: set = attrs.field(factory=set)
    comm_id: Optional[int] = None
    engine_info: Optional[dict] = None        # the peer's pools and profile (asked once, when needed)
    is_client: bool = True
    created_at: float = attrs.field(factory=time.monotonic)
    bytes_read: int = 0
    bytes_written: int = 0
    transfers: int = 0
    failures: int = 0
    last_error: Optional[str] = None
    rtt_s: Optional[float] = None
    failure_status: Optional[LLMStatusCode] = None

    @property
    def state(self) -> LinkState:
        return self.fsm.state

    @property
    def linked(self) -> bool:
        return self.fsm.state is LinkState.LINKED


# --------------------------------------------------------------------------- manager


class LinkManager:
    """Links of one engine, server side and client side."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._options = core.options
        self._hooks = core.hooks
        self._lc = core.links
        self.settings = LinkSettings.from_options(core.options)
        self.cluster_id = core.cluster_id
        self.incarnation = new_incarnation()
        self.host = m.HostIdentity.local()
        self._lock = threading.RLock()
        self._links: dict[int, Link] = {}           # peer cluster id -> live link
        self._aliases: dict[int, int] = {}          # remote_cluster_id given by the user -> peer id
        self._linking: set[int] = set()             # remote_cluster_ids with a link_clusters in progress
        self._request_ids = itertools.count(1)
        self._closed = False
        self._listener: Optional[socket.socket] = None
        self._listen_addr: Optional[tuple[str, int]] = None
        self._acceptor: Optional[threading.Thread] = None
        self._group_listeners: dict[socket.socket, threading.Thread] = {}
        self._client_host: Optional[str] = None
        self._registry = self._hooks.register_transports()
        self._endpoints: dict[str, Endpoint] = {}
        self._endpoint_lock = threading.Lock()
        self._region_descs: dict[int, dict] = {}     # local region id -> {transport: desc}
        self._stop = threading.Event()
        self._keepalive = threading.Thread(target=self._keepalive_loop, name="llmdd-keepalive", daemon=True)
        self._keepalive.start()
        self._message_handlers: dict[type, Callable[[Link, Any], None]] = {
            m.RegionsUpdate: self._on_tables,
            m.CacheTableUpdate: self._on_tables,
            m.Keepalive: self._on_keepalive,
            m.KeepaliveAck: self._on_keepalive_ack,
            m.UnlinkRequest: self._on_unlink_request,
            m.UnlinkAck: self._on_reply,
            m.TransferReply: self._on_reply,
            m.TransferRequest: self._on_transfer_request,
            m.ReadDone: self._on_read_done,
            m.KeyConsumed: self._on_key_consumed,
            m.Error: self._on_error,
        }
        self.request_handlers: dict[str, Callable[[Link, dict], tuple[int, dict]]] = {}
        core.memory.regions.add_listener(self._on_regions_changed)
        core.memory.add_change_listener(self.announce_all)
        if core.options.listen is not None:
            self.listen(*core.options.listen)

    # ------------------------------------------------------------------ transports and endpoints
    @property
    def registry(self):
        return self._registry

    def _data_host(self) -> str:
        """Where network transports' data endpoints bind: the option, the listen IP, the local IP a
        client named in ``append_local_ip_info``, else loopback (never a wildcard by default)."""
        if self.settings.data_host:
            return self.settings.data_host
        if self._listen_addr is not None and self._listen_addr[0] not in ("0.0.0.0", ""):
            return self._listen_addr[0]
        return self._client_host or "127.0.0.1"

    def endpoint(self, name: str) -> Endpoint:
        with self._endpoint_lock:
            ep = self._endpoints.get(name)
            if ep is not None:
                return ep
            cls = self._registry.get(name)
            transport = cls(self._options.raw)
            ep = transport.open_endpoint(host=self._data_host(), secret=self.settings.secret)
            for region in self._core.memory.regions.regions():
                self._region_descs.setdefault(region.region_id, {})[name] = ep.register(self._mem_region(region))
            self._endpoints[name] = ep
            return ep

    def offers(self) -> tuple[m.TransportOffer, ...]:
        """The transports this engine offers in a handshake (only the forced one when forced, so a
        forcing client is honoured even though the server side decides)."""
        offers = []
        for cand in self._registry.candidates():
            if self.settings.forced_transport and cand.name != self.settings.forced_transport:
                continue
            try:
                desc = self.endpoint(cand.name).describe()
            except (TransportError, OSError) as exc:
                _log.warning("llmdd.transport.endpoint_failed", transport=cand.name, error=str(exc))
                continue
            offers.append(m.TransportOffer(name=cand.name, descriptor=desc))
        return tuple(offers)

    def _granted(self, region) -> bool:
        """May linked peers access ``region``?  In remote-accessible mode only regions registered
        remote-accessible; otherwise every cache of the engine is served to linked peers, as
        upstream's engine serves pulls of any cache in that mode."""
        return bool(region.remote_accessible) or not self._options.remote_cache_accessible

    def _mem_region(self, region) -> MemRegion:
        return attrs.evolve(region.to_mem_region(), remote_accessible=self._granted(region))

    def _region_descriptor(self, region) -> m.RegionDescriptor:
        return m.RegionDescriptor(
            region_id=region.region_id, cache_id=region.cache_id, addr=region.addr, size=region.size,
            placement=region.placement, remote_accessible=self._granted(region),
            transports=dict(self._region_descs.get(region.region_id, {})))

    def _on_regions_changed(self, kind: str, regions: tuple, version: int) -> None:
        with self._endpoint_lock:
            for region in regions:
                if kind == "remove":
                    for ep in self._endpoints.values():
                        ep.deregister(region.region_id)
                    self._region_descs.pop(region.region_id, None)
                    continue
                if kind == "remap":
                    for ep in self._endpoints.values():
                        ep.deregister(region.region_id)
                descs = self._region_descs.setdefault(region.region_id, {})
                for name, ep in self._endpoints.items():
                    descs[name] = ep.register(self._mem_region(region))
        # announcements follow the memory manager's change notice, once caches and keys are consistent

    # ------------------------------------------------------------------ table announcements
    def _local_tables(self) -> tuple[dict, dict, dict]:
        """Current regions, caches and keys of this engine, in wire form."""
        memory = self._core.memory
        # memory peers may not access is not announced at all: they cannot even learn it exists
        regions = {r.region_id: self._region_descriptor(r) for r in memory.regions.regions() if self._granted(r)}
        caches: dict[int, m.CacheEntry] = {}
        keys: dict[m.KeyRef, m.KeyEntry] = {}
        for rec in memory.records():
            if not rec.live and rec.state.value != "release_pending":
                continue
            if not any(self._granted(r) for r in rec.regions):
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
        with self._lock:
            regions, caches, keys = self._local_tables()
            self._announce(link, regions, caches, keys, full=True)

    # ------------------------------------------------------------------ server side
    def listen(self, host: str, port: int) -> tuple[str, int]:
        if self._listener is not None:
            self.stop_listening()
        try:
            sock = socket.create_server((host, port), backlog=128, reuse_port=False)
        except OSError as exc:
            raise LLMException(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                               status_code=S.LLM_PARAM_INVALID) from None
        self._listener = sock
        self._listen_addr = sock.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept_loop, args=(sock,), name="llmdd-listener",
                                          daemon=True)
        self._acceptor.start()
        _log.info("llmdd.link.listening", host=self._listen_addr[0], port=self._listen_addr[1])
        return self._listen_addr

    @property
    def listen_address(self) -> Optional[tuple[str, int]]:
        return self._listen_addr

    def stop_listening(self) -> None:
        sock, self._listener = self._listener, None
        self._listen_addr = None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=2.0)
            self._acceptor = None

    def _accept_loop(self, sock: socket.socket, comm_id: Optional[int] = None) -> None:
        while True:
            try:
                conn, addr = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_handshake, args=(conn, addr, comm_id), name="llmdd-accept",
                             daemon=True).start()

    def open_group_listener(self, host: str, port: int, *, comm_id: int) -> socket.socket:
        """A listener for the members of one comm group (links accepted there carry ``comm_id``)."""
        try:
            sock = socket.create_server((host, port), backlog=16)
        except OSError as exc:
            raise LLMException(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                               status_code=S.LLM_LINK_FAILED) from None
        thread = threading.Thread(target=self._accept_loop, args=(sock, comm_id), name=f"llmdd-comm-{comm_id}-listener",
                                  daemon=True)
        thread.start()
        self._group_listeners[sock] = thread
        return sock

    def close_group_listener(self, sock: socket.socket) -> None:
        thread = self._group_listeners.pop(sock, None)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        if thread is not None:
            thread.join(timeout=2.0)

    def _handshake_config(self, role) -> HandshakeConfig:
        return HandshakeConfig(cluster_id=self.cluster_id, role=role, incarnation=self.incarnation,
                               host=self.host, transports=self.offers(), secret=self.settings.secret)

    def _serve_handshake(self, sock: socket.socket, addr, comm_id: Optional[int] = None) -> None:
        """Server side of one link: authenticate, choose the transport, exchange tables."""
        deadline = time.monotonic() + self.settings.handshake_s
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.settings.server_tls is not None:
                sock.settimeout(5.0)
                sock = self.settings.server_tls.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            _log.warning("llmdd.link.tls_refused", peer=str(addr), error=str(exc))
            sock.close()
            return
        conn = ControlConnection(sock, name=f"{addr[0]}:{addr[1]}")
        conn.codec.max_frame_size = PRE_AUTH_MAX_FRAME_SIZE
        hs = ServerHandshake(self._handshake_config(self._core.role))
        link: Optional[Link] = None
        try:
            while hs.state not in (HandshakeState.AUTHENTICATED, HandshakeState.REFUSED,
                                   HandshakeState.ESTABLISHED):
                for out in hs.receive(conn.recv_message(deadline)):
                    conn.send(out)
            if hs.state is HandshakeState.REFUSED:
                _log.warning("llmdd.link.refused", peer=str(addr), reason=hs.refusal.reason if hs.refusal else "")
                conn.close()
                return
            hello = hs.hello
            if self._link_limit_reached() and hello.cluster_id not in self._links:
                conn.send(hs.refuse(S.LLM_CLUSTER_NUM_EXCEED_LIMIT.value,
                                    f"this engine has reached its link limit ({self._core.profile.max_links})"))
                conn.close()
                return
            offered = {o.name: o for o in hello.transports}
            info = LinkInfo(local_cluster_id=self.cluster_id, peer_cluster_id=hello.cluster_id,
                            same_host=self.host.same_ipc_domain(hello.host),
                            forced=self.settings.forced_transport, peer_transports=tuple(offered))
            candidates = self._registry.candidates(offered)
            name = self._hooks.select_transport(info, candidates)
            if name is None:
                conn.send(hs.refuse(S.LLM_LINK_FAILED.value,
                                    f"no common transport (offered {sorted(offered)}, here "
                                    f"{[c.name for c in candidates]}, forced {info.forced})"))
                conn.close()
                return
            conn.send(hs.accept(m.TransportOffer(name=name, descriptor=self.endpoint(name).describe())))
            conn.codec.max_frame_size = 16 * 1024 * 1024
            link = self._adopt(hs.result(), conn, is_client=False, transport=name,
                               reason=_reason(info, name))
            link.comm_id = comm_id
            link.tables_ready.wait(max(0.0, deadline - time.monotonic()))
            if not link.tables_ready.is_set():
                raise TimeoutError("peer did not send its tables")
            if link.state is not LinkState.LINKING:
                raise ProtocolError(f"the peer went away during the link setup ({link.last_error})")
            self._connect_channel(link, offered[name].descriptor, deadline)
            self._send_initial_tables(link)
            link.last_rx = time.monotonic()   # liveness counts from LINKED, not from a slow handshake
            link.fsm.fire("handshake_succeeded", transport=name, reason=link.transport_reason)
        except (TimeoutError, ProtocolError, HandshakeRefused, TransportError, LLMException, OSError) as exc:
            _log.warning("llmdd.link.accept_failed", peer=str(addr), error=str(exc))
            if link is not None:
                # a link that never came up leaves nothing behind on the server side
                self._fail(link, exc, trigger="handshake_failed")
                self._close_link(link, trigger="force_unlink", reason=f"link setup failed: {exc}")
            else:
                conn.close()

    def _adopt(self, peer, conn: ControlConnection, *, is_client: bool, transport: str, reason: str) -> Link:
        """Create the link object for an authenticated peer, replacing a stale one."""
        with self._lock:
            old = self._links.get(peer.cluster_id)
            if old is not None:
                # the peer relinks: it has no entity any more (restart = new incarnation, or a force unlink)
                self._close_link(old, trigger="force_unlink",
                                 reason="replaced by a new link from the same cluster")
            fsm = self._lc.create(peer.cluster_id, peer=peer.cluster_id)
            fsm.fire("link" if is_client else "accept", transport=transport)
            link = Link(peer_cluster_id=peer.cluster_id, fsm=fsm, control=conn, peer=peer, is_client=is_client,
                        transport=transport, transport_reason=reason)
            self._links[peer.cluster_id] = link
        conn.start_reader(lambda msg: self._dispatch(link, msg), lambda err: self._on_closed(link, err))
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
        try:
            return self._link_one(cluster, deadline)
        except LLMException as exc:
            _log.warning("llmdd.link.failed", remote=cluster.remote_cluster_id, error=str(exc))
            return exc.status_code if exc.status_code is not S.LLM_SUCCESS else S.LLM_LINK_FAILED
        except Exception as exc:  # never raise out of link_clusters
            _log.warning("llmdd.link.failed", remote=cluster.remote_cluster_id, error=repr(exc))
            return S.LLM_LINK_FAILED

    def _link_limit_reached(self) -> bool:
        limit = self._core.profile.max_links
        return limit is not None and sum(1 for lk in self._links.values() if not lk.fsm.is_final) >= limit

    def _link_one(self, cluster, deadline: float) -> LLMStatusCode:
        remote_id = cluster.remote_cluster_id
        with self._lock:
            if self._link_limit_reached():
                return S.LLM_CLUSTER_NUM_EXCEED_LIMIT
            existing = self._links.get(self._aliases.get(remote_id, remote_id))
            if existing is not None:
                if existing.linked:
                    return S.LLM_ALREADY_LINK
                if existing.state in (LinkState.LINKING, LinkState.UNLINKING, LinkState.UNLINKED):
                    return S.LLM_PROCESSING_LINK
                # FAILED: the caller relinks without unlinking first; replace it
                self._close_link(existing, trigger="force_unlink", reason="relink after failure")
            if remote_id in self._linking:
                # another call is linking this cluster: its handshake would be replaced by ours
                return S.LLM_PROCESSING_LINK
            self._linking.add(remote_id)
        try:
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
        link = self.connect_peer(host, port, deadline)
        with self._lock:
            self._aliases[remote_id] = link.peer_cluster_id
        return S.LLM_SUCCESS

    def connect_peer(self, host: str, port: int, deadline: float, *, comm_id: Optional[int] = None) -> Link:
        """Client side of one link: connect (retrying), handshake, tables, data channel."""
        if self.settings.total_time_s is not None and comm_id is not None:
            deadline = min(deadline, time.monotonic() + self.settings.total_time_s)
        attempts = max(1, self.settings.retry_count)
        last: BaseException | None = None
        sock = None
        for attempt in range(attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                sock = socket.create_connection((host, port), timeout=left)
                break
            except OSError as exc:
                last = exc
                if attempt + 1 < attempts:
                    time.sleep(min(0.05 * (attempt + 1), max(0.0, deadline - time.monotonic())))
        if sock is None:
            raise LLMException(f"cannot connect to {host}:{port}: {last}", status_code=S.LLM_LINK_FAILED)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.settings.client_tls is not None:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock = self.settings.client_tls.wrap_socket(sock)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise LLMException(f"TLS with {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None
        conn = ControlConnection(sock, name=f"{host}:{port}")
        link: Optional[Link] = None
        try:
            hs = ClientHandshake(self._handshake_config(self._core.role))
            conn.send(hs.start())
            while hs.state not in (HandshakeState.ESTABLISHED, HandshakeState.REFUSED):
                for out in hs.receive(conn.recv_message(deadline)):
                    conn.send(out)
            peer = hs.result()  # raises HandshakeRefused
            info = LinkInfo(local_cluster_id=self.cluster_id, peer_cluster_id=peer.cluster_id,
                            same_host=self.host.same_ipc_domain(peer.host), forced=self.settings.forced_transport,
                            peer_transports=tuple(o.name for o in peer.offered))
            link = self._adopt(peer, conn, is_client=True, transport=peer.transport.name,
                               reason=_reason(info, peer.transport.name))
            link.comm_id = comm_id
            self._send_initial_tables(link)
            link.tables_ready.wait(max(0.0, deadline - time.monotonic()))
            if not link.tables_ready.is_set():
                raise TimeoutError("the peer did not send its tables in time")
            self._connect_channel(link, peer.transport.descriptor, deadline)
            link.last_rx = time.monotonic()   # liveness counts from LINKED, not from a slow handshake
            link.fsm.fire("handshake_succeeded", transport=link.transport, reason=link.transport_reason)
            return link
        except HandshakeRefused as exc:
            conn.close()
            raise LLMException(f"link to {host}:{port} refused: {exc}", status_code=S.LLM_LINK_FAILED) from None
        except (TimeoutError, ProtocolError, TransportError, OSError, InvalidStateError) as exc:
            if link is not None:
                self._fail(link, exc, trigger="handshake_failed")
                self._close_link(link, trigger="force_unlink", reason="link setup failed")
            else:
                conn.close()
            raise LLMException(f"link to {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None

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
        if link.state is LinkState.FAILED:
            raise LLMException(f"link to cluster {cluster_id} has failed ({link.last_error}); unlink and relink it",
                               status_code=link.failure_status or S.LLM_LINK_FAILED)
        if not link.linked:
            raise LLMException(f"link to cluster {cluster_id} is {link.state.value}",
                               status_code=S.LLM_PROCESSING_LINK if link.state in (
                                   LinkState.LINKING, LinkState.UNLINKING) else S.LLM_NOT_YET_LINK)
        return link

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def has_links(self) -> bool:
        with self._lock:
            return any(not lk.fsm.is_final for lk in self._links.values())

    def request(self, link: Link, op: str, args: dict, *, deadline: float) -> tuple[int, dict]:
        """Send a TransferRequest and wait for its reply until ``deadline``."""
        rid = next(self._request_ids)
        pending = _Pending()
        link.pending[rid] = pending
        try:
            link.control.send(m.TransferRequest(request_id=rid, op=op, args=args))
            if not pending.event.wait(max(0.0, deadline - time.monotonic())):
                raise LLMException(f"peer {link.peer_cluster_id} did not answer {op!r} in time",
                                   status_code=S.LLM_TIMEOUT)
            reply = pending.reply
            if reply is None:
                raise LLMException(f"link to {link.peer_cluster_id} went down during {op!r}",
                                   status_code=S.LLM_LINK_FAILED)
            return reply.status_code, dict(reply.result)
        except ProtocolError as exc:
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
    def _dispatch(self, link: Link, msg: Any) -> None:
        link.last_rx = time.monotonic()
        handler = self._message_handlers.get(type(msg))
        if handler is None:
            _log.warning("llmdd.link.unexpected_message", peer=link.peer_cluster_id, type=type(msg).__name__)
            return
        handler(link, msg)

    def _on_tables(self, link: Link, msg: Any) -> None:
        link.tables.apply(msg)  # raises TableUpdateError (a ProtocolError): the reader fails the link
        if isinstance(msg, m.CacheTableUpdate) and link.tables.regions_version > 0:
            link.tables_ready.set()
        if link.channel is not None and isinstance(msg, m.RegionsUpdate):
            self._sync_remote_regions(link)
        if link.linked and isinstance(msg, m.RegionsUpdate):
            link.fsm.fire("regions_updated", version=msg.version)

    def _on_keepalive(self, link: Link, msg: m.Keepalive) -> None:
        self.notify(link, m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns,
                                         sent_at_ns=time.monotonic_ns()))

    def _on_keepalive_ack(self, link: Link, msg: m.KeepaliveAck) -> None:
        link.rtt_s = max(0, time.monotonic_ns() - msg.echo_sent_at_ns) / 1e9

    def _on_reply(self, link: Link, msg: Any) -> None:
        pending = link.pending.get(msg.request_id)
        if pending is not None:
            pending.reply = msg
            pending.event.set()

    def _on_unlink_request(self, link: Link, msg: m.UnlinkRequest) -> None:
        self.notify(link, m.UnlinkAck(request_id=msg.request_id, status_code=0))
        self._close_link(link, trigger="peer_unlinked", reason=msg.reason or "peer unlinked")

    def _on_transfer_request(self, link: Link, msg: m.TransferRequest) -> None:
        handler = self.request_handlers.get(msg.op)
        if handler is None:
            status, result = S.LLM_PARAM_INVALID.value, {"error": f"unknown op {msg.op!r}"}
        else:
            try:
                status, result = handler(link, dict(msg.args))
            except LLMException as exc:
                status, result = exc.status_code.value, {"error": str(exc)}
            except Exception as exc:
                _log.error("llmdd.link.request_failed", op=msg.op, error=repr(exc))
                status, result = S.LLM_FAILED.value, {"error": repr(exc)}
        self.notify(link, m.TransferReply(request_id=msg.request_id, status_code=status, result=result))

    def _on_read_done(self, link: Link, msg: m.ReadDone) -> None:
        handler = self.request_handlers.get("__read_done__")
        if handler is not None:
            handler(link, {"msg": msg})

    def _on_key_consumed(self, link: Link, msg: m.KeyConsumed) -> None:
        handler = self.request_handlers.get("__key_consumed__")
        if handler is not None:
            handler(link, {"msg": msg})

    def _on_error(self, link: Link, msg: m.Error) -> None:
        _log.warning("llmdd.link.peer_error", peer=link.peer_cluster_id, code=msg.status_code, message=msg.message)
        if msg.fatal:
            self._fail(link, LLMException(msg.message, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    def _on_closed(self, link: Link, error: BaseException | None) -> None:
        if link.fsm.is_final:
            return
        reason = f"control connection lost: {error}" if error else "peer closed the control connection"
        self._fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")
        if isinstance(error, ProtocolError):
            # the peer sent something this side refuses (a bad frame, an invalid table update): tell it
            # the link is dead at once, instead of letting it find out from its liveness timeout
            self.notify(link, m.Error(status_code=S.LLM_LINK_FAILED.value, message=f"link failed: {error}",
                                      fatal=True))

    # ------------------------------------------------------------------ failure and teardown
    def _fail(self, link: Link, error: BaseException, *, trigger: str,
              status: LLMStatusCode = S.LLM_LINK_FAILED) -> None:
        """Move a link to FAILED (if legal), release waiters, cancel its transfers."""
        with self._lock:
            if not link.fsm.can(trigger):
                return
            link.last_error = str(error)
            link.failure_status = status
            link.fsm.fire(trigger, error=error, reason=str(error))
        for pending in list(link.pending.values()):
            pending.event.set()
        link.tables_ready.set()
        hook = self.request_handlers.get("__link_failed__")
        if hook is not None:
            hook(link, {"error": error})

    def transfer_timed_out(self, link: Link, error: BaseException) -> None:
        """A transfer exceeded ``sync_kv_timeout``: the link is unusable until relinked (contract)."""
        self._fail(link, error, trigger="transfer_timed_out", status=S.LLM_TIMEOUT)

    def _close_link(self, link: Link, *, trigger: str, reason: str) -> None:
        with self._lock:
            if link.fsm.can(trigger):
                link.fsm.fire(trigger, reason=reason)
            if self._links.get(link.peer_cluster_id) is link:
                del self._links[link.peer_cluster_id]
        for pending in list(link.pending.values()):
            pending.event.set()
        link.tables_ready.set()
        hook = self.request_handlers.get("__link_closed__")
        if hook is not None:
            hook(link, {})
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
        if link.state in (LinkState.LINKING, LinkState.UNLINKING):
            return S.LLM_PROCESSING_LINK
        if link.state is LinkState.FAILED:
            # the peer cannot be told: tear down here; the other side must unlink too
            self._close_link(link, trigger="force_unlink", reason="unlink of a failed link")
            return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        if link.async_busy or not link.transfer_lock.acquire(timeout=0):
            return S.LLM_LINK_BUSY
        try:
            link.fsm.fire("unlink")
        finally:
            link.transfer_lock.release()
        rid = next(self._request_ids)
        pending = _Pending()
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
    def _keepalive_loop(self) -> None:
        seq = itertools.count(1)
        while not self._stop.wait(self.settings.keepalive_s):
            now = time.monotonic()
            for link in self.links():
                if link.state not in (LinkState.LINKED, LinkState.UNLINKING):
                    continue
                if now - link.last_rx > self.settings.peer_timeout_s:
                    self._fail(link, LLMException(
                        f"no message from peer {link.peer_cluster_id} for {now - link.last_rx:.1f} s",
                        status_code=S.LLM_LINK_FAILED), trigger="peer_lost")
                    continue
                self.notify(link, m.Keepalive(seq=next(seq), sent_at_ns=time.monotonic_ns()))

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Finalize: stop listening, tear every link down silently, close endpoints."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.stop_listening()
        for sock in list(self._group_listeners):
            self.close_group_listener(sock)
        for link in self.links():
            self._close_link(link, trigger="finalize", reason="finalize")
        try:
            self._core.memory.regions.remove_listener(self._on_regions_changed)
        except (KeyError, ValueError):
            pass
        self._core.memory.remove_change_listener(self.announce_all)
        with self._endpoint_lock:
            endpoints, self._endpoints = self._endpoints, {}
        for ep in endpoints.values():
            try:
                ep.close()
            except TransportError:
                pass
        self._keepalive.join(timeout=2.0)

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
