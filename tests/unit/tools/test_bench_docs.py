"""docs/benchmarks.md's generated sections equal what ``llmdd bench --report ... --markdown`` prints for the
committed runs each names, and the page refers to nothing outside the repository."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from llmdd._tools.bench import report

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

GEN_START = re.compile(r"^<!-- generated: (llmdd bench --report .+ --markdown) -->$")
GEN_END = "<!-- end generated -->"


def _generated_sections(path: str) -> list:
    lines = open(path).read().split("\n")
    out = []
    for i, ln in enumerate(lines):
        m = GEN_START.match(ln)
        if m:
            end = lines.index(GEN_END, i)
            out.append((m.group(1), lines[i + 1:end]))
    return out


def test_docs_benchmarks_generated_sections_match_the_committed_runs():
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    sections = _generated_sections(path)
    assert sections, "docs/benchmarks.md has no generated section"
    for command, body in sections:
        args = shlex.split(command)[3:-1]
        assert all(a.startswith("bench/results-committed/") for a in args), args
        runs = []
        for a in args:
            with open(os.path.join(ROOT, a)) as f:
                runs.append(json.load(f))
        want = report.markdown(runs, args)
        assert body == [""] + want + [""], command
    text = open(path).read()
    assert "../shared" not in text and "DESIGN.md" not in text


SMALL_START = re.compile(r"^<!-- generated: (python bench/small_transfers\.py --report .+ --markdown) -->$")


def test_docs_benchmarks_small_transfer_tables_match_the_committed_runs():
    """Issue 21's small-transfer tables are what ``bench/small_transfers.py --report ... --markdown``
    prints for the committed runs they name (the verdicts are the script's, not typed)."""
    from llmdd._tools.bench.small import markdown

    lines = open(os.path.join(ROOT, "docs", "benchmarks.md")).read().split("\n")
    found = 0
    for i, ln in enumerate(lines):
        m = SMALL_START.match(ln)
        if not m:
            continue
        found += 1
        end = lines.index(GEN_END, i)
        args = shlex.split(m.group(1))[3:-1]
        assert args and all(a.startswith("bench/results-committed/issue21/") for a in args), args
        runs = []
        for a in args:
            with open(os.path.join(ROOT, a, "results.json")) as f:
                runs.append(json.load(f))
        assert lines[i + 1:end] == [""] + markdown(runs, args) + [""], m.group(1)
    assert found, "docs/benchmarks.md has no generated small-transfer table"
