"""The faults of a run: which ones (``--faults``), and when each strikes (drawn from the run's seed).

Network faults act on the simulated network between the engines (the control plane's connections);
process faults on a simulated process; transport faults on the ``sim`` transport's batches (its
:class:`llmdd_sim.TransportFaults`, drawn per batch from the fabric's seeded rng).

=============  ==========================================================================================
name           what happens
=============  ==========================================================================================
latency        every message between two processes takes a latency drawn per message (a long-tailed
               distribution: mostly ~0.1-1 ms, sometimes 10-100 ms)
loss           a message is lost on the wire; over a stream connection that is a retransmission: the
               message (and what follows it, in order) arrives one retransmission timeout later
dup            a message is duplicated on the wire; a stream connection drops the copy, so it shows only
               on the transport's batches (a landing delivered twice: the second must land nowhere)
reorder        messages on different connections overtake each other (per-connection delays); on the
               transport, batches complete out of submission order
cut            one connection goes silent for good (what is sent is lost, nothing is closed)
partition      two groups of processes cannot reach each other for a while, then the partition heals
stall          a process stops reading its connections for a while (its peers' output backs up)
freeze         a process stops entirely for a while (as under SIGSTOP): it serves and answers nothing
crash          a process dies (all its state lost) and usually restarts later as a new incarnation
xfail          the transport fails a batch (PeerGone or Corrupt); nothing of it lands
xlate          the transport completes a batch after its deadline (the deadline fails it first)
xpartial       the transport lands a prefix of a batch's ops, then fails it
xdup           the transport delivers a batch's landing twice
=============  ==========================================================================================
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from llmdd.testing.sim.backends import Backend
    from llmdd.testing.sim.workload import Workload

__all__ = ["FAULTS", "FaultPlan", "parse_faults"]

FAULTS = ("latency", "loss", "dup", "reorder", "cut", "partition", "stall", "freeze", "crash",
          "xfail", "xlate", "xpartial", "xdup")

#: the per-step chance that an episodic fault strikes (one process or connection, for a while)
EPISODE_P = {"cut": 0.01, "partition": 0.02, "stall": 0.02, "freeze": 0.02}
#: how long an episode lasts, seconds on the simulated clock (drawn uniformly)
EPISODE_S = (0.2, 4.0)


def parse_faults(text: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")`` (sorted, unique); ``"all"``: every fault; ``""``/``"none"``: none."""
    if text in ("", "none"):
        return ()
    names = FAULTS if text == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    return tuple(sorted(set(names)))


class FaultPlan:
    """Which faults a run has, and a seeded schedule of the episodic ones (one draw per step)."""

    def __init__(self, faults: Sequence[str], *, seed: int, processes: Sequence[str]) -> None:
        self.faults = tuple(faults)
        self.rng = random.Random(f"faults-{seed}")
        self.processes = list(processes)
        self.episodes: list[tuple[int, str, str]] = []

    @classmethod
    def parse(cls, faults: Iterable[str], *, seed: int, processes: Sequence[str]) -> "FaultPlan":
        return cls(parse_faults(",".join(faults)), seed=seed, processes=processes)

    def has(self, name: str) -> bool:
        return name in self.faults

    def transport(self) -> dict:
        """The sim transport's fault probabilities (per batch) for this plan."""
        out = {}
        if self.has("xfail"):
            out["fail"] = 0.03
        if self.has("xlate"):
            out["late"] = 0.02
        if self.has("xpartial"):
            out["partial"] = 0.02
        if self.has("xdup") or self.has("dup"):
            out["duplicate"] = 0.05
        if self.has("reorder"):
            out["jitter_s"] = 2e-3
        return out

    def tick(self, backend: Backend, workload: Workload, step: int) -> None:
        """Maybe start an episode now (one draw per episodic fault, in a fixed order)."""
        for name in ("cut", "partition", "stall", "freeze"):
            if not self.has(name) or self.rng.random() >= EPISODE_P[name]:
                continue
            seconds = self.rng.uniform(*EPISODE_S)
            if name == "cut":
                what = backend.cut_connection(self.rng)
            elif name == "partition":
                procs = list(self.processes)
                self.rng.shuffle(procs)
                k = self.rng.randint(1, max(1, len(procs) // 2))
                what = backend.partition(procs[:k], procs[k:], seconds)
            elif name == "stall":
                what = backend.stall(self.rng.choice(self.processes), seconds)
            else:
                what = backend.freeze(self.rng.choice(self.processes), seconds)
            self.episodes.append((step, name, what))

    def heal(self, backend: Backend) -> None:
        """End every episode (before the run's final finalize)."""
        backend.heal()
