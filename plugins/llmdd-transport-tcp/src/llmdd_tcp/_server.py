"""One accepted data-port stream (:class:`ServerConn`): the TLS handshake and the HELLO / OPEN exchange on
the endpoint's I/O loop without blocking, the pending timer, idle watching on the loop, and the hand-over
to a worker (:meth:`TcpEndpoint.serve_ready`) when a request comes; and the streams accepted that did not
prove a grant yet (:class:`PendingStreams`: their caps and who makes room)."""

from __future__ import annotations

import os
import socket
import ssl
from typing import Optional, Protocol, Union

from llmdd.lowlevel import EVENT_READ, EVENT_WRITE, IoLoop, PeerGone, PoolFull, Refused, TransportError

from ._grants import Grant, mac
from ._sock import Spinner, close_sock, is_tls, map_exc, shutdown_sock
from ._wire import AUTH_RSP, HELLO, M_HELLO, OPEN, FEAT_QUICK, VERSION

class ServerOwner(Protocol):
    """What a stream uses of the endpoint that accepted it (:class:`~llmdd_tcp._endpoint.TcpEndpoint`): its
    id, link secret and I/O loop, the pending and spin times, the grant an OPEN proves
    (``open_grant``), the counts of what failed, and the stream's hand-over (``mark_proven``,
    ``serve_ready``, ``release_conn``)."""

    @property
    def endpoint_id(self) -> bytes: ...

    @property
    def secret(self) -> Union[bytes, None]: ...

    @property
    def loop(self) -> IoLoop: ...

    @property
    def pending_s(self) -> float: ...

    @property
    def spin_s(self) -> float: ...

    def open_grant(self, conn: ServerConn, nonce_c: bytes, handle: bytes, mac_c: bytes) -> Union[Grant, None]: ...

    def mark_proven(self, conn: ServerConn) -> None: ...

    def serve_ready(self, conn: ServerConn) -> None: ...

    def release_conn(self, conn: ServerConn) -> None: ...

    def count_tls_failure(self, ip: str, exc: BaseException) -> None: ...

    def count_pending_expired(self, ip: str) -> None: ...


