"""The tcp endpoint (:class:`TcpEndpoint`), one concept: the data port's owner.  Its region registry and
pins, its grants (grant, revoke, serve links only), its channels, and the serving side of its port: accept
under the pending caps, OPEN checks, and a worker's serving of requests (validated against the regions and
the grant, then moved).  The streams themselves are :mod:`._server`'s, the client side :mod:`._channel`'s."""

from __future__ import annotations

import errno
import hmac
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from llmdd.abc import CAPABILITY_BYTES, Endpoint, EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import EVENT_READ, Batch, Cancelled, Corrupt, IoLoop, MemRegion, PeerGone, Refused, RegionRegistry
from llmdd.lowlevel import TransportTimeout
from llmdd.lowlevel import RegionTable, RegisteredRegion, TlsConfig, encode_payload, get_logger
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from ._channel import TcpChannel
from ._descriptors import EndpointFields, RegionFields, endpoint_fields
from ._few import FEW_OPS, discard_payload, refusal, serve_few
from ._grants import Grant, grant_handle, mac
from ._io import OK_HEAD, OK_HEAD_PADDED, cut_tail, move, sendmsg_all, Where
from ._native import native
from ._options import OPT_LINGER, OPT_MAX_PENDING, OPT_MAX_PENDING_PER_ADDRESS, OPT_PENDING_TIMEOUT, OPT_SEGMENT
from ._options import OPT_NATIVE, OPT_SERVER_SEND_TIMEOUT, OPT_SERVER_WORKERS, OPT_SPIN
from ._request import read_request
from ._server import PendingStreams, ServerConn
from ._sock import SPIN_SKIP_MAX, StreamBatch, close_sock, map_exc, region_view, set_timeouts, shutdown_sock, tune
from ._sock import wait_readable, waitall
from ._wire import F_EAGER, F_PAD, READ, ST_OK, ST_REFUSED, VERSION, send_rsp

_log = get_logger("llmdd.transport.tcp")


_ACCEPT_PAUSE_S = 0.1
#: the grant of an endpoint not (yet) serving links only: every region, for holders of ``describe()``
_DIRECT = -1
#: what :meth:`TcpEndpoint._serve_native` returns besides a request for Python: the stream stays idle
#: past the linger (back to the loop), it ended (finished), or Python serves the next request itself
_IDLE, _ENDED, _PYTHON = "idle", "ended", "python"


class _Reg(RegisteredRegion):
    """A registered region and a writable view of its memory (the few-ops path and the channels'
    quick path slice it; used only while the region is pinned)."""

    __slots__ = ("view",)

    def __init__(self, region: MemRegion) -> None:
        super().__init__(region)
        self.view = region_view(int(region.addr), int(region.size))


