"""The simulated network: in-memory stream sockets between simulated processes, and its faults.

Every :class:`~llmdd.testing.sim.world.World` has one :class:`Network` (``world.net``).  A socket has
the behaviour the control plane relies on: partial sends against a bounded buffer, ``BlockingIOError``
when non-blocking, timeouts when blocking (on the world's clock), EOF after a shutdown or close,
``ECONNREFUSED`` where nobody listens.  A blocking ``send`` / ``recv`` waits as a fiber of the world
waits (:meth:`World.block`): the rest of the world runs meanwhile.

Each socket belongs to a simulated process (the ``process`` name of the
:class:`~llmdd.testing.sim.runtime.SimRuntime` that opened or accepted it), and the faults act per
message (what one ``send`` handed over) or per process, on the world's seeded randomness:

=====================  ==========================================================================
``latency``            a function ``(socket, nbytes) -> seconds`` drawn per message; a stream keeps
                       its order (a message never overtakes an earlier one of its connection), so
                       messages reorder only across connections
``loss``               the chance a message is lost on the wire: a stream retransmits it, so it (and
                       what follows it on its connection) arrives ``rto`` seconds later (per loss)
``dup``                the chance a message is duplicated on the wire: the receiving stream drops the
                       copy (counted in ``stats["dup_dropped"]``, never seen by the engine)
:meth:`cut`            one connection goes silent for good (what is sent is lost, nothing is closed)
:meth:`partition`      two groups of processes cannot reach each other (messages are held, connects
                       time out) until :meth:`heal`, when held messages arrive one ``rto`` later
:meth:`stall`          a process stops reading its sockets (its peers' sends back up and block)
=====================  ==========================================================================

Code that changes what a socket's readiness depends on by hand (its ``frozen`` flag, its
``capacity``) calls ``world.wake(sock)`` after: the world checks only the sockets that changed.

A process that freezes (as under SIGSTOP) or crashes is the world's (:meth:`World.freeze`,
:meth:`~llmdd.testing.sim.runtime.SimRuntime.crash`); a crashed process's sockets are closed
(its peers read EOF after what was already on the wire).
"""

from __future__ import annotations

import collections
import errno
import itertools
import math
import socket
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from llmdd._runtime.runtime import EVENT_READ, EVENT_WRITE

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from llmdd.testing.sim.runtime import SimRuntime
    from llmdd.testing.sim.world import World

__all__ = ["Network", "SimSocket", "SimServerSocket", "RX_CAPACITY", "listen", "connect"]

#: bytes a connection holds (on the wire and in the receiver's buffer) before a send takes less (or blocks)
RX_CAPACITY = 256 * 1024
#: the most retransmissions one message can need (``loss`` close to 1 still delivers, late)
MAX_RETRANSMITS = 8

_EOF = None   # a pipe item: the sender shut its side


