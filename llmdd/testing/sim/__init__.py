"""Deterministic simulation of llmdd engines: one thread, a fake clock, in-memory sockets and memory.

The engine does not know it is simulated: its composition root takes a
:class:`~llmdd._runtime.runtime.Runtime` (docs/simulation-runtime.md, "The runtime seam"), and here that is a
:class:`SimRuntime` on a :class:`World`:

* :class:`World`: the one scheduler (FIFO), clock (moves only when nothing can run), seeded
  ``random.Random`` and network of a run, and :meth:`World.trace_hash` over its steps;
* :class:`SimRuntime`: one simulated process's runtime (loop callbacks, timers, pools, workers,
  events, locks, conditions, sockets), every concurrency of its engine a step of the world;
* :class:`Network` (``world.net``): in-memory stream sockets between the processes, with the hooks
  of network faults (per-message latency, loss, duplication, cuts, partitions that heal, a process
  that stops reading); :meth:`World.freeze` / :meth:`World.thaw` stop and resume a process as
  SIGSTOP / SIGCONT would, :meth:`SimRuntime.crash` kills one (all its state lost);
* :class:`SimProcess`: a whole engine (``LLMDataDist``) on its own runtime, with the world's
  in-memory ``sim`` transport (:mod:`llmdd.testing.sim.transport`), that can crash and restart as
  a new incarnation.

Needs the ``greenlet`` package (``pip install 'llmdd[sim]'``): the workers are greenlets of the one
thread, switched only where they wait on a primitive of the world.
"""

from llmdd.testing.sim.engines import SimProcess, sim_plugin
from llmdd.testing.sim.net import Network, SimServerSocket, SimSocket
from llmdd.testing.sim.runtime import SimPool, SimRuntime
from llmdd.testing.sim.primitives import SimCondition, SimEvent, SimLocal, SimLock, SimRLock
from llmdd.testing.sim.world import Fiber, Stuck, World

__all__ = [
    "World", "Stuck", "Fiber", "SimRuntime", "SimPool", "SimProcess", "sim_plugin",
    "SimEvent", "SimLock", "SimRLock", "SimCondition", "SimLocal", "Network", "SimSocket", "SimServerSocket",
]
