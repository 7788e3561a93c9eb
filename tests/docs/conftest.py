"""The docs tests list the snippet opt-outs at the end of the run, whatever the outcome."""

from __future__ import annotations

import os
import sys


def pytest_terminal_summary(terminalreporter):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _snippets as S

    found, _errors = S.collect(S.doc_pages())
    skips = S.skip_lines(found)
    terminalreporter.section(f"docs snippet opt-outs ({len(skips)})")
    for line in skips:
        terminalreporter.write_line(line)
