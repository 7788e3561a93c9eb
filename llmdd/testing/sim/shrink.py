"""The shrinker: a failing run made shorter (fewer engines, operations, faults, kinds of operation).

A run is a function of its :class:`~llmdd.testing.sim.runner.Config` (the seed decides everything), so
shrinking searches configs, keeping the seed: halve the operations (then trim them to the step the
violation was found at), drop engines, drop faults one at a time, drop operation kinds from the mix one at
a time.  A candidate is kept when it still violates *the same invariant*; the search ends when no
candidate does, or after ``budget`` runs.  What it returns replays with
:func:`~llmdd.testing.sim.runner.replay_command`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import attrs

from llmdd.testing.sim.runner import Config, Result, run
from llmdd.testing.sim.workload import OPS

__all__ = ["shrink"]


def _candidates(c: Config, failed_at: int) -> Iterator[Config]:
    if failed_at < c.ops:
        yield attrs.evolve(c, ops=max(1, failed_at))
    if c.ops > 1:
        yield attrs.evolve(c, ops=max(1, c.ops // 2))
    for engines in sorted({2, c.engines // 2, c.engines - 1}):
        if 2 <= engines < c.engines:
            yield attrs.evolve(c, engines=engines)
    for f in c.faults:
        yield attrs.evolve(c, faults=tuple(x for x in c.faults if x != f))
    mix = dict(c.mix) if c.mix is not None else {k: v for k, v in OPS.items() if k != "crash" or "crash" in c.faults}
    if len(mix) > 1:
        for op in sorted(mix):
            yield attrs.evolve(c, mix=tuple(sorted((k, v) for k, v in mix.items() if k != op)))


def shrink(result: Result, *, budget: int = 60, runner: Callable[[Config], Result] = run,
           progress: Optional[Callable[[Result], None]] = None) -> Result:
    """The smallest failing run found from ``result`` (a failing one) within ``budget`` runs."""
    if result.ok:
        raise ValueError("shrink: the run has no violation")
    want = result.violations[0].invariant
    best = result
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for cand in _candidates(best.config, best.steps):
            if runs >= budget:
                break
            runs += 1
            got = runner(cand)
            if any(v.invariant == want for v in got.violations):
                best = got
                improved = True
                if progress is not None:
                    progress(got)
                break
    return best
