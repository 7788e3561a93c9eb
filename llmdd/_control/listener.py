"""Listening sockets on the I/O loop: accept what is ready, admit it or refuse it at once.

A listener's state is its machine's (``Machine.LISTENER``): LISTENING until it fails for good
or closes.  Transient accept() errors (out of descriptors, a reset) refuse one connection or
pause the listener a moment; they never end it.  :class:`Listeners` holds one engine's listening
sockets (the control port, the comm groups' ports) and the record of those that failed (a
transport endpoint's data port included); what a listener accepts goes to its ``admit`` callable
(the server's admission, :mod:`llmdd._control.admission`).
"""

from __future__ import annotations

import errno
import socket
from typing import Callable, Optional

from llmdd._runtime.runtime import EVENT_READ, PoolFull, Runtime
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import LISTENER_OPEN
from llmdd._base.log import get_logger
from llmdd._protocol import messages as m
from llmdd._protocol.codec import Connection
from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["Listener", "Listeners", "FailedListener", "ACCEPT_PAUSE_S", "close_quietly", "refuse_busy"]

_log = get_logger("llmdd.link")

S = LLMStatusCode


#: accept() errors that refuse one connection (or pause the listener a moment) but never end it
_ACCEPT_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                               errno.EPROTO, errno.EPERM, errno.EINTR, errno.ETIMEDOUT, errno.EAGAIN,
                               errno.ENETDOWN, errno.ENOPROTOOPT, errno.EHOSTDOWN, errno.ENONET,
                               errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH, errno.ECONNRESET})
ACCEPT_PAUSE_S = 0.1   # out of descriptors or memory: accept nothing for this long, then go on


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class Listener:
    """A listening socket on the loop: accepts what is ready, admits it or refuses it at once."""

    def __init__(self, owner: "Listeners", sock: socket.socket, *, comm_id: Optional[int], kind: str) -> None:
        self.owner = owner
        self.sock = sock
        self.comm_id = comm_id
        self.kind = kind
        self.address = sock.getsockname()[:2]
        self.fsm = owner.lifecycle.create(f"{kind}@{self.address[0]}:{self.address[1]}", kind=kind)
        self.error: Optional[str] = None
        self.accepted = 0
        self.refused = 0
        self.accept_errors = 0
        self._last_warning = 0.0
        sock.setblocking(False)
        owner.loop.set_events(sock, EVENT_READ, self._on_ready)

    def _on_ready(self, _mask: int) -> None:
        for _ in range(64):
            if not self.fsm.in_(LISTENER_OPEN):
                return
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_TRANSIENT:
                    self._transient(exc)
                    return
                self.owner.failed(self, exc)
                return
            except Exception as exc:  # noqa: BLE001 - anything else refuses this attempt, not the listener
                self._transient(exc)
                return
            self.accepted += 1
            self.owner.admit(self, conn, addr)

    def _transient(self, exc: BaseException) -> None:
        self.accept_errors += 1
        now = self.owner.loop.monotonic()
        if now - self._last_warning > 5.0:   # at most one line per 5 s however hard the host is pressed
            self._last_warning = now
            _log.warning("llmdd.link.accept_failed", listener=self.kind, address=f"{self.address[0]}:{self.address[1]}",
                         error=repr(exc), errors=self.accept_errors)
        # a full descriptor table leaves the connection in the backlog: pause instead of spinning
        self.owner.loop.set_events(self.sock, 0, self._on_ready)
        self.owner.loop.call_later(ACCEPT_PAUSE_S, self._resume)

    def _resume(self) -> None:
        if self.fsm.in_(LISTENER_OPEN):
            self.owner.loop.set_events(self.sock, EVENT_READ, self._on_ready)

    def close(self) -> None:
        self.fsm.offer("close")   # a failed listener closes its socket too and stays FAILED
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass
        sock = self.sock

        def release() -> None:
            self.owner.loop.forget(sock)
            try:
                sock.close()
            except OSError:
                pass

        self.owner.loop.call_soon(release)

    def describe(self) -> dict:
        return {"kind": self.kind, "address": f"{self.address[0]}:{self.address[1]}", "state": self.fsm.name,
                "error": self.error, "accepted": self.accepted, "refused": self.refused,
                "accept_errors": self.accept_errors, "comm_id": self.comm_id}


