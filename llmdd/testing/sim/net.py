"""The simulated network: in-memory stream sockets with the behaviour the control plane relies on.

Partial sends against a bounded receive buffer, ``BlockingIOError`` when non-blocking, timeouts when
blocking (on the world's clock), EOF after a shutdown, ``ECONNREFUSED`` where nobody listens.  A test
can freeze a socket (its owner reads nothing: the peer's output backs up) or cut a connection (what
is sent is lost, nothing is closed: silence).  A blocking ``send`` / ``recv`` waits as a fiber of the
world waits (:meth:`World.block`): the rest of the world runs meanwhile.
"""

from __future__ import annotations

import collections
import errno
import math
import socket
from typing import TYPE_CHECKING, Any, Optional

from llmdd._runtime.runtime import EVENT_READ, EVENT_WRITE

if TYPE_CHECKING:
    from llmdd.testing.sim.world import World

__all__ = ["SimSocket", "SimServerSocket", "RX_CAPACITY", "listen", "connect"]

#: bytes a simulated socket's receive buffer holds before the sender's send() takes less (or blocks)
RX_CAPACITY = 256 * 1024


class SimSocket:
    """One end of an in-memory stream connection."""

    def __init__(self, world: "World", local: tuple[str, int], remote: tuple[str, int]) -> None:
        self._world = world
        self.local = local
        self.remote = remote
        self.peer: Optional[SimSocket] = None
        self.rx = bytearray()
        self.eof = False            # the peer shut its sending side (or closed)
        self.closed = False
        self.timeout: Optional[float] = None   # None blocking, 0.0 non-blocking, else a timeout
        self.frozen = False         # its owner's loop reads nothing (the peer's output backs up)
        self.capacity = RX_CAPACITY   # what its receive buffer holds before the peer's sends take less
        self.cut = False            # a partition: what this end sends is lost
        self.sent = 0
        self.eof_sent = False       # this end shut its sending side
        self._fd = next(world._fds)

    # socket API the control plane uses
    def fileno(self) -> int:
        return -1 if self.closed else self._fd

    def setblocking(self, flag: bool) -> None:
        self.timeout = None if flag else 0.0

    def settimeout(self, value: Optional[float]) -> None:
        self.timeout = value

    def setsockopt(self, *args: Any) -> None:
        pass

    def getsockname(self) -> tuple[str, int]:
        return self.local

    def getpeername(self) -> tuple[str, int]:
        return self.remote

    def _room(self) -> int:
        peer = self.peer
        if peer is None or peer.closed:
            return 0
        return max(0, peer.capacity - len(peer.rx))

    def send(self, data: Any) -> int:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        peer = self.peer
        if peer is None or peer.closed or self.eof_sent:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        if self._room() == 0:
            if self.timeout == 0.0:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            until = math.inf if self.timeout is None else self._world.now + self.timeout
            if not self._world.block(lambda: self._room() > 0 or peer.closed, until, on=peer):
                raise socket.timeout("timed out")
            if peer.closed:
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        view = memoryview(data).cast("B")
        n = min(len(view), self._room())
        if not self.cut:
            peer.rx += view[:n]
            self._world.wake(peer)
        self.sent += n
        return n

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = self.send(view)
            view = view[n:]

    def recv(self, size: int) -> bytes:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        if not self.rx and not self.eof:
            if self.timeout == 0.0:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            until = math.inf if self.timeout is None else self._world.now + self.timeout
            if not self._world.block(lambda: bool(self.rx) or self.eof or self.closed, until, on=self):
                raise socket.timeout("timed out")
            if self.closed:
                raise OSError(errno.EBADF, "Bad file descriptor")
        data = bytes(self.rx[:size])
        del self.rx[:size]
        self._world.wake(self)   # room for the peer's sends
        return data

    def shutdown(self, how: int) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        self.eof_sent = True
        if self.peer is not None:
            self.peer.eof = True
            self._world.wake(self.peer)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rx.clear()
        if self.peer is not None:
            self.peer.eof = True
            self._world.wake(self.peer)
        self._world.wake(self)
        self._world.unwatch(self)

    # the simulation's readiness
    def sim_ready(self) -> int:
        if self.closed:
            return 0
        mask = 0
        if (self.rx or self.eof) and not self.frozen:
            mask |= EVENT_READ
        if self._room() > 0 or self.peer is None or self.peer.closed:
            mask |= EVENT_WRITE
        return mask


class SimServerSocket:
    """A listening socket: :meth:`World.connect` queues connections, ``accept`` takes them."""

    def __init__(self, world: "World", address: tuple[str, int], backlog: int) -> None:
        self._world = world
        self.address = address
        self.backlog_max = max(1, backlog)
        self.backlog: collections.deque = collections.deque()
        self.closed = False
        self.timeout: Optional[float] = None

    def fileno(self) -> int:
        return -1 if self.closed else 1

    def setblocking(self, flag: bool) -> None:
        self.timeout = None if flag else 0.0

    def getsockname(self) -> tuple[str, int]:
        return self.address

    def accept(self) -> tuple[SimSocket, tuple[str, int]]:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        if not self.backlog:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        sock = self.backlog.popleft()
        return sock, sock.remote

    def shutdown(self, how: int) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._world.servers.pop(self.address, None)
        for sock in self.backlog:   # never accepted: the clients see the connection reset
            sock.close()
        self.backlog.clear()
        self._world.unwatch(self)

    def sim_ready(self) -> int:
        return EVENT_READ if self.backlog and not self.closed else 0


def listen(world: "World", address: tuple[str, int], backlog: int) -> SimServerSocket:
    """A listening socket at ``address`` (port 0: the world picks one)."""
    host, port = address
    if port == 0:
        port = next(world._ports)
        while (host, port) in world.servers:
            port = next(world._ports)
    if (host, port) in world.servers:
        raise OSError(errno.EADDRINUSE, "Address already in use")
    server = SimServerSocket(world, (host, port), backlog)
    world.servers[(host, port)] = server
    return server


def connect(world: "World", address: tuple[str, int], timeout: Optional[float]) -> SimSocket:
    """A connection to the listener at ``address`` (queued in its backlog) or ``ECONNREFUSED``."""
    server = world.servers.get((address[0], int(address[1])))
    if server is None or server.closed:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    local = ("127.0.0.1", next(world._ports))
    client = SimSocket(world, local, server.address)
    accepted = SimSocket(world, server.address, local)
    client.peer, accepted.peer = accepted, client
    client.settimeout(timeout)
    server.backlog.append(accepted)
    world.connections.append((client, accepted))
    return client
