"""The snippet runner itself, on fixture pages: a broken block fails the run (the control),
good blocks and pairs pass, markers are parsed strictly, a hung block is killed at its deadline."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _snippets as S  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
pytestmark = pytest.mark.timeout(120)


def _units(name: str) -> list[S.Unit]:
    found, errors = S.collect([FIXTURES / name])
    assert errors == []
    return found


def test_broken_snippet_fails_the_runner(tmp_path):
    (unit,) = _units("broken.md")
    outcome = S.run_unit(unit, tmp_path)
    assert not outcome.ok
    assert "IndexError" in outcome.detail and "exit status 1" in outcome.detail
    assert S.main([str(FIXTURES / "broken.md")]) == 1


def test_good_page_runs_and_lists_its_opt_out(tmp_path, capsys):
    found = _units("good.md")
    assert [(u.id.split(":")[-1], u.skip) for u in found] == [
        ("3", None), ("12", None), ("18", "shows an API that does not exist, on purpose"), ("28+35", None)]
    assert "total = sum(range(10))\n" in found[1].snippets[0].code   # the list indent is removed
    assert found[3].snippets[0].code == 'greeting = "hello"\nassert greeting == "hello"\n'
    for unit in found[:2] + found[3:]:
        outcome = S.run_unit(unit, tmp_path)
        assert outcome.ok, outcome.detail
    assert S.skip_lines(found) == [f"{found[2].snippets[0].page}: shows an API that does not exist, on purpose"]
    assert S.main([str(FIXTURES / "good.md")]) == 0
    assert "skip " in capsys.readouterr().out


def test_pair_runs_both_sides_concurrently(tmp_path):
    (unit,) = _units("pair.md")
    assert [s.role for s in unit.snippets] == ["server", "client"]
    assert unit.id.endswith("pair.md:pair=echo")
    outcome = S.run_unit(unit, tmp_path)
    assert outcome.ok, outcome.detail


def test_pair_fails_when_one_side_fails(tmp_path):
    (unit,) = _units("pair_client_fails.md")
    outcome = S.run_unit(unit, tmp_path)
    assert not outcome.ok
    assert "RuntimeError: the client side fails" in outcome.detail
    assert "role=server" in outcome.detail and "role=client" in outcome.detail


def test_pair_fails_when_the_first_side_never_signals_ready(tmp_path):
    (unit,) = _units("pair_never_ready.md")
    outcome = S.run_unit(unit, tmp_path)
    assert not outcome.ok
    assert "exited before printing its readiness line" in outcome.detail
    assert "never started" not in outcome.detail     # the second side was not run


def test_hung_snippet_is_killed_at_its_deadline(tmp_path):
    (unit,) = _units("hang.md")
    started = time.monotonic()
    outcome = S.run_unit(unit, tmp_path, timeout=3.0)
    assert not outcome.ok and "timed out after 3 s" in outcome.detail
    assert time.monotonic() - started < 30


def test_bad_markers_are_errors():
    found, errors = S.extract(FIXTURES / "bad_markers.md")
    page = found[0].page if found else S._display(FIXTURES / "bad_markers.md")
    assert errors == [
        f"{page}:3: snippet skip marker without a reason",
        f"{page}:8: unknown snippet marker 'skip because' "
        "(expected 'skip (reason)', 'pair NAME role=ROLE' or 'continues')",
        f"{page}:13: snippet marker not on the line just before a python fence",
    ]
    grouped, pair_errors = S.units(found)
    assert pair_errors == [f"{page}:29: 'continues' needs a runnable single block before it on the page",
                           f"{page}: pair 'lonely' has 1 block(s), expected 2"]
    assert [u.snippets[0].line for u in grouped] == [15]    # "a blank line between" still runs


def test_marker_in_the_docs_convention_page_is_not_an_error():
    found, errors = S.extract(S.ROOT / "docs" / "writing-docs.md")
    assert errors == [] and found == []