class FailedListener:
    """A transport endpoint's data port that could not continue (recorded for statistics and doctor)."""

    def __init__(self, fsm: Tracked, kind: str, address: tuple, error: str) -> None:
        self.kind = kind
        self.address = address
        self.error = error
        self.fsm = fsm
        fsm.fire("fail", error=RuntimeError(error), reason=error)

    def describe(self) -> dict:
        return {"kind": self.kind, "address": f"{self.address[0]}:{self.address[1]}", "state": self.fsm.name,
                "error": self.error, "accepted": 0, "refused": 0, "accept_errors": 0, "comm_id": None}


class Listeners:
    """One engine's listening sockets: the control port, the comm groups' ports, and the record of
    every listener (or endpoint data port) that failed.

    A listener that cannot continue is logged once, recorded and closed, and the engine's lifecycle
    hears of it (``listener_failed``).  ``admit`` gets each accepted connection (loop thread).
    """

    def __init__(self, *, loop: Runtime, lifecycle: Lifecycle, engine: Optional[Tracked],
                 admit: Callable[[Listener, socket.socket, object], None]) -> None:
        self.loop = loop
        self.lifecycle = lifecycle      # the engine's listening sockets' machines
        self._engine = engine   # the engine's lifecycle: a listener that cannot continue is recorded there
        self.admit = admit
        self._listener: Optional[Listener] = None
        self._listen_addr: Optional[tuple[str, int]] = None
        self._group_listeners: dict[socket.socket, Listener] = {}
        self._failed_listeners: list = []          # Listener or FailedListener (a data port)

    def listen(self, host: str, port: int) -> tuple[str, int]:
        if self._listener is not None:
            self.stop_listening()
        sock = self._bind(host, port, backlog=128, status=S.LLM_PARAM_INVALID)
        self._listener = Listener(self, sock, comm_id=None, kind="control")
        self._listen_addr = self._listener.address
        _log.info("llmdd.link.listening", host=self._listen_addr[0], port=self._listen_addr[1])
        return self._listen_addr

    def _bind(self, host: str, port: int, *, backlog: int, status: LLMStatusCode) -> socket.socket:
        try:
            return self.loop.create_server((host, port), backlog)
        except OSError as exc:
            raise LLMException(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                               status_code=status) from None

    @property
    def control(self) -> Optional[Listener]:
        """The control port's listener (None when not listening)."""
        return self._listener

    @property
    def listen_address(self) -> Optional[tuple[str, int]]:
        return self._listen_addr

    def stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        self._listen_addr = None
        if listener is not None:
            listener.close()

    def failed(self, listener: Listener, exc: BaseException) -> None:
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

    def fail_all(self, exc: BaseException) -> None:
        """The I/O loop cannot continue (on its dying thread): every listener fails."""
        for listener in [self._listener, *self._group_listeners.values()]:
            if listener is not None:
                self.failed(listener, exc)

    def data_port_failed(self, name: str, address: tuple, error: str) -> None:
        """Transport ``name``'s data port at ``address`` cannot continue: recorded as a failed listener."""
        kind = f"{name}-data"
        record = FailedListener(self.lifecycle.create(f"{kind}@{address[0]}:{address[1]}", kind=kind),
                                kind, address, error)
        self._failed_listeners.append(record)
        self._fire_listener_failed(record.kind, record.address, error)

    def _record_listener_failure(self, listener: Listener) -> None:
        self._fire_listener_failed(listener.kind, listener.address, listener.error or "")

    def _fire_listener_failed(self, kind: str, address: tuple, error: str) -> None:
        fsm = self._engine
        if fsm is not None:
            fsm.offer("listener_failed", error=RuntimeError(error), listener=kind,
                      address=f"{address[0]}:{address[1]}", reason=error)

    def status(self) -> list[dict]:
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

    def close(self) -> None:
        """Stop listening on every port (finalize)."""
        self.stop_listening()
        for sock in list(self._group_listeners):
            self.close_group_listener(sock)


_BUSY_FRAME: Optional[bytes] = None


def _busy_frame() -> bytes:
    """The one frame a plain-TCP connection over a cap gets before it is closed (encoded once)."""
    global _BUSY_FRAME
    if _BUSY_FRAME is None:
        _BUSY_FRAME = Connection().send(m.Refuse(
            status_code=S.LLM_LINK_BUSY.value,
            reason="too many connections are in their handshake here; retry"))
    return _BUSY_FRAME


def refuse_busy(sock: socket.socket, tls: bool) -> None:
    """Close a connection over a cap at once; a plain one first gets the constant busy frame so a
    legitimate client knows to retry (one non-blocking send, nothing read)."""
    if not tls:
        try:
            sock.setblocking(False)
            sock.send(_busy_frame())
            sock.recv(65536)   # what the client already sent: closing over unread bytes would reset
        except (OSError, ValueError):
            pass
    close_quietly(sock)
