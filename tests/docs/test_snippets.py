"""Every ```python block of README.md and docs/**/*.md runs as written (see docs/writing-docs.md).

One test per snippet (or per two-process pair), each in its own interpreter and temporary
directory; an opted-out block is reported as skipped with its reason, and the opt-outs must
equal the committed list (tests/docs/snippet_skips.txt) so that a new one is a visible change.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _snippets as S  # noqa: E402

PAGES = S.doc_pages()
UNITS, ERRORS = S.collect(PAGES)


def test_docs_have_snippets_and_well_formed_markers():
    assert any(p.name == "README.md" for p in PAGES)
    assert len(UNITS) >= 5, [u.id for u in UNITS]
    assert ERRORS == [], "\n".join(ERRORS)


def test_opt_outs_are_the_committed_list():
    found = S.skip_lines(UNITS)
    committed = S.committed_skips()
    assert found == committed, (
        "the snippet opt-outs in the docs differ from tests/docs/snippet_skips.txt\n"
        f"  only in the docs: {sorted(set(found) - set(committed))}\n"
        f"  only in the list: {sorted(set(committed) - set(found))}\n"
        "update the list: python tests/docs/_snippets.py --list-skips")


@pytest.mark.timeout(int(S.TIMEOUT_S * 2 + 30))
@pytest.mark.parametrize("unit", UNITS, ids=[u.id for u in UNITS])
def test_snippet_runs(unit: S.Unit, tmp_path):
    if unit.skip is not None:
        pytest.skip(f"snippet opt-out: {unit.skip}")
    outcome = S.run_unit(unit, tmp_path)
    assert outcome.ok, f"{unit.id} failed:\n{outcome.detail}"
