"""Listening sockets on the I/O loop: accept what is ready, admit it or refuse it at once.

A listener's state is its machine's (``Machine.LISTENER``): LISTENING until it fails for good
or closes.  Transient accept() errors (out of descriptors, a reset) refuse one connection or
pause the listener a moment; they never end it.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import TYPE_CHECKING, Optional

from llmdd._control.ioloop import EVENT_READ
from llmdd._lifecycle.machines import Tracked
from llmdd._lifecycle.tables import LISTENER_OPEN
from llmdd._base.log import get_logger
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.codec import Connection
from llmdd._base.status import LLMStatusCode

if TYPE_CHECKING:
    from llmdd._control.manager import LinkManager

__all__ = ["Listener", "FailedListener", "ACCEPT_PAUSE_S", "close_quietly", "refuse_busy"]

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

    def __init__(self, lm: "LinkManager", sock: socket.socket, *, comm_id: Optional[int], kind: str) -> None:
        self.lm = lm
        self.sock = sock
        self.comm_id = comm_id
        self.kind = kind
        self.address = sock.getsockname()[:2]
        self.fsm = lm._listeners.create(f"{kind}@{self.address[0]}:{self.address[1]}", kind=kind)
        self.error: Optional[str] = None
        self.accepted = 0
        self.refused = 0
        self.accept_errors = 0
        self._last_warning = 0.0
        sock.setblocking(False)
        lm.loop.set_events(sock, EVENT_READ, self._on_ready)

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
                self.lm._listener_failed(self, exc)
                return
            except Exception as exc:  # noqa: BLE001 - anything else refuses this attempt, not the listener
                self._transient(exc)
                return
            self.accepted += 1
            self.lm._admit(self, conn, addr)

    def _transient(self, exc: BaseException) -> None:
        self.accept_errors += 1
        now = time.monotonic()
        if now - self._last_warning > 5.0:   # at most one line per 5 s however hard the host is pressed
            self._last_warning = now
            _log.warning("llmdd.link.accept_failed", listener=self.kind, address=f"{self.address[0]}:{self.address[1]}",
                         error=repr(exc), errors=self.accept_errors)
        # a full descriptor table leaves the connection in the backlog: pause instead of spinning
        self.lm.loop.set_events(self.sock, 0, self._on_ready)
        self.lm.loop.call_later(ACCEPT_PAUSE_S, self._resume)

    def _resume(self) -> None:
        if self.fsm.in_(LISTENER_OPEN):
            self.lm.loop.set_events(self.sock, EVENT_READ, self._on_ready)

    def close(self) -> None:
        self.fsm.offer("close")   # a failed listener closes its socket too and stays FAILED
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError):
            pass
        sock = self.sock

        def release() -> None:
            self.lm.loop.forget(sock)
            try:
                sock.close()
            except OSError:
                pass

        self.lm.loop.call_soon(release)

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
