"""Whole llmdd engines on a simulated world: :class:`SimProcess` and the ``sim`` transport plugin.

A :class:`SimProcess` is one simulated process: its :class:`~llmdd.testing.sim.runtime.SimRuntime`
and its engine, an ordinary :class:`llmdd.LLMDataDist` built on that runtime
(:func:`llmdd._api.datadist.use_runtime`) with the in-memory transport of the world registered
through the ordinary plugin hook.  The test drives the engine through the public API from the
world's main fiber; every wait inside it lets the rest of the world run.
"""

from __future__ import annotations

from typing import Any, Optional, cast

from llmdd import LLMDataDist, LLMRole
from llmdd._api.datadist import use_runtime
from llmdd._runtime.runtime import Runtime
from llmdd.plugin import hookimpl
from llmdd.testing.sim.runtime import SimRuntime
from llmdd.testing.sim.transport import NAME, transport_for
from llmdd.testing.sim.world import World

__all__ = ["SimProcess", "sim_plugin"]


class _SimTransportPlugin:
    """Registers the world's in-memory transport (``llmdd_register_transports``)."""

    def __init__(self, world: World) -> None:
        self._cls = transport_for(world)

    @hookimpl
    def llmdd_register_transports(self, register: Any) -> None:
        register(self._cls)


def sim_plugin(world: World) -> Any:
    """A plugin object that contributes ``world``'s in-memory transport (named ``sim``)."""
    return _SimTransportPlugin(world)


class SimProcess:
    """One simulated process of ``world``: a runtime and the engine on it (not yet initialized)."""

    def __init__(self, world: World, role: LLMRole, cluster_id: int, *, name: Optional[str] = None,
                 workers: int = 8) -> None:
        self.world = world
        self.cluster_id = cluster_id
        self.runtime = SimRuntime(world, name or f"e{cluster_id}", workers=workers)
        self.dd = LLMDataDist(role, cluster_id)
        use_runtime(self.dd, cast(Runtime, self.runtime))   # in-memory sockets, not socket.socket
        self.dd.add_plugin(sim_plugin(world), name=f"llmdd-sim-transport-{cluster_id}")

    def init(self, options: dict) -> None:
        """``init`` with ``options`` and the ``sim`` transport forced (``llmdd.transport``)."""
        self.dd.init({**options, "llmdd.transport": NAME})

    def finalize(self) -> None:
        self.dd.finalize()
