"""docs/cpp.md's and bench/results-committed/issue18/README.md's generated C++ row tables equal what
``python bench/results-committed/issue18/table.py`` prints for the committed runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = "bench/results-committed/issue18/table.py"
START = f"<!-- generated: python {SCRIPT} -->"
END = "<!-- end generated -->"


@pytest.mark.parametrize("page", ["docs/cpp.md", "bench/results-committed/issue18/README.md"])
def test_generated_cpp_row_table_matches_the_committed_runs(page):
    want = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPT)], capture_output=True, text=True,
                          check=True).stdout.rstrip("\n").split("\n")
    lines = open(os.path.join(ROOT, page)).read().split("\n")
    i = lines.index(START)
    assert lines[i + 1:lines.index(END, i)] == want