class Network:
    """The listeners, connections and faults of one world (``world.net``)."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.servers: dict[tuple[str, int], SimServerSocket] = {}
        self.connections: list[tuple[SimSocket, SimSocket]] = []   # (client end, server end), in order
        self._ports = itertools.count(40_000)
        self._fds = itertools.count(10_000)
        #: per-message delay (seconds) of a message of ``nbytes`` sent on a socket; None: no delay
        self.latency: Optional[Callable[["SimSocket", int], float]] = None
        self.loss = 0.0
        self.dup = 0.0
        #: the retransmission timeout of a lost message, and the delay of held messages after a heal
        self.rto = 0.2
        self._split: set[frozenset[str]] = set()   # pairs of processes that cannot reach each other
        self.stalled: set[str] = set()
        self.stats: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ faults
    def shaped(self) -> bool:
        """True when a message may be delayed (latency, loss, a partition): sends go through the wire."""
        return self.latency is not None or self.loss > 0 or bool(self._split)

    def cut(self, sock: "SimSocket") -> None:
        """The connection of ``sock`` goes silent both ways for good (nothing is closed)."""
        sock.cut = True
        if sock.peer is not None:
            sock.peer.cut = True

    def partition(self, group_a: Iterable[str], group_b: Iterable[str]) -> None:
        """No message between a process of ``group_a`` and one of ``group_b`` arrives until :meth:`heal`."""
        b = list(group_b)
        for x in group_a:
            for y in b:
                if x != y:
                    self._split.add(frozenset((x, y)))

    def reachable(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self._split or a == b

    def heal(self) -> None:
        """End every partition: what was held is retransmitted (arrives ``rto`` from now, in order)."""
        self._split.clear()
        resend = self.world.now + self.rto
        for client, server in self.connections:
            for sock in (client, server):
                if sock.pipe and sock.pipe[0][0] < resend:
                    for entry in sock.pipe:
                        if entry[0] < resend:
                            entry[0] = resend
                    sock.last_arrival = max(sock.last_arrival, resend)
                    self.world.call_later(self.rto, self._pump, (sock,))

    def stall(self, process: str) -> None:
        """``process`` stops reading its sockets (what its peers send backs up)."""
        self.stalled.add(process)

    def unstall(self, process: str) -> None:
        self.stalled.discard(process)
        for sock in self.sockets_of(process):
            self.world.recheck(sock)
        for server in self.servers.values():
            if server.process == process:
                self.world.recheck(server)
        self.world.wake_always()

    def sockets_of(self, process: str) -> list["SimSocket"]:
        """The open sockets of ``process`` (either end it owns), in the order they were made."""
        out = []
        for client, server in self.connections:
            for sock in (client, server):
                if sock.process == process and not sock.closed:
                    out.append(sock)
        return out

    def open_sockets(self) -> int:
        """Sockets (connection ends and listeners) not yet closed: 0 once every engine finalized."""
        ends = sum(1 for pair in self.connections for s in pair if not s.closed)
        return ends + sum(1 for s in self.servers.values() if not s.closed)

    # ------------------------------------------------------------------ the wire
    def delay_of(self, sock: "SimSocket", nbytes: int) -> float:
        delay = 0.0 if self.latency is None else max(0.0, float(self.latency(sock, nbytes)))
        rnd = self.world.random
        if self.loss > 0:
            k = 0
            while k < MAX_RETRANSMITS and rnd.random() < self.loss:
                delay += self.rto
                k += 1
            self.stats["lost"] += k
        if self.dup > 0 and rnd.random() < self.dup:
            self.stats["dup_dropped"] += 1
        return delay

    def send_item(self, sock: "SimSocket", item: Optional[bytes]) -> None:
        """Put ``item`` (bytes, or ``None`` for EOF) on the wire from ``sock`` to its peer, in order."""
        if not sock.pipe and not self.shaped():
            self._arrive(sock, item)
            return
        when = self.world.now + (self.delay_of(sock, len(item)) if item is not None else 0.0)
        when = max(when, sock.last_arrival)
        sock.last_arrival = when
        sock.pipe.append([when, item])
        if item is not None:
            sock.in_flight += len(item)
        self.world.call_later(when - self.world.now, self._pump, (sock,))

    def _pump(self, sock: "SimSocket") -> None:
        """Deliver what is due at the head of ``sock``'s wire (held while a partition lasts)."""
        peer = sock.peer
        now = self.world.now
        while sock.pipe and sock.pipe[0][0] <= now:
            if peer is not None and not self.reachable(sock.process, peer.process):
                self.stats["held"] += 1
                return   # behind a partition: retransmitted after the heal (Network.heal)
            _when, item = sock.pipe.popleft()
            if item is not None:
                sock.in_flight -= len(item)
            self._arrive(sock, item)

    def _arrive(self, sock: "SimSocket", item: Optional[bytes]) -> None:
        peer = sock.peer
        if peer is None or peer.closed:
            return
        if item is _EOF:
            peer.eof = True
        else:
            peer.rx += item
        self.world.wake(peer)


