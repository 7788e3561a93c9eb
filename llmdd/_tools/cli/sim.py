"""``llmdd sim``: run the deterministic cluster simulator (docs/simulation.md).

``llmdd sim --seed S --engines N --ops K [--faults LIST] [--minutes M] [--shrink]``: N engines on one
simulated world, K workload steps, the named invariants checked after each.  The last line is exactly
``sim seed=S engines=N ops=K faults=F violations=V trace=<64 hex digits>``; the exit status is 0 iff V is
0.  A failing run prints each violation, its seed and the command that replays it (and, with
``--shrink``, the shortest failing run the shrinker found).  ``--runs R`` runs seeds S .. S+R-1 and
``--minutes M`` (the soak mode) seeds S, S+1, ... until M minutes passed; either stops at the first failing
run, and the last line is the last run's.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (decides everything; default 0)")
    parser.add_argument("--engines", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument("--ops", type=int, default=200, help="workload steps (default 200)")
    parser.add_argument("--faults", default="none",
                        help="comma-separated faults, 'all' or 'none' (default): latency, loss, dup, reorder, cut, "
                             "partition, stall, freeze, crash, xfail, xlate, xpartial, xdup")
    parser.add_argument("--minutes", type=float, default=None,
                        help="soak: run seeds from --seed on until this many minutes passed or one fails")
    parser.add_argument("--runs", type=int, default=1,
                        help="run seeds --seed .. --seed+RUNS-1, stopping at the first failing one (default 1)")
    parser.add_argument("--shrink", action="store_true", help="on a failure, shrink it and print the shortest run")
    parser.add_argument("--backend", choices=("sim", "real"), default="sim",
                        help="sim (default): the simulated world, deterministic; real: real I/O loops (not "
                             "deterministic; the simulator's own tests)")
    parser.add_argument("--mix", default=None, help="the workload's operations and weights, op:weight,... "
                        "(what the shrinker prints; default: every operation)")


def run(args: argparse.Namespace) -> int:
    from llmdd.testing.sim.faults import parse_faults
    from llmdd.testing.sim.runner import Config, replay_command, run as run_sim, summary_line

    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        print(f"llmdd sim: {exc}", file=sys.stderr)
        return 2
    if args.engines < 2 or args.ops < 0:
        print("llmdd sim: --engines must be at least 2 and --ops at least 0", file=sys.stderr)
        return 2
    mix = None
    if args.mix:
        try:
            mix = tuple(sorted((op, int(w)) for op, w in (item.split(":") for item in args.mix.split(","))))
        except ValueError:
            print(f"llmdd sim: --mix {args.mix!r} is not op:weight,...", file=sys.stderr)
            return 2
    seed = args.seed
    deadline = None if args.minutes is None else time.monotonic() + args.minutes * 60.0
    runs = 0
    while True:
        config = Config(seed=seed, engines=args.engines, ops=args.ops, faults=faults, backend=args.backend, mix=mix)
        t0 = time.monotonic()
        result = run_sim(config)
        runs += 1
        if deadline is not None or args.runs > 1:
            print(f"seed {seed}: {len(result.violations)} violations, {result.steps} steps, "
                  f"{time.monotonic() - t0:.1f}s", flush=True)
        if not result.ok:
            break
        if deadline is None and runs >= args.runs:
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        seed += 1
    if not result.ok:
        for v in result.violations:
            print(f"violation {v}")
        print(f"failing seed: {config.seed}")
        print(f"replay: {replay_command(config)}")
        if args.shrink:
            from llmdd.testing.sim.shrink import shrink
            small = shrink(result)
            print(f"shrunk to: {replay_command(small.config)}  ({small.violations[0]})")
    elif runs > 1 or deadline is not None:
        print(f"{'soak' if deadline is not None else 'runs'}: {runs} runs, seeds {args.seed}..{seed}, no violation")
    print(summary_line(result))
    return 0 if result.ok else 1
