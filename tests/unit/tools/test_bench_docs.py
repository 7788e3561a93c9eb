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