class TcpEndpoint(Endpoint):
    """Listens on ``host:ephemeral``; serves its own regions to granted links; opens channels to peers."""

    capabilities = True

    def __init__(self, *, host: str, secret: Union[bytes, None], cfg: Mapping[str, Any],
                 tls: Union[TlsConfig, None] = None) -> None:
        self._host = host
        self.secret = secret
        self.tls = tls
        self.cfg = dict(cfg)
        self.endpoint_id = os.urandom(16)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._regs: RegionRegistry[_Reg] = RegionRegistry(self._cond)
        self._closed = False
        self._qver = 0   # the region table's version: bumped on every change and on close (llmdd_tcp._quick)
        self._few_ops = FEW_OPS   # requests of at most this many ops are served without numpy (llmdd_tcp._few)
        # the C path's mirror of the served regions, their pins and its counters (llmdd_tcp._tcpfast): small
        # requests on plain streams are served there, without Python per request; None: the Python path
        self._fast = native.Table() if native is not None and tls is None and cfg.get(OPT_NATIVE) != "off" else None
        self.eager_max = int(self.cfg[OPT_SEGMENT])   # the most a refused eager write's payload is read to drop
        self._server_conns: dict[socket.socket, ServerConn] = {}
        self._pending = PendingStreams()
        self._serving: dict[int, tuple[socket.socket, frozenset]] = {}
        self._channels: set[TcpChannel] = set()
        self._grants: dict[int, Grant] = {}
        self._by_handle: dict[bytes, Grant] = {}
        self._revoked: set[int] = set()
        self._direct = secrets.token_bytes(CAPABILITY_BYTES)
        self._links_only = False
        self._install(_DIRECT, self._direct, None)
        # int counters, last_error and listener_failed (str or None)
        self._stats: dict[str, Any] = {"bytes_served": 0, "ops_served": 0, "requests": 0, "refused": 0,
                       "connections": 0, "auth_failures": 0, "last_error": None, "refused_connections": 0,
                       "pending_expired": 0, "evicted": 0, "accept_errors": 0, "listener_failed": None,
                       "capability_refused": 0, "grants_revoked": 0, "tls_failures": 0,
                       "requests_spun": 0, "requests_native": 0}
        self._lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.bind((host, 0))
        self._lsock.listen(128)
        self._lsock.setblocking(False)
        self._port = self._lsock.getsockname()[1]
        self.log = _log.bind(endpoint=self.endpoint_id.hex()[:8], port=self._port)
        self._linger = max(0.0, float(self.cfg[OPT_LINGER]) / 1000.0)
        self.spin_s = max(0.0, float(self.cfg[OPT_SPIN]) / 1e6)
        self.pending_s = max(1, int(self.cfg[OPT_PENDING_TIMEOUT])) / 1000.0
        self._last_accept_warning = 0.0
        self._on_listener_failed: list = []
        self.loop = IoLoop(f"tcp-{self._port}", workers=max(1, int(self.cfg[OPT_SERVER_WORKERS])))
        self.loop.on_dead(lambda exc: self._listener_dead(f"the endpoint's I/O loop stopped: {exc!r}"))
        self.loop.set_events(self._lsock, EVENT_READ, self._on_accept)

    # ------------------------------------------------------------------ public API

    def describe(self) -> EndpointDescriptor:
        fields = EndpointFields(host=self._host, port=self._port, endpoint_id=self.endpoint_id,
                                auth=self.secret is not None, tls=self.tls is not None, pid=os.getpid(),
                                hostname=socket.gethostname())
        with self._lock:
            # not serving links only: the description itself opens the port
            cap = None if self._links_only else self._direct
        return EndpointDescriptor(transport="tcp", version=VERSION, payload=encode_payload(fields), capability=cap)

    def listen_address(self) -> tuple[str, int]:
        return (self._host, self._port)

    # ------------------------------------------------------------------ grants

    def _install(self, link_id: int, cap: bytes, regions: Union[frozenset, None]) -> None:
        grant = Grant(link_id, cap, self.secret, regions)
        self._grants[link_id] = grant
        self._by_handle[grant.handle] = grant

    def serve_links_only(self) -> None:
        with self._lock:
            self._links_only = True
        self.revoke(_DIRECT)

    def grant(self, link_id: int, capability: bytes, regions) -> None:
        link_id = int(link_id)
        capability = bytes(capability)
        if len(capability) < 16:
            raise Refused("a capability has at least 128 bits")
        ids = None if regions is None else frozenset(int(r) for r in regions)
        with self._lock:
            if self._closed or link_id in self._revoked:
                return
            old = self._grants.get(link_id)
            if old is not None and hmac.compare_digest(old.handle, grant_handle(capability)):
                old.set_regions(ids)
                self._bump_fast()   # the C path serves no stream of it on the old regions from now on
                return
        if old is not None:
            self.revoke(link_id)   # another capability for the same link: the old one dies first
            with self._lock:
                self._revoked.discard(link_id)
        with self._lock:
            if not self._closed and link_id not in self._revoked:
                self._install(link_id, capability, ids)

    def revoke(self, link_id: int) -> None:
        link_id = int(link_id)
        with self._lock:
            self._revoked.add(link_id)
            grant = self._grants.pop(link_id, None)
            if grant is None:
                return
            self._by_handle.pop(grant.handle, None)
            grant.alive = False
            self._bump_fast()
            self._stats["grants_revoked"] += 1
            conns = list(grant.conns)
        for conn in conns:      # idle ones see the end of stream on the loop, served ones fail in the worker
            shutdown_sock(conn.sock)
        with self._cond:
            self._regs.waiting += 1   # (counted: a request ending notifies the condition only then)
            try:
                while grant.busy:
                    self._cond.wait()
            finally:
                self._regs.waiting -= 1

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.add(_Reg(region))
            self._qver += 1
            if self._fast is not None and region.remote_accessible:
                self._fast.add(region.region_id, int(region.addr), int(region.size))
        fields = RegionFields(endpoint_id=self.endpoint_id, region_id=region.region_id, size=region.size,
                              remote_accessible=region.remote_accessible)
        return RegionDescriptor(transport="tcp", version=VERSION, payload=encode_payload(fields))

    def deregister(self, region_id: int) -> None:
        def stop_serving(_reg: _Reg) -> None:   # under the lock: requests serving it end (their streams die)
            self._qver += 1   # and the quick plans naming it are void
            for sock, regions in list(self._serving.values()):
                if region_id in regions:
                    shutdown_sock(sock)
            if self._fast is not None:
                self._fast.remove(region_id)   # the C path's too (the streams it serves it on shut down)
        # cancel the batches touching it, then drain: wait until no batch or request pins it
        self._regs.deregister(region_id, locked=stop_serving)
        if self._fast is not None:
            self._fast.drain(region_id)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "TcpChannel":
        if self._closed:
            raise Cancelled("endpoint is closed")
        fields = endpoint_fields(peer)
        try:
            ch = TcpChannel(self, fields, peer.capability)
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(f"bad tcp endpoint description: {exc!r}") from None
        sock = ch.open_stream(time.monotonic() + timeout)
        ch.release(sock)
        with self._lock:
            if self._closed:
                ch.close()
                raise Cancelled("endpoint is closed")
            self._channels.add(ch)
        return ch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._qver += 1
            channels = list(self._channels)
            conns = list(self._server_conns.items())
            for grant in self._grants.values():
                grant.alive = False
            self._grants.clear()
            self._by_handle.clear()
        shutdown_sock(self._lsock)
        lsock = self._lsock

        def forget_and_close() -> None:
            self.loop.forget(lsock)
            close_sock(lsock)
        self.loop.call_soon(forget_and_close)
        for ch in channels:
            ch.close()
        for sock, conn in conns:
            shutdown_sock(sock)
            self.loop.call_soon(conn.release)
        if self._fast is not None:
            self._fast.close()   # the streams the C path serves shut down, its pins drained
        self.loop.close()   # joins the loop and the workers (each ends its stream: shut down above)
        self._regs.close()   # what is left: cancel, then drain

    def statistics(self) -> dict:
        with self._lock:
            stats = dict(self._stats)
            if self._fast is not None:   # what the C path served (counted there)
                nbytes, ops, requests, spun, _ = self._fast.counters()
                stats["bytes_served"] += nbytes
                stats["ops_served"] += ops
                stats["requests"] += requests
                stats["requests_spun"] += spun
                stats["requests_native"] = requests
            return dict(stats, regions=len(self._regs), port=self._port, closed=self._closed,
                        native=self._fast is not None,
                        tls=self.tls is not None,
                        open_connections=len(self._server_conns), pending_connections=len(self._pending),
                        threads=self.loop.threads())

    # ------------------------------------------------------------------ shared with channels

    def begin_batch(self, ops: np.ndarray, remote: RegionTable) -> tuple[StreamBatch, Where]:
        """Validate ops and pin their local regions (deregister waits for the pin)."""
        batch = StreamBatch()
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.pin(ops, remote, batch)
            regs = self._regs
            where = Where(regs.ids, regs.addrs)   # the snapshot holds the pinned regions
        return batch, where

    def pin_prepared(self, batch: StreamBatch, version: int) -> bool:
        """Pin ``batch.regions`` for a one-call transfer (:mod:`llmdd_tcp._quick`) as :meth:`begin_batch` pins
        a batch's, when the region table is still at ``version`` (its plan's); False (nothing pinned) when it
        changed or the endpoint closed."""
        with self._lock:
            regs = self._regs
            if self._qver != version or self._closed or regs.closed:
                return False
            regs.pin_entries(batch, batch.regions)
            regs.batches.add(batch)
            return True

    def prepared_locals(self, region_ids: Sequence[int], min_size: int) -> Optional[tuple[int, dict, dict]]:
        """``(table version, {region id: writable view}, {region id: address})`` of ``region_ids`` now, read
        together under the lock, when each is registered and at least ``min_size`` bytes (a plan of
        :func:`llmdd_tcp._quick.prepare`); None otherwise or once closed."""
        views, bases = {}, {}
        with self._lock:   # the local table and its version together
            if self._closed:
                return None
            for lid in region_ids:
                entry = self._regs.get(lid)
                if entry is None or entry.region.size < min_size:
                    return None
                views[lid] = entry.view
                bases[lid] = int(entry.region.addr)
            return self._qver, views, bases

    @property
    def native(self) -> bool:
        """Whether this endpoint uses the C path (``llmdd_tcp._tcpfast``): loaded, enabled, no TLS."""
        return self._fast is not None

    def end_batch(self, batch: StreamBatch) -> None:
        with self._lock:   # (the lock of the registry's condition: a plain lock is cheaper to enter)
            self._regs.unpin_locked(batch)   # a deregistered _Reg is still counted down: its drain waits on it

    def _bump_fast(self) -> None:
        """A grant changed (under the lock): the C path serves no stream on what it knew of it any more."""
        if self._fast is not None:
            self._fast.bump()

    def forget_channel(self, ch: "TcpChannel") -> None:
        with self._lock:
            self._channels.discard(ch)

    # ------------------------------------------------------------------ server side

    def _on_accept(self, _mask: int) -> None:
        """The listening socket is readable (loop thread): admit what is ready, refuse over the caps."""
        for _ in range(64):
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    # the listening socket itself is gone: logged once, counted, never silent
                    self.loop.forget(self._lsock)
                    self._listener_dead(str(exc))
                    return
                self._accept_trouble(exc)
                return
            except Exception as exc:  # noqa: BLE001 - refuse this attempt, keep the listener
                self._accept_trouble(exc)
                return
            self._admit(sock, addr)

    def on_listener_failed(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            failed = self._stats["listener_failed"]
            if failed is None:
                self._on_listener_failed.append(callback)
        if failed is not None:
            callback(failed)

    def _listener_dead(self, error: str) -> None:
        """The data port cannot continue (its socket is broken, or its loop stopped): logged once,
        recorded in the statistics, and the owner told (:meth:`on_listener_failed`)."""
        with self._lock:
            if self._closed or self._stats["listener_failed"] is not None:
                return
            self._stats["listener_failed"] = error
            callbacks, self._on_listener_failed = self._on_listener_failed, []
        self.log.error("llmdd.transport.tcp.listener_failed", error=error)
        for cb in callbacks:
            try:
                cb(error)
            except Exception as exc:  # noqa: BLE001 - the owner's bug never hides the failure
                self.log.error("llmdd.transport.tcp.listener_failed_callback", error=repr(exc))

    def _accept_trouble(self, exc: BaseException) -> None:
        with self._lock:
            self._stats["accept_errors"] += 1
            self._stats["last_error"] = f"accept: {exc}"
        now = time.monotonic()
        if now - self._last_accept_warning > 5.0:
            self._last_accept_warning = now
            self.log.warning("llmdd.transport.tcp.accept_failed", error=repr(exc))
        # out of descriptors: the connection stays in the backlog; pause instead of spinning
        self.loop.set_events(self._lsock, 0, self._on_accept)
        self.loop.call_later(_ACCEPT_PAUSE_S, self._resume_accept)

    def _resume_accept(self) -> None:
        if not self._closed:
            self.loop.set_events(self._lsock, EVENT_READ, self._on_accept)

    def _admit(self, sock: socket.socket, addr) -> None:
        ip = addr[0]
        try:
            if self._closed:
                raise Refused("endpoint is closed")
            victim = self._pending.admit(ip, int(self.cfg[OPT_MAX_PENDING]), int(self.cfg[OPT_MAX_PENDING_PER_ADDRESS]))
            if victim is not None:
                with self._lock:
                    self._stats["evicted"] += 1
                self.mark_proven(victim)   # its slot is the newcomer's from now on
                victim.finish(None)
            sock.setblocking(False)
            tune(sock)
            if self.tls is not None:
                # the handshake runs on the loop (ServerConn.start), under the pending timer and caps
                sock = self.tls.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = ServerConn(self, sock, ip)
        except Exception as exc:  # noqa: BLE001 - over a cap, or no memory: this one is closed at once
            with self._lock:
                self._stats["refused_connections"] += 1
            self.log.debug("llmdd.transport.tcp.connection_refused", peer=ip, reason=str(exc))
            close_sock(sock)
            return
        with self._lock:
            self._server_conns[sock] = conn
            self._stats["connections"] += 1
        self._pending.add(conn)
        conn.start()

    def mark_proven(self, conn: "ServerConn") -> None:
        """``conn`` authenticated (or served its first request): it no longer counts as pending."""
        self._pending.discard(conn)
        conn.timer.cancel()

    def count_tls_failure(self, ip: str, exc: BaseException) -> None:
        """A stream's TLS handshake failed (plaintext, a certificate the CA did not sign): counted, logged."""
        with self._lock:
            self._stats["tls_failures"] += 1
            self._stats["last_error"] = f"TLS handshake failed: {exc}"
        self.log.warning("llmdd.transport.tcp.tls_refused", peer=ip, error=str(exc))

    def count_pending_expired(self, ip: str) -> None:
        """A stream did not prove a grant within the pending timeout: counted, logged."""
        with self._lock:
            self._stats["pending_expired"] += 1
        self.log.debug("llmdd.transport.tcp.pending_expired", peer=ip, seconds=self.pending_s)

    def release_conn(self, conn: "ServerConn") -> None:
        """``conn`` ended (loop thread): no longer pending, watched or kept, and its grant forgets it (the
        stream closes its socket after)."""
        self.mark_proven(conn) if conn in self._pending else conn.timer.cancel()
        self.loop.forget(conn.sock)
        with self._lock:
            self._server_conns.pop(conn.sock, None)
            if conn.grant is not None:
                conn.grant.conns.discard(conn)

    def open_grant(self, conn: "ServerConn", nonce_c: bytes, handle: bytes, mac_c: bytes) -> Union[Grant, None]:
        """The live grant an OPEN proves it holds, bound to ``conn``; ``None`` (counted, logged) if none."""
        with self._lock:
            grant = self._by_handle.get(handle)
            if grant is not None and grant.alive and not self._closed:
                if hmac.compare_digest(mac_c, mac(grant.key, b"c", self.endpoint_id, conn.nonce_s, nonce_c)):
                    grant.conns.add(conn)
                    conn.grant = grant
                    return grant
                key, what = "auth_failures", "authentication failed"
            else:
                key, what = "capability_refused", "no live link grant for the presented capability"
            self._stats[key] += 1
            self._stats["refused"] += 1
            self._stats["last_error"] = what
        self.log.warning("llmdd.transport.tcp.open_refused", peer=conn.ip, reason=what)
        return None

    def serve_ready(self, conn: "ServerConn") -> None:
        """A worker serves ``conn`` while requests keep coming, then hands it back to the loop.  On a plain
        stream with the C path, it serves the small requests (:meth:`_serve_native`) and gives this loop
        the others, read as far as it read them."""
        sock = conn.sock
        fast = self._fast if conn.tls is None else None
        try:
            sock.setblocking(True)
            set_timeouts(sock, float(self.cfg[OPT_SERVER_SEND_TIMEOUT]))
            flags = waitall(sock)
            spinner = conn.spinner
            wait_next = False   # (the C path) wait for the next request first (not at first: the loop saw one)
            while True:
                got: Any = _PYTHON
                if fast is not None:
                    got = self._serve_native(conn, fast, wait_next)
                    if got is _IDLE:
                        break
                    if got is _ENDED:
                        return
                wait_next = True
                if isinstance(got, tuple):   # read in full by the C path, not served there
                    kind, rflags, ops, total = got
                else:
                    # over TLS the loop took the request's first byte (no MSG_PEEK there): it starts the
                    # header; the C path may have read the whole header
                    head, conn.head = (got if isinstance(got, bytes) else conn.head), b""
                    try:
                        kind, rflags, ops, total = read_request(sock, head, flags, 0 if conn.tls else self._few_ops)
                    except PeerGone:
                        conn.finish(None)
                        return
                grant = conn.grant
                if grant is None:   # a stream is served only after its OPEN proved a grant
                    raise Refused("request on a stream that proved no grant")
                self._serve_request(sock, kind, ops, total, grant, rflags)
                if self._closed:
                    raise Cancelled("endpoint is closed")
                if fast is not None:
                    continue   # the C path waits for the next request (spin, then the linger)
                if spinner.wait(sock, self._linger):
                    with self._lock:
                        self._stats["requests_spun"] += 1   # the next request came while this thread polled
                elif not wait_readable(sock, self._linger):
                    break
        except Exception as exc:  # noqa: BLE001 - a broken client must never break the endpoint
            err = map_exc(exc)
            if not self._closed:
                with self._lock:
                    self._stats["last_error"] = str(err)
                self.log.info("llmdd.transport.tcp.conn_closed", error=str(err))
            conn.finish(err)
            return
        try:
            sock.setblocking(False)
        except OSError as exc:
            conn.finish(map_exc(exc))
            return
        self.loop.call_soon(conn.watch)

    def _serve_native(self, conn: "ServerConn", fast: Any, wait_next: bool) -> Any:
        """Serve ``conn``'s small requests in C (``Table.serve``, the GIL released) for the stream's live
        grant, as seen now (any change of the regions or grants since makes the C path hand the next
        request back).  Returns :data:`_IDLE`, :data:`_ENDED` (finished here), :data:`_PYTHON` (no live
        grant: the Python path reads and answers the next request), a request header (``bytes``: Python
        reads on from it) or a request read in full (``(kind, flags, ops, total)``: Python serves or
        refuses it); raises what ended the stream in the middle of a request."""
        with self._lock:
            grant = conn.grant
            if grant is None or not grant.alive or self._closed:
                return _PYTHON
            epoch = fast.epoch()   # every change of a grant bumps it under this lock
            grant.busy += 1        # (revoke waits for it; it shuts the stream down first)
        spinner = conn.spinner
        try:
            res, value, spinner.skip, spinner.penalty, hits, misses = fast.serve(
                conn.sock.fileno(), grant.sorted_ids, epoch, wait_next, int(spinner.seconds * 1e9), spinner.skip,
                spinner.penalty, SPIN_SKIP_MAX, int(self._linger * 1e9))
        finally:
            with self._cond:
                grant.busy -= 1
                if self._regs.waiting:   # a revocation waiting for the grant's busy count
                    self._cond.notify_all()
        spinner.hits += hits
        spinner.misses += misses
        if res == native.S_IDLE:
            return _IDLE
        if res == native.S_EOF:
            conn.finish(None)
            return _ENDED
        if res in (native.S_HEADER, native.S_REQUEST):
            return value
        errno_, writing = value
        if writing is not None:
            self.log.warning("llmdd.transport.tcp.partial_write", regions=sorted(writing), bytes=None)
        if res == native.S_GONE:
            raise PeerGone("peer closed the stream in the middle of a request")
        if res == native.S_TIMEOUT:
            raise TransportTimeout("the stream's peer neither sent nor took bytes within the send timeout")
        raise OSError(errno_, os.strerror(errno_))

    def admit_few(self, token: int, sock: socket.socket, grant: Grant, regions: tuple, offsets: tuple, lengths: tuple,
                  total: int) -> Union[str, tuple[Batch, list]]:
        """The few-ops path's check and pins (:func:`llmdd_tcp._few.serve_few`), under the lock: the reason
        when refused (counted), else ``(pins, views of the ops' bytes)``, the request recorded as serving on
        ``sock`` (a deregistration cuts it) and its grant busy until :meth:`end_request`."""
        with self._lock:
            if not grant.alive:
                raise PeerGone("the link of this stream ended (its capability was revoked)")
            refused = refusal(self._regs.served, grant, regions, offsets, lengths, total)
            if refused is not None:
                self._stats["refused"] += 1
                self._stats["last_error"] = refused
                return refused
            ids = frozenset(regions)
            served = Batch(ids)   # the request's pins: a deregistration drains them
            self._regs.pin_entries(served, ids)
            grant.busy += 1
            entries = self._regs.entries
            views = [entries[r].view[o:o + n] for r, o, n in zip(regions, offsets, lengths)]
            self._serving[token] = (sock, ids)
        return served, views

    def _serve_request(self, sock: socket.socket, kind: int, wire: Union[np.ndarray, tuple], total: int,
                       grant: Grant, flags: int = 0) -> None:
        """Check, then serve, one request's ops: a few (a flat tuple of (region, offset, length) triples) in
        plain Python (:func:`llmdd_tcp._few.serve_few`, the same decisions), more as numpy rows."""
        if isinstance(wire, tuple):
            serve_few(self, sock, kind, wire, total, grant, flags)
            return
        token = id(wire)
        with self._lock:
            if not grant.alive:
                raise PeerGone("the link of this stream ended (its capability was revoked)")
            try:
                self._regs.served.check(wire["region"], wire["offset"], wire["length"], "remote")
                grant.check(wire["region"])
                if int(wire["length"].sum(dtype=np.uint64)) != total:
                    raise Corrupt("announced payload does not match the op lengths")
            except Refused as exc:
                reason = str(exc)
                self._stats["refused"] += 1
                self._stats["last_error"] = reason
                refused: Optional[str] = reason
            else:
                refused = None
                # a few ops: their ids as ints (cheaper than numpy's fixed cost); more: the distinct ids only
                regions = wire["region"].tolist() if len(wire) <= 8 else np.unique(wire["region"]).tolist()
                ids = frozenset(regions)
                served = Batch(ids)   # the request's pins: a deregistration drains them
                self._regs.pin_entries(served, ids)
                grant.busy += 1
                where = Where(self._regs.ids, self._regs.addrs)
                self._serving[token] = (sock, ids)
        if refused is not None:
            self.log.warning("llmdd.transport.tcp.refused", kind="read" if kind == READ else "write",
                              reason=refused)
            send_rsp(sock, ST_REFUSED, refused, flags & F_PAD)
            if kind != READ and flags & F_EAGER:   # its payload follows: dropped (the stream stays in step)
                discard_payload(sock, total, self.eager_max, refused)
            return
        released = False
        try:
            if kind == READ:
                # the OK header and the first window of bytes leave in one sendmsg; the last bytes leave
                # from a copy, after the request let go of its regions (cut_tail says why)
                head = OK_HEAD_PADDED if flags & F_PAD else OK_HEAD
                reg, off, ln, tail = cut_tail(where, wire["region"], wire["offset"], wire["length"])
                if len(tail) == total:   # all of it in the copy: the header and the bytes in one sendmsg
                    last = [head[0].raw, tail]
                else:
                    move(sock, where, reg, off, ln, None, send=True, head=head, total=total - len(tail))
                    last = [tail]
                self.end_request(token, grant, served, total, len(wire))
                released = True
                sendmsg_all(sock, last)
            else:
                if not flags & F_EAGER:   # an eager write's payload follows its request: no "go"
                    send_rsp(sock, ST_OK, "", flags & F_PAD)
                try:
                    move(sock, where, wire["region"], wire["offset"], wire["length"], None, send=False, total=total)
                except Exception:
                    self.log.warning("llmdd.transport.tcp.partial_write", regions=sorted(ids), bytes=total)
                    raise
                self.end_request(token, grant, served, total, len(wire))   # before the answer (as a read's tail)
                released = True
                send_rsp(sock, ST_OK, "", flags & F_PAD)
        finally:
            if not released:
                self.end_request(token, grant, served)

    def end_request(self, token: int, grant: Grant, served: Batch, nbytes: int = 0, nops: int = -1) -> None:
        """A request lets go of its regions: out of the streams a deregistration cuts, its pins and its
        grant's busy count given back (``unpin_locked`` notifies the waiters of ``_cond``: a deregistration
        draining, a revocation waiting on ``grant.busy``), and, when it moved its bytes (``nops`` >= 0),
        counted as served.  Before the answer's last byte leaves: a client holding its answer never sees
        its stream cut for a region it is done with, and the owner's statistics already count it."""
        with self._cond:
            if nops >= 0:
                stats = self._stats
                stats["bytes_served"] += nbytes
                stats["ops_served"] += nops
                stats["requests"] += 1
            self._serving.pop(token, None)
            grant.busy -= 1
            self._regs.unpin_locked(served)
