"""Blocking-socket helpers of the tcp transport: deadlines as socket timeouts (``SO_RCVTIMEO`` /
``SO_SNDTIMEO``, Python's own on a TLS socket), exact receives, readiness polls, shutdown and close
from any thread, ``TCP_NODELAY``, the error mapping, a writable view of raw memory, the spinner of a
stream's waits, and :class:`StreamBatch` (a batch's sockets, so that cancel, deadline and deregistration
can shut them down)."""

from __future__ import annotations

import ctypes
import os
import select
import socket
import ssl
import struct
import threading
import time
from typing import TypeGuard, Union

from llmdd.lowlevel import Batch, Cancelled, PeerGone, TransportTimeout, map_os_error

_memview = ctypes.pythonapi.PyMemoryView_FromMemory
_memview.restype = ctypes.py_object
_memview.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_WRITE = 0x200
_yield = getattr(os, "sched_yield", lambda: None)


def region_view(addr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``addr`` (PyMemoryView_FromMemory: a ctypes array type per
    length would be created, ~20 us, and cached by ctypes for ever, for every length a batch brings)."""
    if size == 0:
        return memoryview(bytearray(0))
    return _memview(addr, size, _PyBUF_WRITE)


def is_tls(sock: socket.socket) -> TypeGuard[ssl.SSLSocket]:
    return isinstance(sock, ssl.SSLSocket)


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    seconds = max(seconds, 1e-3)
    if is_tls(sock):
        # an SSL socket needs Python's own timeout: under SO_RCVTIMEO a blocking SSL read retries forever
        sock.settimeout(seconds)
        return
    tv = struct.pack("ll", int(seconds), int((seconds % 1.0) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def arm_deadline(sock: socket.socket, deadline: Union[float, None]) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportTimeout("deadline passed")
    set_timeouts(sock, left)


class StaleStream(PeerGone):
    """A reused idle stream turned out closed before any byte of the answer came back."""


def recv_exact(sock: socket.socket, n: int, deadline: Union[float, None] = None, *,
                stale_ok: bool = False) -> bytearray:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    flags = waitall(sock)
    while got < n:
        arm_deadline(sock, deadline)
        r = sock.recv_into(mv[got:], n - got, flags)
        if r == 0:
            if stale_ok and got == 0:
                raise StaleStream("peer closed the stream before answering")
            raise PeerGone("peer closed the stream")
        got += r
    return buf


def waitall(sock: socket.socket) -> int:
    """``MSG_WAITALL`` on a plain socket; an SSL socket takes no flags (it returns a record at a time)."""
    return 0 if is_tls(sock) else socket.MSG_WAITALL


map_exc = map_os_error   # a TLS failure is a typed refusal, EAGAIN under SO_RCVTIMEO a timeout


def shutdown_sock(sock: socket.socket) -> None:
    """Shut the descriptor down (from any thread). On an SSL socket the plain socket's call: the SSL
    one also drops the SSL object, under the feet of a thread still reading or writing with it."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def readable(sock: socket.socket) -> bool:
    """True when ``sock`` has data or EOF pending (a zero-timeout poll; no byte is consumed)."""
    try:
        if is_tls(sock) and sock.pending():
            return True
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


def close_sock(sock: socket.socket) -> None:
    shutdown_sock(sock)
    try:
        sock.close()
    except OSError:
        pass


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _spin_readable(sock: socket.socket, seconds: float) -> bool:
    """Poll a plain blocking socket for up to ``seconds`` without sleeping (``MSG_PEEK | MSG_DONTWAIT``):
    True as soon as a byte, the end of the stream or an error waits (the read that follows takes or
    reports it), False when the time ran out or the socket cannot be polled this way (TLS, a Python
    timeout).  A thread asleep in the kernel is woken by an interrupt to its core when the bytes come,
    which costs more than a small transfer on a small VM (docs/transports.md, "Spinning"): a waiter
    that expects an answer within microseconds spins first, then sleeps.  Every empty poll yields the
    core (``sched_yield``): a peer that runs on the same core (the one that is to answer) runs at once
    instead of waiting until the spin ends."""
    if seconds <= 0 or is_tls(sock) or sock.gettimeout() is not None:
        return False
    end = time.perf_counter() + seconds
    flags = socket.MSG_PEEK | socket.MSG_DONTWAIT
    while True:
        try:
            sock.recv(1, flags)
            return True
        except (BlockingIOError, InterruptedError):
            if time.perf_counter() >= end:
                return False
            _yield()   # a peer that shares this core runs now, not after the spin
        except OSError:
            return True


#: the most waits a spinner skips after spins that found nothing (doubling from 1 on each miss)
SPIN_SKIP_MAX = 64


class Spinner:
    """When to spin before a wait (``llmdd.tcp.spin_us``): always while spins find their bytes; after a
    spin that ran out, the next wait sleeps at once, after two misses in a row the next two, then four,
    up to :data:`SPIN_SKIP_MAX`; a spin that finds its bytes starts over.  A spin runs out when the peer
    that is to answer cannot run (both cores busy: a sleeping waiter would let the scheduler move it
    here, a spinning one keeps the core), so a busy machine stops paying for spins within a few waits
    and a quiet one keeps spinning.  Shared by the threads of one channel or stream without a lock: its
    counters are a hint (a lost update changes when the next spin happens, nothing else)."""

    __slots__ = ("seconds", "skip", "penalty", "hits", "misses")

    def __init__(self, seconds: float) -> None:
        self.seconds = max(0.0, seconds)
        self.skip = 0
        self.penalty = 0
        self.hits = 0
        self.misses = 0

    def wait(self, sock: socket.socket, limit: float) -> bool:
        """Spin on ``sock`` for at most the budget (and ``limit``) unless misses say sleep: True when its
        bytes (or its end) came while spinning."""
        budget = self.take(limit)
        if not budget:
            return False
        hit = _spin_readable(sock, budget)
        self.record(hit)
        return hit

    def take(self, limit: float) -> float:
        """The seconds the next wait spins (0: it sleeps at once), for a wait of at most ``limit``; a spin
        taken is followed by :meth:`record` of what it found (the C path spins itself)."""
        if self.seconds <= 0 or limit <= 0:
            return 0.0
        if self.skip:
            self.skip -= 1
            return 0.0
        return min(self.seconds, limit)

    def record(self, hit: bool) -> None:
        """What a spin taken from :meth:`take` found."""
        if hit:
            self.penalty = 0
            self.hits += 1
            return
        self.penalty = min(SPIN_SKIP_MAX, max(1, 2 * self.penalty))
        self.skip = self.penalty
        self.misses += 1


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    if seconds <= 0:
        return False
    try:
        if is_tls(sock) and sock.pending():
            return True   # decrypted bytes already buffered: the descriptor may never turn readable
        ready, _, _ = select.select([sock], [], [], seconds)
    except (OSError, ValueError):
        return True   # let the read report it
    return bool(ready)


class StreamBatch(Batch):
    """A batch and its sockets, so that cancel/deadline/deregister can kill them."""

    __slots__ = ("socks", "lock")

    def __init__(self) -> None:
        super().__init__()
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()

    def adopt(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)
            if not self.aborted:
                return
        shutdown_sock(sock)
        raise Cancelled("batch aborted")

    def on_abort(self) -> None:
        with self.lock:
            socks = list(self.socks)
        for s in socks:
            shutdown_sock(s)
