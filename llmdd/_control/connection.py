"""A control connection: one socket carrying the sans-io protocol's frames, driven by the I/O loop."""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Any, Callable, Optional

from llmdd._runtime.runtime import EVENT_READ, EVENT_WRITE, Runtime
from llmdd._base.log import get_logger
from llmdd._protocol import messages as m
from llmdd._protocol.codec import NEED_DATA, PEER_CLOSED, Connection, ProtocolError

__all__ = ["ControlConnection", "TlsFailed"]

_log = get_logger("llmdd.link")


class TlsFailed(ProtocolError):
    """The TLS handshake of an accepted connection failed."""


class ControlConnection:
    """A socket carrying protocol frames, driven by the engine's I/O loop.

    Before :meth:`attach` (the client side of a handshake, in the caller's thread) the socket is
    blocking and :meth:`recv_message` reads synchronously.  From :meth:`attach` on the socket is
    non-blocking and owned by the loop: the loop reads whatever arrives, feeds the sans-io codec
    and hands each message to ``on_message`` (on the loop thread); ``send`` from any thread
    writes what the socket takes at once and leaves the rest to the loop.  No thread waits on an
    idle connection.

    ``_lock`` is a leaf lock: it guards the outbound buffer and the codec's encoder and is held
    only around non-blocking socket calls (for TLS also around reads: one SSL object must not be
    driven by two threads at once).
    """

    MAX_OUTBOUND = 64 * 1024 * 1024   # a peer that reads nothing while this much waits is dropped
    RECV_SIZE = 256 * 1024

    def __init__(self, loop: Runtime, sock: socket.socket, *, name: str, tls_handshake: bool = False) -> None:
        self.loop = loop
        self.sock = sock
        self.codec = Connection()
        self.name = name
        self._lock = threading.Lock()
        self._out = bytearray()
        self._closed = False
        self._attached = False
        self._tls_sock: Optional[ssl.SSLSocket] = sock if isinstance(sock, ssl.SSLSocket) else None
        self._tls = self._tls_sock is not None
        if tls_handshake and self._tls_sock is None:
            raise ValueError(f"{name}: a TLS handshake needs an ssl.SSLSocket, got {type(sock).__name__}")
        self._tls_handshake = tls_handshake
        self._events = 0
        self._on_message: Optional[Callable[[Any], None]] = None
        self._on_closed: Optional[Callable[[BaseException | None], None]] = None
        self.stalled_since: Optional[float] = None   # when the outbound buffer last became non-empty

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ blocking phase (client handshake)
    def recv_message(self, deadline: float) -> Any:
        """Block until one message (client handshake, before :meth:`attach`)."""
        while True:
            msg = self.codec.next_message()
            if msg is not NEED_DATA:
                return msg
            left = deadline - self.loop.monotonic()
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

    # ------------------------------------------------------------------ sending (any thread)
    def send(self, msg: m.Message, *, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                raise ProtocolError("control connection is closed")
            data = self.codec.send(msg)
            if not self._attached:
                try:
                    self.sock.settimeout(timeout)
                    self.sock.sendall(data)
                except (OSError, ValueError) as exc:
                    raise ProtocolError(f"control send failed: {exc}") from None
                return
            if self._out or self._tls_handshake:
                self._out += data
                over = len(self._out) > self.MAX_OUTBOUND
            else:
                try:
                    n = self.sock.send(data)
                except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    n = 0
                except (OSError, ValueError) as exc:
                    raise ProtocolError(f"control send failed: {exc}") from None
                if n >= len(data):
                    return
                self._out += memoryview(data)[n:]
                self.stalled_since = self.loop.monotonic()
                over = False
        if over:
            self.close()
            raise ProtocolError(f"the peer reads nothing: over {self.MAX_OUTBOUND} bytes wait to be sent")
        self.loop.call_soon(self._update_events)

    # ------------------------------------------------------------------ loop side
    def attach(self, on_message: Optional[Callable[[Any], None]],
               on_closed: Callable[[BaseException | None], None]) -> None:
        """Hand the connection to the loop (from any thread); ``on_message=None`` buffers without
        dispatching until :meth:`resume`."""
        with self._lock:
            self._on_message = on_message
            self._on_closed = on_closed
            if not self._attached:
                self.sock.setblocking(False)
                self._attached = True
        self.loop.call_soon(self._start)

    def pause(self) -> None:
        """Stop dispatching (bytes keep being read into the codec); only from the loop thread."""
        self._on_message = None

    def resume(self, on_message: Callable[[Any], None]) -> None:
        self._on_message = on_message
        self.loop.call_soon(self._start)

    def _start(self) -> None:
        if self._closed:
            return
        self._update_events()
        self._process()
        if self._tls_sock is not None and not self._tls_handshake and self._tls_sock.pending():
            self._on_ready(EVENT_READ)

    def _update_events(self) -> None:
        if self._closed:
            return
        events = EVENT_READ | (EVENT_WRITE if self._out else 0)
        if events != self._events:
            self._events = events
            self.loop.set_events(self.sock, events, self._on_ready)

    def _on_ready(self, mask: int) -> None:
        if self._closed:
            return
        if self._tls_handshake:
            self._drive_tls()
            return
        if mask & EVENT_WRITE:
            self._flush()
        if mask & EVENT_READ:
            self._read()

    def _drive_tls(self) -> None:
        tls = self._tls_sock
        if tls is None:   # __init__ refuses tls_handshake on a plain socket
            raise RuntimeError(f"{self.name}: TLS handshake pending on a plain socket")
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            self._set(EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._set(EVENT_WRITE)
            return
        except (OSError, ValueError) as exc:
            self._lost(TlsFailed(f"TLS handshake failed: {exc}"))
            return
        self._tls_handshake = False
        self._events = 0
        self._update_events()
        if self._out:
            self._flush()
        self._read()

    def _set(self, events: int) -> None:
        self._events = events
        self.loop.set_events(self.sock, events, self._on_ready)

    def _flush(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                while self._out:
                    n = self.sock.send(self._out[:1 << 20])
                    if n <= 0:
                        break
                    del self._out[:n]
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass
            except (OSError, ValueError) as exc:
                err: Optional[BaseException] = ProtocolError(f"control send failed: {exc}")
            else:
                err = None
            if not self._out:
                self.stalled_since = None
        if err is not None:
            self._lost(err)
            return
        self._update_events()

    def _read(self) -> None:
        for _ in range(16):   # bounded work per wake-up: other connections get their turn
            try:
                if self._tls:
                    with self._lock:
                        data = self.sock.recv(self.RECV_SIZE)
                else:
                    data = self.sock.recv(self.RECV_SIZE)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except (OSError, ValueError) as exc:
                self._lost(ProtocolError(f"control receive failed: {exc}"))
                return
            try:
                self.codec.receive_data(data)
            except ProtocolError as exc:
                self._lost(exc)
                return
            if not data:
                break
            if len(data) < self.RECV_SIZE and not (self._tls_sock is not None and self._tls_sock.pending()):
                break
        self._process()

    def _process(self) -> None:
        while not self._closed:
            handler = self._on_message
            if handler is None:
                return
            try:
                msg = self.codec.next_message()
            except ProtocolError as exc:
                self._lost(exc)
                return
            if msg is NEED_DATA:
                return
            if msg is PEER_CLOSED:
                self._lost(None)
                return
            try:
                handler(msg)
            except (OSError, ProtocolError, ValueError) as exc:
                self._lost(exc)
                return
            except Exception as exc:  # a handler bug must not kill the link silently
                _log.error("llmdd.link.reader_failed", conn=self.name, error=repr(exc))
                self._lost(exc)
                return

    def _lost(self, error: BaseException | None) -> None:
        if self._closed:
            return
        callback = self._on_closed
        self.close()
        if callback is not None:
            callback(error)

    def close(self) -> None:
        """Close now (any thread): the peer sees the shutdown at once; the loop forgets the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._out = bytearray()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass
        self.loop.call_soon(self._release)

    def _release(self) -> None:
        self.loop.forget(self.sock)
        try:
            self.sock.close()
        except OSError:
            pass
