"""The simulated backend of a run: every engine on one :class:`~llmdd.testing.sim.world.World`.

Each engine is an ordinary :class:`llmdd.LLMDataDist` built on its own
:class:`~llmdd.testing.sim.runtime.SimRuntime` (:func:`llmdd._api.datadist.use_runtime`), one simulated
process of the world; its bytes move over the ``sim`` transport plugin (``plugins/llmdd-transport-sim``,
reached through the ``llmdd`` entry points like every transport) on a :class:`llmdd_sim.Fabric` whose
clock is the world's (:class:`WorldClock`).  So the whole run is one thread on one fake clock, and a
seed decides it.

The faults of the network and of processes are made here, on the world's in-memory sockets
(:mod:`llmdd.testing.sim.net`), without changing them:

* ``latency`` / ``loss`` / ``reorder``: the sockets of a connection made while the fault is on are
  :class:`LatentSocket` (what one end sends reaches the other end's receive buffer after a delay drawn
  per message, FIFO per direction as a stream is; a lost message is retransmitted one RTO later);
* ``stall`` (a process reads nothing: its peers' output backs up) and ``freeze`` (SIGSTOP: it also runs
  no timer and its transport endpoint serves nothing) for a while; ``cut`` (one connection goes silent
  for good); ``partition`` (the connections between two groups hold their bytes, new connections
  between them are refused, the transport reaches nobody across; until the partition heals);
* ``crash``: the process's runtime stops, its sockets close (its peers see the connection end), its
  transport endpoints die; a later start is a new incarnation on a fresh runtime.
"""

from __future__ import annotations

import collections
import errno
import math
import random
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import llmdd_sim

from llmdd.testing.sim import net
from llmdd.testing.sim import world as world_module
from llmdd.testing.sim.backends import _FabricBackend
from llmdd.testing.sim.invariants import Record
from llmdd.testing.sim.net import SimSocket
from llmdd.testing.sim.runtime import SimRuntime
from llmdd.testing.sim.world import World

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from llmdd._api.datadist import LLMDataDist
    from llmdd._runtime.runtime import Timer
    from llmdd.testing.sim.oracle import Oracle
    from llmdd.testing.sim.runner import Config
    from llmdd.testing.sim.workload import Node

__all__ = ["SimBackend", "WorldClock", "LatentSocket"]

#: a lost segment is retransmitted after this long (the retransmission timeout)
RTO_S = 0.2
#: steps at one instant before the world calls the run a livelock (the world's default, 2,000,000, takes
#: minutes of CPU to reach; the busiest instant of a 200-engine run is a few thousand steps)
MAX_STEPS_PER_INSTANT = 200_000
#: what an engine may hold in a world's buffers for one socket before bounded_growth says so
GROWTH_BOUND = 4 * net.RX_CAPACITY


class WorldClock:
    """The :class:`llmdd_sim.Clock` of a world: its time, timers and waits."""

    def __init__(self, world: World) -> None:
        self.world = world

    def now(self) -> float:
        return self.world.now

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> Timer:
        return self.world.call_later(delay, fn, args)

    def run_until(self, pred: Callable[[], bool], until: float, key: Optional[Hashable] = None) -> bool:
        return bool(self.world.block(pred, until, on=key))

    def notify(self, key: Hashable) -> None:
        self.world.wake(key)


class _Net:
    """The network's latency draws (one seeded rng of the run, separate from the engines')."""

    def __init__(self, seed: int, latency: bool, loss: bool, reorder: bool) -> None:
        self.rng = random.Random(f"net-{seed}")
        self.latency, self.loss, self.reorder = latency, loss, reorder

    def delay(self) -> float:
        d = 0.0
        if self.latency:
            d = self.rng.uniform(1e-4, 1e-3) if self.rng.random() < 0.95 else self.rng.uniform(0.01, 0.1)
        if self.reorder:
            d += self.rng.uniform(0.0, 5e-3)
        if self.loss and self.rng.random() < 0.02:
            d += RTO_S
        return d


