"""Whole llmdd engines on a simulated world: :class:`SimProcess` and the ``sim`` transport plugin.

A :class:`SimProcess` is one simulated process: its :class:`~llmdd.testing.sim.runtime.SimRuntime`
and its engine, an ordinary :class:`llmdd.LLMDataDist` built on that runtime
(:func:`llmdd._api.datadist.use_runtime`) with the in-memory transport of the world registered
through the ordinary plugin hook.  The test drives the engine through the public API from the
world's main fiber; every wait inside it lets the rest of the world run.
"""

from __future__ import annotations

from typing import Optional, cast

from llmdd import LLMDataDist, LLMRole
from llmdd._api.datadist import use_runtime
from llmdd._runtime.runtime import Runtime
from llmdd.plugin import TransportRegistry, hookimpl
from llmdd.testing.sim.runtime import SimRuntime
from llmdd.testing.sim.transport import NAME, transport_for
from llmdd.testing.sim.world import World

__all__ = ["SimProcess", "sim_plugin"]


class _SimTransportPlugin:
    """Registers the world's in-memory transport (``llmdd_register_transports``)."""

    def __init__(self, world: World) -> None:
        self._cls = transport_for(world)

    @hookimpl
    def llmdd_register_transports(self, register: TransportRegistry) -> None:
        register(self._cls)


def sim_plugin(world: World) -> _SimTransportPlugin:
    """A plugin object that contributes ``world``'s in-memory transport (named ``sim``)."""
    return _SimTransportPlugin(world)


class SimProcess:
    """One simulated process of ``world``: a runtime and the engine on it (not yet initialized).

    ``transport`` is the transport the engine is forced to (``llmdd.transport``): ``"sim"``, the
    world's minimal in-memory one registered here, or None to leave the choice to the options (a
    transport plugin of the simulation registered through its entry point)."""

    def __init__(self, world: World, role: LLMRole, cluster_id: int, *, name: Optional[str] = None,
                 workers: int = 8, transport: Optional[str] = NAME) -> None:
        self.world = world
        self.role = role
        self.cluster_id = cluster_id
        self.name = name or f"e{cluster_id}"
        self.workers = workers
        self.transport = transport
        self.options: Optional[dict] = None
        self._build(1)

    def _build(self, incarnation: int) -> None:
        self.runtime = SimRuntime(self.world, self.name, workers=self.workers, incarnation=incarnation)
        self.dd = LLMDataDist(self.role, self.cluster_id)
        use_runtime(self.dd, cast(Runtime, self.runtime))   # in-memory sockets, not socket.socket
        if self.transport == NAME:
            self.dd.add_plugin(sim_plugin(self.world), name=f"llmdd-sim-transport-{self.cluster_id}")

    @property
    def incarnation(self) -> int:
        return self.runtime.incarnation

    def init(self, options: dict) -> None:
        """``init`` with ``options`` (and the transport forced, see the class); kept for :meth:`restart`."""
        self.options = dict(options)
        self.dd.init({**options, "llmdd.transport": self.transport} if self.transport else options)

    def finalize(self) -> None:
        self.dd.finalize()

    def crash(self) -> None:
        """The process dies at once, all its state lost (:meth:`SimRuntime.crash`); ``dd`` is dead."""
        self.runtime.crash()

    def restart(self) -> None:
        """Crash (if not yet) and start the process again: a new runtime (the next incarnation) and a
        new engine of the same cluster id, initialized with the options of the last :meth:`init`."""
        self.crash()
        self._build(self.runtime.incarnation + 1)
        if self.options is not None:
            self.init(self.options)
