"""One simulation run: engines, workload, faults and the invariants after every step; its trace hash.

:func:`run` builds a backend (:class:`~llmdd.testing.sim.backends.SimBackend`: every engine on the
simulated runtime, network and ``sim`` transport of one seeded world, deterministic;
:class:`~llmdd.testing.sim.backends.RealBackend`: real engines on their own I/O loops and the ``sim``
transport on real time, for the simulator's own tests), starts ``engines`` engines, runs ``ops`` workload
steps with the fault plan applied between them, checks every invariant after each step, finalizes every
engine and checks again.  The run stops at the first step with a violation.  Its
:attr:`Result.trace` is a SHA-256 over everything the run did and saw (the operations, each call's
status, every lifecycle event, the world's own step trace): the same arguments give the same hash.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import attrs

from llmdd.testing.sim.faults import FaultPlan
from llmdd.testing.sim.invariants import Record, Violation, check_final, check_step
from llmdd.testing.sim.oracle import Oracle
from llmdd.testing.sim.workload import BLOCK_BYTES, OPS, Workload

__all__ = ["Config", "Result", "run", "summary_line", "replay_command"]


@attrs.frozen
class Config:
    seed: int
    engines: int = 4
    ops: int = 200
    faults: tuple[str, ...] = ()
    backend: str = "sim"
    #: the workload's operations and weights (None: the default mix); the shrinker narrows it
    mix: Optional[tuple[tuple[str, int], ...]] = None


@attrs.define
class Result:
    config: Config
    violations: list[Violation]
    trace: str
    steps: int
    ops_done: dict[str, int]
    sim_seconds: float
    #: "op status" -> how many calls ended so
    outcomes: dict[str, int] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


def _hash_events(h: hashlib._Hash, record: Record, start: int) -> int:
    for engine, inc, ev in record.events[start:]:
        h.update(f"e{engine}.{inc} {ev.machine.value} {ev.id!r} {ev.trigger} {ev.source.value}>{ev.dest.value}"
                 f" {type(ev.error).__name__ if ev.error is not None else ''}\n".encode())
    return len(record.events)


def run(config: Config) -> Result:
    from llmdd.testing.sim.backends import make_backend

    record = Record()
    oracle = Oracle(record, BLOCK_BYTES)
    backend = make_backend(config, oracle)
    h = hashlib.sha256(f"{config}\n".encode())
    ops_done: dict[str, int] = {}
    seen_events = 0
    seen_calls = 0
    steps = 0
    try:
        plan = FaultPlan.parse(config.faults, seed=config.seed,
                               processes=[f"e{i + 1}" for i in range(config.engines)])
        mix = dict(config.mix) if config.mix is not None else dict(OPS)
        if not plan.has("crash"):
            mix.pop("crash", None)
        workload = Workload(backend, record, oracle, engines=config.engines, seed=config.seed, ops=mix)
        oracle.nodes = {n.cid: n for n in workload.nodes}
        backend.apply_transport_faults(plan)
        workload.start_all()
        extra = (oracle.check, backend.check)
        check_step(record, extra)
        for k in range(config.ops):
            if record.violations:
                break
            record.step = k + 1
            steps = k + 1
            plan.tick(backend, workload, record.step)
            try:
                op = workload.step()
            except Exception as exc:  # noqa: BLE001 - only the world's Stuck is a finding; the rest re-raises
                if type(exc).__name__ != "Stuck":
                    raise
                record.add("progress", f"{exc}")
                op = "stuck"
            ops_done[op] = ops_done.get(op, 0) + 1
            h.update(f"{k} {op}\n".encode())
            check_step(record, extra)
            for call in record.calls[seen_calls:]:
                h.update(f"{call.engine} {call.op} {call.args} {call.status} {call.ended is not None}\n".encode())
            seen_calls = len(record.calls)
            seen_events = _hash_events(h, record, seen_events)
        if not record.violations:
            record.step = config.ops + 1
            plan.heal(backend)
            try:
                workload.finish()
            except Exception as exc:  # noqa: BLE001 - as above
                if type(exc).__name__ != "Stuck":
                    raise
                record.add("progress", f"at the final finalize: {exc}")
            check_final(record, extra)
        seen_events = _hash_events(h, record, seen_events)
        h.update(backend.trace_hash().encode())
        outcomes: dict[str, int] = {}
        for call in record.calls:
            what = f"{call.op} {call.status}"
            outcomes[what] = outcomes.get(what, 0) + 1
        return Result(config, list(record.violations), h.hexdigest(), steps, ops_done, backend.elapsed(), outcomes)
    finally:
        backend.close()


def fault_names(config: Config) -> str:
    return ",".join(config.faults) if config.faults else "none"


def summary_line(result: Result) -> str:
    c = result.config
    return (f"sim seed={c.seed} engines={c.engines} ops={c.ops} faults={fault_names(c)} "
            f"violations={len(result.violations)} trace={result.trace}")


def replay_command(config: Config) -> str:
    cmd = f"llmdd sim --seed {config.seed} --engines {config.engines} --ops {config.ops}"
    if config.faults:
        cmd += f" --faults {','.join(config.faults)}"
    if config.backend != "sim":
        cmd += f" --backend {config.backend}"
    if config.mix is not None:
        cmd += " --mix " + ",".join(f"{o}:{w}" for o, w in config.mix)
    return cmd
