"""Deterministic simulation of llmdd engines: one thread, a fake clock, in-memory sockets and memory.

The engine does not know it is simulated: its composition root takes a
:class:`~llmdd._runtime.runtime.Runtime` (docs/simulation.md, "The runtime seam"), and here that is a
:class:`SimRuntime` on a :class:`World`:

* :class:`World`: the one scheduler (FIFO), clock (moves only when nothing can run), seeded
  ``random.Random`` and network of a run, and :meth:`World.trace_hash` over its steps;
* :class:`SimRuntime`: one simulated process's runtime (loop callbacks, timers, pools, workers,
  events, locks, conditions, sockets), every concurrency of its engine a step of the world;
* :class:`SimProcess`: a whole engine (``LLMDataDist``) on its own runtime, with the world's
  in-memory ``sim`` transport (:mod:`llmdd.testing.sim.transport`).

Needs the ``greenlet`` package (``pip install 'llmdd[sim]'``): the workers are greenlets of the one
thread, switched only where they wait on a primitive of the world.
"""

from llmdd.testing.sim.engines import SimProcess, sim_plugin
from llmdd.testing.sim.net import SimServerSocket, SimSocket
from llmdd.testing.sim.runtime import SimPool, SimRuntime
from llmdd.testing.sim.world import (
    Fiber, SimCondition, SimEvent, SimLocal, SimLock, SimRLock, Stuck, World,
)

__all__ = [
    "World", "Stuck", "Fiber", "SimRuntime", "SimPool", "SimProcess", "sim_plugin",
    "SimEvent", "SimLock", "SimRLock", "SimCondition", "SimLocal", "SimSocket", "SimServerSocket",
]
