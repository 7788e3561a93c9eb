"""The cluster simulator (issue 38 points 2-8): traces, the command, the shrinker, the regression seeds.

Every run here is whole engines on one simulated world (``llmdd.testing.sim``, the ``sim`` backend)
with the ``sim`` transport plugin: deterministic, one thread, a fake clock.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from llmdd.testing.sim.faults import FAULTS, parse_faults
from llmdd.testing.sim.invariants import INVARIANTS, Violation
from llmdd.testing.sim.runner import Config, Result, replay_command, run, summary_line
from llmdd.testing.sim.shrink import shrink

pytestmark = pytest.mark.timeout(600)

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("sim_mutations", HERE / "mutations.py")
assert _spec is not None and _spec.loader is not None
mutations = importlib.util.module_from_spec(_spec)
sys.modules["sim_mutations"] = mutations
_spec.loader.exec_module(mutations)

LAST_LINE = re.compile(r"sim seed=(\d+) engines=(\d+) ops=(\d+) faults=(\S+) violations=(\d+) trace=([0-9a-f]{64})")

#: seeds that once failed (a bug of llmdd or of the simulator, fixed since): (config, what it found).
#: Each must now run clean.  docs/simulation.md, "Bugs it found", lists them.
REGRESSIONS = [
    (Config(seed=103, engines=5, ops=300, faults=parse_faults("all")),
     "simulator: a crashed process's queued pool task still started after the crash (crash now drops "
     "its queued work and never resumes its fibers)"),
    (Config(seed=215, engines=5, ops=300, faults=parse_faults("all")),
     "simulator: World.settle() with a timer due at the current instant woke its waiter for ever (a livelock "
     "reported as 'progress'); the backend now lets due timers run instead"),
    (Config(seed=6039, engines=4, ops=100, faults=parse_faults("all")),
     "oracle: a step of a non-blocking pull already running started during its engine's finalize, which is "
     "legal (finalize waits for it); only a queued non-blocking task must not start"),
]


def test_the_same_arguments_give_the_same_trace_and_another_seed_another():
    config = Config(seed=5, engines=4, ops=150, faults=parse_faults("all"))
    first = run(config)
    second = run(config)
    assert first.ok and second.ok, (first.violations, second.violations)
    assert len(first.trace) == 64
    assert first.trace == second.trace
    assert first.ops_done == second.ops_done and first.outcomes == second.outcomes
    # the run did real work: transfers succeeded and some failed under the faults
    assert first.outcomes.get("pull_blocks ok", 0) > 0, first.outcomes
    # the control: another seed draws other operations and faults, so another trace
    other = run(Config(seed=6, engines=4, ops=150, faults=parse_faults("all")))
    assert other.trace != first.trace


def test_every_fault_mix_runs_clean_on_the_correct_engine():
    for i, fault in enumerate(FAULTS):
        result = run(Config(seed=40 + i, engines=3, ops=80, faults=(fault,)))
        assert result.ok, (fault, [str(v) for v in result.violations])
        assert result.steps == 80


def _cli(*args: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmdd", "sim", *args], capture_output=True, text=True,
                          timeout=500, env=env, cwd=cwd)


def test_the_command_ends_with_its_summary_line_and_exits_0_without_violation():
    proc = _cli("--seed", "3", "--engines", "3", "--ops", "60", "--faults", "xfail,crash")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    m = LAST_LINE.fullmatch(last)
    assert m is not None, last
    assert m.group(1, 2, 3, 4, 5) == ("3", "3", "60", "crash,xfail", "0")
    # the same command again: the same trace
    again = _cli("--seed", "3", "--engines", "3", "--ops", "60", "--faults", "xfail,crash")
    assert again.stdout.strip().splitlines()[-1] == last


def test_a_planted_bug_fails_the_command_with_its_seed_and_a_replay_command(tmp_path):
    """The control: the same command over a copy of llmdd whose failed batches count as successes."""
    m = next(m for m in mutations.MUTATIONS if m.name == "completion_error_ignored")
    tree = mutations.mutated_tree(m, tmp_path)
    seed, violations, out = mutations.hunt(tree, "xfail,xpartial", seeds=50)
    assert seed is not None, out[-2000:]
    assert violations and all(re.match(r"violation \[\w+\] step \d+: ", v) for v in violations)
    replay = re.search(r"^replay: (llmdd sim .*)$", out, re.M)
    assert replay is not None
    assert replay.group(1) == f"llmdd sim --seed {seed} --engines 4 --ops 150 --faults xfail,xpartial"
    last = LAST_LINE.fullmatch(out.strip().splitlines()[-1])
    assert last is not None and last.group(1) == str(seed) and int(last.group(5)) == len(violations)
    # the replay command on the same tree fails the same way (exit 1, the same last line)
    env = dict(__import__("os").environ, PYTHONPATH=str(tree))
    again = _cli(*replay.group(1).split()[2:], env=env, cwd=str(tree))
    assert again.returncode == 1
    assert again.stdout.strip().splitlines()[-1] == out.strip().splitlines()[-1]


def test_bad_arguments_are_refused():
    assert _cli("--faults", "meteor").returncode == 2
    assert _cli("--engines", "1").returncode == 2


def test_the_shrinker_finds_a_shorter_run_that_violates_the_same_invariant():
    """On a model runner: a run fails iff it has >= 3 engines, >= 37 ops and the crash fault."""
    calls = []

    def model(c: Config) -> Result:
        calls.append(c)
        bad = c.engines >= 3 and c.ops >= 37 and "crash" in c.faults
        v = [Violation("task_once", min(c.ops, 37), "model")] if bad else []
        other = [Violation("call_deadline", 1, "model")] if c.engines == 4 and not bad else []
        return Result(c, v + other, "0" * 64, min(c.ops, 37) if bad else c.ops, {}, 0.0)

    start = model(Config(seed=9, engines=8, ops=500, faults=("crash", "latency", "xfail")))
    small = shrink(start, runner=model, budget=100)
    assert small.config.engines == 3 and small.config.ops == 37 and small.config.faults == ("crash",)
    assert small.config.seed == 9
    assert small.violations[0].invariant == "task_once"
    assert replay_command(small.config).startswith("llmdd sim --seed 9 --engines 3 --ops 37 --faults crash")
    with pytest.raises(ValueError):
        shrink(model(Config(seed=1, engines=2, ops=5)), runner=model)


def test_every_mutation_applies_once_and_names_known_faults(tmp_path):
    assert len(mutations.MUTATIONS) >= 10
    assert len({m.name for m in mutations.MUTATIONS}) == len(mutations.MUTATIONS)
    for m in mutations.MUTATIONS:
        parse_faults(m.faults)
        text = (mutations.ROOT / m.path).read_text()
        assert text.count(m.old) == 1, m.name
    assert set(INVARIANTS) >= {"call_deadline", "task_once", "bytes_delivered", "no_late_landing",
                               "no_success_after_revocation", "tags_once_in_order", "lifecycle_paths",
                               "statistics_agree", "nothing_left", "bounded_growth"}


@pytest.mark.parametrize("config,why", REGRESSIONS, ids=[f"seed{c.seed}" for c, _ in REGRESSIONS])
def test_regression_seed_runs_clean(config, why):
    result = run(config)
    assert result.ok, (why, [str(v) for v in result.violations], replay_command(config))
    assert LAST_LINE.fullmatch(summary_line(result))


def test_the_soak_mode_runs_seeds_until_its_time_is_up():
    proc = _cli("--seed", "20", "--engines", "3", "--ops", "30", "--minutes", "0.001")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"seed 20: 0 violations, 30 steps, [0-9.]+s", lines[0]), lines
    assert re.fullmatch(r"soak: \d+ runs, seeds 20\.\.\d+, no violation", lines[-2]), lines
    last = LAST_LINE.fullmatch(lines[-1])
    assert last is not None and last.group(5) == "0"
