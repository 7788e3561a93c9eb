"""The sim transport against llmdd's transport conformance suite, on real time (its RealClock).

Every check runs but one: ``check_two_processes`` needs a peer endpoint in another OS process, and
the sim transport moves bytes only between the simulated processes of one Python process (its trust
boundary; docs/simulation.md).  The stalled-peer part of ``check_deadline`` runs with a frozen owner
process (``Fabric.freeze``, what a SIGSTOP'ed peer does in the simulator)."""

from __future__ import annotations

import contextlib
import functools
import itertools

import pytest

import llmdd_sim
from llmdd.testing import CONFORMANCE_CHECKS, run_check

pytestmark = pytest.mark.timeout(120)

_names = itertools.count()


@pytest.fixture
def fab():
    f = llmdd_sim.install(llmdd_sim.Fabric(name="default", seed=1))
    yield f
    llmdd_sim.uninstall("default")


def make_pair():
    t = llmdd_sim.SimTransport({})
    a = llmdd_sim.SimTransport({"llmdd.sim.process": f"a{next(_names)}"}).open_endpoint()
    b = llmdd_sim.SimTransport({"llmdd.sim.process": f"b{next(_names)}"}).open_endpoint()
    del t
    return a, b


@contextlib.contextmanager
def stall(ep):
    ep.fabric.freeze(ep.process)
    try:
        yield
    finally:
        ep.fabric.thaw(ep.process)


RUNS = [c for c in CONFORMANCE_CHECKS if c.__name__ != "check_two_processes"]


@pytest.mark.parametrize("check", RUNS, ids=lambda c: c.__name__)
def test_conformance(fab, check):
    run_check(check, make_pair, stall=stall, transport=functools.partial(llmdd_sim.SimTransport, {}))


def test_two_processes_is_the_one_check_left_out():
    assert {c.__name__ for c in CONFORMANCE_CHECKS} - {c.__name__ for c in RUNS} == {"check_two_processes"}


def test_probe_says_unavailable_without_a_fabric():
    assert not llmdd_sim.installed()
    info = llmdd_sim.SimTransport.probe()
    assert not info.available and "no simulated fabric" in info.reason
