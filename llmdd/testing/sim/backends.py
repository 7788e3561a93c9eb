"""Where a run's engines live: the simulated world (deterministic) or real I/O loops (the simulator's tests).

A backend gives the workload engines (``init``), a clock (``now``, ``advance``), the faults it can cause
(``partition``, ``freeze``, ``stall``, ``cut_connection``, ``crash``; ``heal``), what a finalized engine
left behind (``leftovers``) and its own per-step checks (``check``: failures its runtime recorded, growth
of what it buffers).  Both put every engine on the ``sim`` transport (``llmdd.transport=sim``) of one
:class:`llmdd_sim.Fabric`, reached through the ``llmdd`` entry-point group like every transport.
"""

from __future__ import annotations

import hashlib
import socket
import time
from typing import TYPE_CHECKING, Protocol

import llmdd_sim

from llmdd.testing.sim.invariants import Record

if TYPE_CHECKING:
    import random

    from llmdd._api.datadist import LLMDataDist
    from llmdd.testing.sim.faults import FaultPlan
    from llmdd.testing.sim.oracle import Oracle
    from llmdd.testing.sim.runner import Config
    from llmdd.testing.sim.workload import Node

__all__ = ["make_backend", "Backend", "RealBackend"]


class Backend(Protocol):
    """What the workload, the fault plan and the runner ask of a backend (the module docstring):
    :class:`RealBackend` and :class:`~llmdd.testing.sim.simbackend.SimBackend`."""

    can_crash: bool

    def engine_options(self, node: Node) -> dict: ...

    def apply_transport_faults(self, plan: FaultPlan) -> None: ...

    def init(self, node: Node, dd: LLMDataDist, options: dict) -> None: ...

    def now(self) -> float: ...

    def elapsed(self) -> float: ...

    def advance(self, seconds: float) -> None: ...

    def partition(self, a: list, b: list, seconds: float) -> str: ...

    def freeze(self, process: str, seconds: float) -> str: ...

    def stall(self, process: str, seconds: float) -> str: ...

    def cut_connection(self, rng: random.Random) -> str: ...

    def heal(self) -> None: ...

    def crash(self, node: Node) -> None: ...

    def host_of(self, node: Node) -> str: ...

    def nobody_listens(self) -> tuple[str, int]: ...

    def leftovers(self, node: Node) -> dict: ...

    def check(self, record: Record) -> None: ...

    def trace_hash(self) -> str: ...

    def close(self) -> None: ...


def make_backend(config: Config, oracle: Oracle) -> Backend:
    if config.backend == "real":
        return RealBackend(config, oracle)
    if config.backend == "sim":
        from llmdd.testing.sim.simbackend import SimBackend
        return SimBackend(config, oracle)
    raise ValueError(f"unknown backend {config.backend!r} (sim, real)")


class _FabricBackend:
    """What both backends share: the fabric, its faults and the leftovers it can see."""

    can_crash = False

    def __init__(self, config: Config, oracle: Oracle, fabric: llmdd_sim.Fabric) -> None:
        self.config = config
        self.oracle = oracle
        self.fabric = fabric
        fabric.observers.append(oracle.observe)
        llmdd_sim.install(fabric)

    def engine_options(self, node: Node) -> dict:
        return {"llmdd.transport": "sim", "llmdd.sim.fabric": self.fabric.name, "llmdd.sim.process": node.process}

    def apply_transport_faults(self, plan: FaultPlan) -> None:
        for name, value in plan.transport().items():
            setattr(self.fabric.faults, name, value)

    def leftovers(self, node: Node) -> dict:
        eps = [ep for ep in self.fabric.endpoints.values() if ep.process == node.process]
        return {"sim_endpoints": len(eps), "sim_regions": sum(len(ep.regions) for ep in eps),
                "sim_batches": sum(len(ch._inflight) for ep in eps for ch in ep.channels)}

    def close(self) -> None:
        llmdd_sim.uninstall(self.fabric.name)


class RealBackend(_FabricBackend):
    """Real engines (their own I/O loops and threads, real time) on the ``sim`` transport on real time.

    Not deterministic (threads); it exercises the workload, the oracle and the invariants against the
    engine as it runs in production, and it is how the simulator's own tests check that a correct engine
    raises no violation.  It causes the transport's faults and freezes and partitions of the transport
    only (the control plane's sockets are real)."""

    def __init__(self, config: Config, oracle: Oracle) -> None:
        super().__init__(config, oracle, llmdd_sim.Fabric(name=f"real-{config.seed}", seed=config.seed))
        self._t0 = time.monotonic()
        self._partitions: list[tuple[set, set]] = []
        self.fabric.reachable = self._reachable

    def _reachable(self, a: str, b: str) -> bool:
        return not any((a in x and b in y) or (a in y and b in x) for x, y in self._partitions)

    def engine_options(self, node: Node) -> dict:
        return {**super().engine_options(node), "llm.listenIpInfo": f"127.0.0.1:{_free_port()}"}

    def init(self, node: Node, dd: LLMDataDist, options: dict) -> None:
        from llmdd._api.datadist import LLMDataDist
        # one engine per process is the facade's rule; these engines share it, each with its own I/O loop
        LLMDataDist.llm_engine_instance = None
        dd.init(options)

    def now(self) -> float:
        return time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def advance(self, seconds: float) -> None:
        time.sleep(min(seconds, 0.05))   # real time is expensive: a short pause lets the engines' threads run

    def partition(self, a: list, b: list, seconds: float) -> str:
        self._partitions.append((set(a), set(b)))
        return f"transport partition {a} | {b}"

    def freeze(self, process: str, seconds: float) -> str:
        self.fabric.freeze(process)
        self.fabric.clock.call_later(min(seconds, 0.2), self.fabric.thaw, process)
        return f"transport freeze {process}"

    def stall(self, process: str, seconds: float) -> str:
        return self.freeze(process, seconds)

    def cut_connection(self, rng: random.Random) -> str:
        return "no cut on real sockets"

    def heal(self) -> None:
        self._partitions.clear()
        for process in list(self.fabric.frozen):
            self.fabric.thaw(process)

    def crash(self, node: Node) -> None:
        raise RuntimeError("the real backend cannot crash a process (use the sim backend)")

    def host_of(self, node: Node) -> str:
        return "127.0.0.1"

    def nobody_listens(self) -> tuple[str, int]:
        return ("127.0.0.1", _free_port())

    def check(self, record: Record) -> None:
        return None

    def trace_hash(self) -> str:
        return hashlib.sha256(b"real").hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
