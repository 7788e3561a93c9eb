"""The simulator's fixed seeds, a bounded step of .ci/run: 300 runs across six fault mixes.

``python tests/sim/run_seeds.py`` runs every (mix, seed) of :data:`SEEDS` in this process (whole
engines on one simulated world each, ``llmdd.testing.sim``), prints the replay command of each failing
run and a last line ``sim-seeds runs=R failed=F seconds=S``; exit status 0 iff F is 0.  The list is
fixed so that a failure is a change of llmdd (or of the simulator), never a new draw.
"""

from __future__ import annotations

import sys
import time

from llmdd.testing.sim.faults import parse_faults
from llmdd.testing.sim.runner import Config, replay_command, run

ENGINES = 4
OPS = 80
#: (faults, first seed, runs): 6 mixes x 50 seeds
MIXES = [
    ("none", 1000, 50),
    ("latency,loss,reorder,dup", 2000, 50),
    ("crash", 3000, 50),
    ("xfail,xlate,xpartial,xdup", 4000, 50),
    ("freeze,stall,partition,cut", 5000, 50),
    ("all", 6000, 50),
]
SEEDS = [(faults, seed) for faults, first, n in MIXES for seed in range(first, first + n)]


def main() -> int:
    t0 = time.monotonic()
    failed = 0
    for faults, seed in SEEDS:
        config = Config(seed=seed, engines=ENGINES, ops=OPS, faults=parse_faults(faults))
        result = run(config)
        if not result.ok:
            failed += 1
            print(f"FAILED {result.violations[0]}", flush=True)
            print(f"  replay: {replay_command(config)}", flush=True)
    print(f"sim-seeds runs={len(SEEDS)} failed={failed} seconds={time.monotonic() - t0:.0f}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
