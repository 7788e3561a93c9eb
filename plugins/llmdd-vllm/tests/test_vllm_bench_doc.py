"""docs/vllm.md's time-to-first-token tables (issue 20's runs, issue 39's) are what
scripts/vllm_ttft_table.py prints for the committed runs each block names (never typed); needs no vLLM."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
START = re.compile(r"^<!-- generated: (python scripts/vllm_ttft_table\.py .+) -->$")


def test_the_ttft_tables_in_docs_vllm_are_generated_from_the_committed_runs():
    lines = open(os.path.join(ROOT, "docs", "vllm.md")).read().split("\n")
    found = 0
    for i, ln in enumerate(lines):
        m = START.match(ln)
        if not m:
            continue
        end = lines.index("<!-- end generated -->", i)
        args = shlex.split(m.group(1))[2:]
        assert args and all(a.startswith(("bench/results-committed/issue20/", "bench/results-committed/issue39/"))
                            for a in args), args
        out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_ttft_table.py"), *args],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert lines[i + 1:end] == [""] + out.rstrip("\n").split("\n") + [""]
        found += 1
    assert found == 2       # issue 20's runs, issue 39's