class LatentSocket(SimSocket):
    """A :class:`~llmdd.testing.sim.net.SimSocket` whose bytes take a drawn time to reach the peer.

    FIFO per direction (a message never overtakes an earlier one of the same connection); what is in
    flight counts against the peer's receive buffer; the end of the stream (shutdown, close) arrives
    after the last byte sent before it."""

    net_: _Net
    pipe: collections.deque
    inflight: int
    last_due: float

    def _room(self) -> int:
        peer = self.peer
        if peer is None or peer.closed:
            return 0
        return max(0, peer.capacity - len(peer.rx) - self.inflight)

    def send(self, data: ReadableBuffer) -> int:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        peer = self.peer
        if peer is None or peer.closed or self.eof_sent:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        world = self._world
        if self._room() == 0:
            if self.timeout == 0.0:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            until = math.inf if self.timeout is None else world.now + self.timeout
            if not world.block(lambda: self._room() > 0 or peer.closed, until, on=peer):
                import socket
                raise socket.timeout("timed out")
            if peer.closed:
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        view = memoryview(data).cast("B")
        n = min(len(view), self._room())
        if not self.cut:
            self._later(bytes(view[:n]))
        self.sent += n
        return n

    def _later(self, chunk: Optional[bytes]) -> None:
        """Deliver ``chunk`` (None: the end of the stream) after a drawn delay, in order."""
        world = self._world
        due = max(self.last_due, world.now + self.net_.delay())
        self.last_due = due
        if chunk is not None:
            self.inflight += len(chunk)
        self.pipe.append(chunk)
        world.call_later(due - world.now, self._arrive, ())

    def _arrive(self) -> None:
        chunk = self.pipe.popleft()
        peer = self.peer
        if chunk is not None:
            self.inflight -= len(chunk)
        if peer is None or peer.closed:
            return
        if chunk is None:
            peer.eof = True
        else:
            peer.rx += chunk
        self._world.wake(peer)
        self._world.wake(self)

    def shutdown(self, how: int) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor")
        if not self.eof_sent:
            self.eof_sent = True
            self._later(None)

    def close(self) -> None:
        if self.closed:
            return
        if not self.eof_sent:
            self.eof_sent = True
            self._later(None)
        self.closed = True
        self.rx.clear()
        self._world.wake(self)
        if self.peer is not None:
            self._world.wake(self.peer)
        self._world.unwatch(self)


def _make_latent(sock: SimSocket, net_: _Net) -> None:
    sock.__class__ = LatentSocket
    latent: Any = sock
    latent.net_, latent.pipe, latent.inflight, latent.last_due = net_, collections.deque(), 0, 0.0


class FaultyRuntime(SimRuntime):
    """A :class:`SimRuntime` whose process the backend can partition, freeze and crash."""

    backend: "SimBackend"
    process: str

    def create_connection(self, address: tuple[str, int], timeout: float) -> SimSocket:
        server = self.world.servers.get((address[0], int(address[1])))
        owner = self.backend.listener_owner.get((address[0], int(address[1])))
        if owner is not None and not self.backend.reaches(self.process, owner):
            # a partition: the SYN goes nowhere; the connect times out (on the world's clock)
            self.world.block(lambda: False, self.world.now + max(0.0, timeout))
            import socket
            raise socket.timeout("timed out (partitioned)")
        client = net.connect(self.world, address, timeout)
        peer = client.peer
        assert peer is not None
        if self.backend.net is not None:
            _make_latent(client, self.backend.net)
            _make_latent(peer, self.backend.net)
        self.backend.sockets.setdefault(self.process, []).append(client)
        if owner is not None:
            self.backend.sockets.setdefault(owner, []).append(peer)
            self.backend.apply_partition_to(client, self.process, owner)
        del server
        return client

    def create_server(self, address: tuple[str, int], backlog: int) -> net.SimServerSocket:
        server = super().create_server(address, backlog)
        self.backend.listener_owner[server.getsockname()] = self.process
        self.backend.servers.setdefault(self.process, []).append(server)
        return server

    def _timer(self, fn: Callable, args: tuple) -> None:
        if self.process in self.backend.frozen and not self.closed:
            self.backend.parked.setdefault(self.process, []).append((self._timer, (fn, args)))
            return
        super()._timer(fn, args)


