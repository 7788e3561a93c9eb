"""llmdd transport ``sim``: one-sided transfers between the simulated processes of llmdd's cluster simulator.

The simulator (``llmdd.testing.sim``, docs/simulation.md) runs many real engines in one Python process
on a simulated clock.  This transport is how their bytes move: an endpoint belongs to one simulated
process (engine option ``llmdd.sim.process``) of one :class:`Fabric` (``llmdd.sim.fabric``, default
``"default"``); a batch is checked when submitted and lands (``ctypes.memmove`` between the processes'
memories) at a timer of the fabric's clock, after a drawn latency, unless its deadline, a cancel, a
deregistration, a crash, a partition or a frozen owner stops it first (:mod:`llmdd_sim._endpoint`).
Its own faults (:class:`TransportFaults`: a failed batch, a late one, a partial one, a duplicated
landing) are drawn from the fabric's seeded rng, so a seed replays them.

Trust level: the simulated world.  It moves bytes only inside one Python process, so ``probe()`` says
it is unavailable unless a fabric is installed in this process (:func:`install`): an engine of a real
deployment never offers it.  ``priority`` is the lowest of every transport: it is used where forced
(``llmdd.transport=sim``, what the simulator sets).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from llmdd.abc import Transport, TransportInfo
from llmdd.lowlevel import PeerGone
from llmdd.plugin import hookimpl

from llmdd_sim._endpoint import SimChannel, SimCompletion, SimEndpoint
from llmdd_sim._fabric import Clock, Fabric, RealClock, TransportFaults, fabric, install, installed, uninstall

__all__ = ["SimTransport", "SimEndpoint", "SimChannel", "SimCompletion", "Fabric", "Clock", "RealClock",
           "TransportFaults", "install", "uninstall", "fabric", "installed", "llmdd_register_transports"]


class SimTransport(Transport):
    """Endpoints on the fabric named by ``llmdd.sim.fabric``, as the process ``llmdd.sim.process``."""

    name = "sim"
    priority = 0
    same_host_only = False
    authenticates = False   # the trust boundary is the simulated world (one Python process)

    @classmethod
    def probe(cls) -> TransportInfo:
        if not installed():
            return TransportInfo(name=cls.name, available=False,
                                 reason="no simulated fabric in this process (llmdd.testing.sim installs one; "
                                        "docs/simulation.md)")
        return TransportInfo(name=cls.name, available=True)

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)
        self.fabric_name = str(self.options.get("llmdd.sim.fabric", "default"))
        self.process = str(self.options.get("llmdd.sim.process", "p0"))

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Optional[bytes] = None) -> SimEndpoint:
        f = fabric(self.fabric_name)
        if f is None:
            raise PeerGone(f"no sim fabric {self.fabric_name!r} is installed in this process")
        return SimEndpoint(f, self.process)


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(SimTransport)
