"""Proof that the simulator finds bugs (issue 38 point 7): each plausible bug of tests/sim/mutations.py,
planted in a copy of llmdd, is reported within 200 seeds.

Slow (one ``llmdd sim --runs 200`` per mutation at most; most are found in the first few seeds): the
slow step of .ci/run runs it (``pytest -m slow``), not the default suite.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_spec = importlib.util.spec_from_file_location("sim_mutations", pathlib.Path(__file__).resolve().parent / "mutations.py")
assert _spec is not None and _spec.loader is not None
mutations = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("sim_mutations", mutations)
_spec.loader.exec_module(mutations)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=[m.name for m in mutations.MUTATIONS])
def test_the_simulator_reports_the_planted_bug_within_200_seeds(m, tmp_path):
    tree = mutations.mutated_tree(m, tmp_path)
    seed, violations, out = mutations.hunt(tree, m.faults, seeds=200, timeout=1400)
    assert seed is not None, f"{m.name} ({m.why}) not reported in 200 seeds:\n{out[-2000:]}"
    assert violations, out[-2000:]