class SimSocket:
    """One end of an in-memory stream connection, owned by simulated process ``process``."""

    def __init__(self, net: Network, local: tuple[str, int], remote: tuple[str, int], process: str) -> None:
        self._net = net
        self._world = net.world
        self.local = local
        self.remote = remote
        self.process = process
        self.peer: Optional[SimSocket] = None
        self.rx = bytearray()
        self.eof = False            # the peer shut its sending side (or closed), and all before it arrived
        self.closed = False
        self.timeout: Optional[float] = None   # None blocking, 0.0 non-blocking, else a timeout
        self.frozen = False         # its owner reads nothing (the peer's output backs up)
        self.capacity = RX_CAPACITY   # what its receive buffer holds before the peer's sends take less
        self.cut = False            # what this end sends is lost
        self.sent = 0
        self.eof_sent = False       # this end shut its sending side
        # on the wire from this end (Network.send_item): [arrival time, bytes or None for EOF], in order
        self.pipe: collections.deque = collections.deque()
        self.in_flight = 0
        self.last_arrival = -math.inf
        self._fd = next(net._fds)

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
        return max(0, peer.capacity - len(peer.rx) - self.in_flight)

    def send(self, data: ReadableBuffer) -> int:
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
            self._net.send_item(self, bytes(view[:n]))
        self.sent += n
        return n

    def sendall(self, data: ReadableBuffer) -> None:
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
        if self.peer is not None:
            self._world.wake(self)   # room for the peer's sends
        return data

    def shutdown(self, how: int) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        if not self.eof_sent:
            self.eof_sent = True
            if not self.cut:
                self._net.send_item(self, _EOF)

    def close(self) -> None:
        if self.closed:
            return
        if not self.eof_sent:
            self.eof_sent = True
            if not self.cut:
                self._net.send_item(self, _EOF)
        self.closed = True
        self.rx.clear()
        if self.peer is not None:
            self._world.wake(self.peer)   # its sends now fail (EPIPE)
        self._world.wake(self)
        self._world.unwatch(self)

    # the simulation's readiness
    def sim_ready(self) -> int:
        if self.closed:
            return 0
        mask = 0
        if (self.rx or self.eof) and not self.frozen and self.process not in self._net.stalled:
            mask |= EVENT_READ
        if self._room() > 0 or self.peer is None or self.peer.closed:
            mask |= EVENT_WRITE
        return mask

    def __repr__(self) -> str:
        return f"<SimSocket {self.process} {self.local}->{self.remote}{' closed' if self.closed else ''}>"


class SimServerSocket:
    """A listening socket of ``process``: :func:`connect` queues connections, ``accept`` takes them."""

    def __init__(self, net: Network, address: tuple[str, int], backlog: int, process: str) -> None:
        self._net = net
        self._world = net.world
        self.address = address
        self.process = process
        self.owner: Optional[SimRuntime] = None   # the runtime that listens (it owns the connections accepted here)
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
        if self._net.servers.get(self.address) is self:
            del self._net.servers[self.address]
        for sock in self.backlog:   # never accepted: the clients see the connection reset
            sock.close()
        self.backlog.clear()
        self._world.unwatch(self)

    def sim_ready(self) -> int:
        if self.closed or self.process in self._net.stalled:
            return 0
        return EVENT_READ if self.backlog else 0

    def __repr__(self) -> str:
        return f"<SimServerSocket {self.process} {self.address}{' closed' if self.closed else ''}>"


#: what a runtime of the world watches for readiness (``set_events``): the sockets and listeners it made
Watchable = Union[SimSocket, SimServerSocket]


def listen(world: "World", address: tuple[str, int], backlog: int, process: str = "?") -> SimServerSocket:
    """A listening socket of ``process`` at ``address`` (port 0: the world picks one)."""
    net = world.net
    host, port = address
    if port == 0:
        port = next(net._ports)
        while (host, port) in net.servers:
            port = next(net._ports)
    if (host, port) in net.servers:
        raise OSError(errno.EADDRINUSE, "Address already in use")
    server = SimServerSocket(net, (host, port), backlog, process)
    net.servers[(host, port)] = server
    return server


def connect(world: "World", address: tuple[str, int], timeout: Optional[float], process: str = "?") -> SimSocket:
    """A connection from ``process`` to the listener at ``address`` (queued in its backlog), or
    ``ECONNREFUSED`` where nobody listens; across a partition it times out after ``timeout``."""
    net = world.net
    server = net.servers.get((address[0], int(address[1])))
    if server is not None and not server.closed and not net.reachable(process, server.process):
        world.block(lambda: False, world.deadline(timeout))   # the SYNs are lost
        raise socket.timeout("timed out")
    if server is None or server.closed:
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    local = ("127.0.0.1", next(net._ports))
    client = SimSocket(net, local, server.address, process)
    accepted = SimSocket(net, server.address, local, server.process)
    client.peer, accepted.peer = accepted, client
    client.settimeout(timeout)
    server.backlog.append(accepted)
    if server.owner is not None:
        server.owner._sockets.append(accepted)
    net.connections.append((client, accepted))
    world.wake(server)   # a connection to accept
    world.wake_always()
    return client