class SimBackend(_FabricBackend):
    """Every engine of a run on one seeded world (see the module docstring)."""

    can_crash = True

    def __init__(self, config: Config, oracle: Oracle) -> None:
        self.world = World(config.seed)
        self._max_instant = world_module.MAX_STEPS_PER_INSTANT
        world_module.MAX_STEPS_PER_INSTANT = MAX_STEPS_PER_INSTANT
        faults = set(config.faults)
        self.net: Optional[_Net] = None
        if faults & {"latency", "loss", "reorder"}:
            self.net = _Net(config.seed, "latency" in faults, "loss" in faults, "reorder" in faults)
        fabric = llmdd_sim.Fabric(WorldClock(self.world), seed=config.seed, name=f"sim-{config.seed}-{id(self)}",
                                  lock=threading.RLock())
        super().__init__(config, oracle, fabric)
        fabric.reachable = self.reaches
        self.runtimes: dict[str, FaultyRuntime] = {}
        self.listener_owner: dict[tuple[str, int], str] = {}
        self.sockets: dict[str, list[SimSocket]] = {}
        self.servers: dict[str, list[net.SimServerSocket]] = {}
        self.frozen: set[str] = set()
        self.stalled: dict[str, float] = {}
        self.parked: dict[str, list] = {}
        self.partitions: list[tuple[set, set]] = []
        self.crashed_names: set[str] = set()
        self.zombies: list = []   # the greenlets of crashed processes (never resumed)
        self._incarnations: dict[str, int] = {}
        self._failures_seen = 0
        self._t0 = self.world.now

    # ------------------------------------------------------------------ engines
    def engine_options(self, node: Node) -> dict:
        return {**super().engine_options(node), "llm.listenIpInfo": f"127.0.0.1:{20000 + node.cid}"}

    def init(self, node: Node, dd: LLMDataDist, options: dict) -> None:
        from llmdd._api.datadist import use_runtime
        n = self._incarnations[node.process] = self._incarnations.get(node.process, 0) + 1
        rt = FaultyRuntime(self.world, f"{node.process}#{n}")
        rt.backend, rt.process = self, node.process
        self.runtimes[node.process] = rt
        from llmdd._runtime.runtime import Runtime
        use_runtime(dd, cast(Runtime, rt))   # in-memory sockets, not socket.socket
        dd.init(options)

    def now(self) -> float:
        return self.world.now

    def elapsed(self) -> float:
        return self.world.now - self._t0

    def advance(self, seconds: float) -> None:
        self.world.block(lambda: False, self.world.now + max(0.0, seconds))
        self._settle()

    def _settle(self) -> None:
        """Run what is runnable now and what is due (one microsecond of the clock).  Not
        ``World.settle()``: with a timer due at the current instant it wakes its waiter for ever
        (the hub wakes it before running due timers; the waiter sees the due timer, not idle)."""
        self.world.block(lambda: False, self.world.now + 1e-6)

    def host_of(self, node: Node) -> str:
        return "127.0.0.1"

    def nobody_listens(self) -> tuple[str, int]:
        return ("127.0.0.1", 19999)

    # ------------------------------------------------------------------ faults
    def reaches(self, a: str, b: str) -> bool:
        return not any((a in x and b in y) or (a in y and b in x) for x, y in self.partitions)

    def apply_partition_to(self, sock: SimSocket, a: str, b: str) -> None:
        if not self.reaches(a, b):
            sock.frozen = True
            if sock.peer is not None:
                sock.peer.frozen = True

    def _pairs(self) -> list[tuple[str, str, SimSocket]]:
        """(owner, peer owner, socket) of every open socket whose both ends are known."""
        owner_of: dict[int, str] = {}
        for proc, socks in self.sockets.items():
            for s in socks:
                owner_of[id(s)] = proc
        out = []
        for proc, socks in self.sockets.items():
            for s in socks:
                if s.closed or s.peer is None:
                    continue
                other = owner_of.get(id(s.peer))
                if other is not None:
                    out.append((proc, other, s))
        return out

    def _refreeze(self) -> None:
        """Each socket's reading is frozen iff its owner is stalled/frozen or a partition lies between."""
        for proc, other, s in self._pairs():
            s.frozen = proc in self.stalled or proc in self.frozen or not self.reaches(proc, other)
            if not s.frozen:
                self.world.wake(s)

    def partition(self, a: list, b: list, seconds: float) -> str:
        self.partitions.append((set(a), set(b)))
        self._refreeze()
        part = self.partitions[-1]
        self.world.call_later(seconds, self._heal_partition, (part,))
        return f"partition {sorted(a)} | {sorted(b)} for {seconds:.2f}s"

    def _heal_partition(self, part: tuple[set, set]) -> None:
        if part in self.partitions:
            self.partitions.remove(part)
            self._refreeze()

    def stall(self, process: str, seconds: float) -> str:
        self.stalled[process] = self.world.now + seconds
        self._refreeze()
        self.world.call_later(seconds, self._unstall, (process,))
        return f"stall {process} for {seconds:.2f}s"

    def _unstall(self, process: str) -> None:
        if self.stalled.get(process, math.inf) <= self.world.now:
            self.stalled.pop(process, None)
            self._refreeze()

    def freeze(self, process: str, seconds: float) -> str:
        self.frozen.add(process)
        self.fabric.freeze(process)
        self._refreeze()
        self.world.call_later(seconds, self._thaw, (process,))
        return f"freeze {process} for {seconds:.2f}s"

    def _thaw(self, process: str) -> None:
        if process not in self.frozen:
            return
        self.frozen.discard(process)
        self.fabric.thaw(process)
        self._refreeze()
        for fn, args in self.parked.pop(process, []):
            self.world.call_soon(f"thaw:{process}", fn, args, fn.__self__ if hasattr(fn, "__self__") else None)

    def cut_connection(self, rng: random.Random) -> str:
        pairs = [(p, o, s) for p, o, s in self._pairs() if not s.cut]
        if not pairs:
            return "cut: no connection"
        proc, other, s = rng.choice(sorted(pairs, key=lambda t: (t[0], t[1], t[2].fileno())))
        s.cut = True
        if s.peer is not None:
            s.peer.cut = True
        return f"cut {proc} <-> {other}"

    def heal(self) -> None:
        self.partitions.clear()
        self.stalled.clear()
        for process in sorted(self.frozen):
            self._thaw(process)
        self._refreeze()

    def crash(self, node: Node) -> None:
        proc = node.process
        rt = self.runtimes.pop(proc, None)
        if rt is not None:
            self.crashed_names.add(rt.name)
            self._kill(rt)
        self.frozen.discard(proc)
        self.stalled.pop(proc, None)
        self.parked.pop(proc, None)
        self.fabric.crash(proc)
        for server in self.servers.pop(proc, []):
            self.listener_owner.pop(server.getsockname(), None)
            server.close()
        for s in self.sockets.pop(proc, []):
            s.close()
        # the engine object is gone with its process: nothing of it is finalized
        from llmdd._api.datadist import LLMDataDist
        if LLMDataDist.llm_engine_instance is node.dd:
            LLMDataDist.llm_engine_instance = None

    def _kill(self, rt: FaultyRuntime) -> None:
        """Everything of ``rt``'s process stops at once: its queued loop calls and pool tasks are dropped,
        its fibers are never resumed (kept referenced, so no garbage collection runs their ``finally``
        blocks during the run), its timers do nothing (the runtime is closed)."""
        world = self.world
        mine = (rt.name + ":", rt.name + "-")
        dead = {g for g, f in list(world._fibers.items()) if f.name.startswith(mine)}
        self.zombies.extend(dead)
        for key, parks in list(world._parked.items()):
            for park in parks:
                if park.glet in dead:
                    park.woken = True
            left = [park for park in parks if park.glet not in dead]
            if left:
                world._parked[key] = left
            else:
                del world._parked[key]

        def alive(entry: tuple) -> bool:
            _label, _fn, args, runtime = entry
            if runtime is rt:
                return False
            return not (args and getattr(args[0], "glet", None) in dead)

        world.ready = collections.deque(e for e in world.ready if alive(e))
        for pool in rt._pools:
            pool._tasks.clear()
            pool.closed = True
        rt.closed = True
        for fileobj in list(rt._mine):
            world.unwatch(fileobj)

    # ------------------------------------------------------------------ what is left, per-step checks
    def leftovers(self, node: Node) -> dict:
        # IoLoop.close runs what was queued before the stop (closing sockets); SimRuntime.close leaves
        # those calls on the world's queue: let them run before looking
        self._settle()
        out = super().leftovers(node)
        rt = self.runtimes.get(node.process)
        if rt is not None:
            out["runtime_threads"] = rt.threads()
            out["runtime_watched"] = rt.watched()
            out["open_sockets"] = sum(1 for s in self.sockets.get(node.process, []) if not s.closed)
            out["open_listeners"] = sum(1 for s in self.servers.get(node.process, []) if not s.closed)
        # asked once, after the engine's finalize: the process is gone now
        self.runtimes.pop(node.process, None)
        self.sockets.pop(node.process, None)
        for server in self.servers.pop(node.process, []):
            self.listener_owner.pop(server.getsockname(), None)
        return out

    def check(self, record: Record) -> None:
        failures = self.world.failures
        for label, exc in failures[self._failures_seen:]:
            if any(label.startswith((name + ":", name + "-")) for name in self.crashed_names):
                continue   # a fiber of a crashed process woke after its death: no engine of the run
            record.add("engine_failure", f"{label} raised {type(exc).__name__}: {exc}")
        self._failures_seen = len(failures)
        for proc, socks in self.sockets.items():
            if any(s.closed for s in socks):
                socks[:] = [s for s in socks if not s.closed]
            for s in socks:
                if len(s.rx) > GROWTH_BOUND:
                    record.add("bounded_growth", f"{proc}: a socket holds {len(s.rx)} unread bytes")

    def trace_hash(self) -> str:
        return self.world.trace_hash()

    def close(self) -> None:
        world_module.MAX_STEPS_PER_INSTANT = self._max_instant
        super().close()