class ServerConn:
    """One accepted data stream: (TLS handshake,) HELLO/AUTH on the loop, then idle on the loop or
    served by a worker."""

    __slots__ = ("ep", "sock", "ip", "nonce_s", "buf", "proven", "timer", "closed", "grant", "tls", "head", "spinner")

    def __init__(self, ep: ServerOwner, sock: socket.socket, ip: str) -> None:
        self.ep = ep
        self.sock = sock
        self.ip = ip
        self.nonce_s = os.urandom(16)
        self.buf = bytearray()
        self.proven = False
        self.closed = False
        self.grant: Union[Grant, None] = None
        self.tls: Optional[ssl.SSLSocket] = sock if is_tls(sock) else None   # sock, when it is a TLS socket
        self.head = b""          # TLS: the first byte of a request, taken by the loop to see it come
        self.spinner = Spinner(ep.spin_s)   # the serving thread's wait for this stream's next request
        self.timer = ep.loop.call_later(ep.pending_s, self.expire)

    def start(self) -> None:
        if self.tls is not None:
            self.handshake(0)
        else:
            self.hello()

    def handshake(self, _mask: int) -> None:
        """Drive the server side of the TLS handshake without blocking (loop thread)."""
        if self.tls is None:   # started only for a TLS stream (see start)
            raise TypeError("TLS handshake on a plain TCP stream")
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self.ep.loop.set_events(self.sock, EVENT_READ, self.handshake)
            return
        except ssl.SSLWantWriteError:
            self.ep.loop.set_events(self.sock, EVENT_WRITE, self.handshake)
            return
        except (OSError, ValueError) as exc:
            # plaintext, a certificate our CA did not sign, no certificate: counted, logged, closed
            self.ep.count_tls_failure(self.ip, exc)
            self.finish(None)
            return
        self.hello()

    def hello(self) -> None:
        hello = HELLO.pack(M_HELLO, VERSION, int(self.ep.secret is not None), FEAT_QUICK, self.ep.endpoint_id,
                            self.nonce_s)
        try:
            if self.sock.send(hello) != len(hello):   # 40 bytes into a fresh socket: all or broken
                raise PeerGone("short HELLO")
        except OSError as exc:
            self.finish(map_exc(exc))
            return
        self.watch()

    def watch(self) -> None:
        """Idle: the loop waits for the next bytes (no thread)."""
        if self.closed:
            self.release()
            return
        handler = self.on_request if self.proven else self.on_open
        self.ep.loop.set_events(self.sock, EVENT_READ, handler)
        if self.tls is not None and self.tls.pending():
            self.ep.loop.call_soon(handler, EVENT_READ)   # bytes already decrypted: no readiness would come

    def on_open(self, _mask: int) -> None:
        while True:
            try:
                data = self.sock.recv(OPEN.size - len(self.buf))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError as exc:
                self.finish(map_exc(exc))
                return
            if not data:
                self.finish(None)
                return
            self.buf += data
            if len(self.buf) >= OPEN.size:
                break
            if not (self.tls is not None and self.tls.pending()):
                return   # the rest comes with a later readiness (bytes buffered in TLS would not signal one)
        nonce_c, handle, mac_c = OPEN.unpack(bytes(self.buf))
        self.buf = bytearray()
        ep = self.ep
        try:
            grant = ep.open_grant(self, nonce_c, handle, mac_c)
            if grant is None:
                self.sock.send(AUTH_RSP.pack(1, bytes(32)))
                self.finish(None)
                return
            rsp = AUTH_RSP.pack(0, mac(grant.key, b"s", ep.endpoint_id, nonce_c, self.nonce_s))
            if self.sock.send(rsp) != len(rsp):
                raise PeerGone("short AUTH response")
        except OSError as exc:
            self.finish(map_exc(exc))
            return
        self.proven = True
        ep.mark_proven(self)
        self.watch()

    def on_request(self, _mask: int) -> None:
        """Bytes wait on an idle stream: a worker takes it over (an end of stream is handled here)."""
        try:
            if self.tls is not None:
                # TLS has no MSG_PEEK, and a readable descriptor may hold a part of a record only: take
                # the first byte of the request (the worker reads the header on from it), or wait
                peek = self.head = self.sock.recv(1)
            else:
                peek = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError as exc:
            self.finish(map_exc(exc))
            return
        if not peek:
            self.finish(None)
            return
        self.ep.loop.forget(self.sock)
        try:
            self.ep.loop.pool.submit(self.ep.serve_ready, self)
        except PoolFull as exc:
            self.finish(PeerGone(f"no worker to serve the stream: {exc}"))

    def expire(self) -> None:
        if self.proven or self.closed:
            return
        self.ep.count_pending_expired(self.ip)
        shutdown_sock(self.sock)
        self.finish(None)

    def finish(self, err: Union[TransportError, None]) -> None:
        """Close the stream (any thread); the loop forgets and closes the descriptor."""
        if self.closed:
            return
        self.closed = True
        shutdown_sock(self.sock)
        self.ep.loop.call_soon(self.release)

    def release(self) -> None:
        self.ep.release_conn(self)
        close_sock(self.sock)


class PendingStreams:
    """The accepted streams that did not prove a grant yet, oldest first, and how many each address holds
    (the endpoint's I/O loop thread only: no lock).  :meth:`admit` applies the caps to a newcomer."""

    __slots__ = ("_conns", "_by_ip")

    def __init__(self) -> None:
        self._conns: dict[ServerConn, None] = {}   # insertion order: the oldest first
        self._by_ip: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._conns)

    def __contains__(self, conn: ServerConn) -> bool:
        return conn in self._conns

    def admit(self, ip: str, max_total: int, max_per_address: int) -> Optional[ServerConn]:
        """Room for one more stream from ``ip``: None when there is room, else the stream that makes room
        (the oldest pending stream of the address holding the most, when ``ip`` holds fewer: as on the
        control port, a flood from some addresses never locks another address's links out of the data
        port; the caller drops it).  Raises :class:`Refused` when ``ip`` is at its cap, or every slot is
        taken and no other address holds more."""
        count = self._by_ip.get(ip, 0)
        if count >= max_per_address:
            raise Refused(f"{ip} has too many connections that did not prove themselves yet")
        if len(self._conns) < max_total:
            return None
        busiest = None
        for addr, n in self._by_ip.items():
            if n > count:
                busiest, count = addr, n
        if busiest is not None:
            for conn in self._conns:
                if conn.ip == busiest:
                    return conn
        raise Refused("too many connections that did not prove themselves yet")

    def add(self, conn: ServerConn) -> None:
        self._conns[conn] = None
        self._by_ip[conn.ip] = self._by_ip.get(conn.ip, 0) + 1

    def discard(self, conn: ServerConn) -> None:
        """``conn`` proved itself (or ended): it no longer counts."""
        if self._conns.pop(conn, 0) is None:
            n = self._by_ip.get(conn.ip, 1) - 1
            if n > 0:
                self._by_ip[conn.ip] = n
            else:
                self._by_ip.pop(conn.ip, None)
