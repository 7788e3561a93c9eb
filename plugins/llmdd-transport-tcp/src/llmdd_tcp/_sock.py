"""Blocking-socket helpers of the tcp transport: deadlines as socket timeouts (``SO_RCVTIMEO`` /
``SO_SNDTIMEO``, Python's own on a TLS socket), exact receives, readiness polls, shutdown and close
from any thread, ``TCP_NODELAY``, the error mapping, and a writable view of raw memory."""

from __future__ import annotations

import ctypes
import select
import socket
import ssl
import struct
import time
from typing import TypeGuard, Union

from llmdd.lowlevel import PeerGone, TransportTimeout, map_os_error

_memview = ctypes.pythonapi.PyMemoryView_FromMemory
_memview.restype = ctypes.py_object
_memview.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_WRITE = 0x200


def _region_view(addr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``addr`` (PyMemoryView_FromMemory: a ctypes array type per
    length would be created, ~20 us, and cached by ctypes for ever, for every length a batch brings)."""
    if size == 0:
        return memoryview(bytearray(0))
    return _memview(addr, size, _PyBUF_WRITE)


def _is_tls(sock: socket.socket) -> TypeGuard[ssl.SSLSocket]:
    return isinstance(sock, ssl.SSLSocket)


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    seconds = max(seconds, 1e-3)
    if _is_tls(sock):
        # an SSL socket needs Python's own timeout: under SO_RCVTIMEO a blocking SSL read retries forever
        sock.settimeout(seconds)
        return
    tv = struct.pack("ll", int(seconds), int((seconds % 1.0) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _arm(sock: socket.socket, deadline: Union[float, None]) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeout("deadline passed")
    _set_timeouts(sock, left)


class _StaleStream(PeerGone):
    """A reused idle stream turned out closed before any byte of the answer came back."""


def _recv_exact(sock: socket.socket, n: int, deadline: Union[float, None] = None, *,
                stale_ok: bool = False) -> bytearray:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    flags = _waitall(sock)
    while got < n:
        _arm(sock, deadline)
        r = sock.recv_into(mv[got:], n - got, flags)
        if r == 0:
            if stale_ok and got == 0:
                raise _StaleStream("peer closed the stream before answering")
            raise PeerGone("peer closed the stream")
        got += r
    return buf


def _waitall(sock: socket.socket) -> int:
    """``MSG_WAITALL`` on a plain socket; an SSL socket takes no flags (it returns a record at a time)."""
    return 0 if _is_tls(sock) else socket.MSG_WAITALL


_map_exc = map_os_error   # a TLS failure is a typed refusal, EAGAIN under SO_RCVTIMEO a timeout


def _shutdown(sock: socket.socket) -> None:
    """Shut the descriptor down (from any thread). On an SSL socket the plain socket's call: the SSL
    one also drops the SSL object, under the feet of a thread still reading or writing with it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _readable(sock: socket.socket) -> bool:
    """True when ``sock`` has data or EOF pending (a zero-timeout poll; no byte is consumed)."""
    try:
        if _is_tls(sock) and sock.pending():
            return True
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


def _close(sock: socket.socket) -> None:
    _shutdown(sock)
    try:
        sock.close()
    except OSError:
        pass


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _wait_readable(sock: socket.socket, seconds: float) -> bool:
    if seconds <= 0:
        return False
    try:
        if _is_tls(sock) and sock.pending():
            return True   # decrypted bytes already buffered: the descriptor may never turn readable
        ready, _, _ = select.select([sock], [], [], seconds)
    except (OSError, ValueError):
        return True   # let the read report it
    return bool(ready)
