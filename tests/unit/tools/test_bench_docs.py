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


PLOTS_COMMAND = re.compile(r"llmdd bench --report ((?:\S+\.json\s+(?:\\\s+)?)+)--markdown --plots (docs/img/\S+)")


def test_every_figure_in_docs_comes_from_committed_results_with_its_command():
    """Every image under docs/ is shown by a page that also gives the ``llmdd bench --report ... --plots DIR``
    command that writes it: DIR is the image's folder, and the results it reads are committed files."""
    docs = os.path.join(ROOT, "docs")
    images = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(docs) for f in fs
                    if f.endswith((".png", ".svg", ".jpg", ".jpeg", ".gif")))
    assert images, "no figure under docs/: the benchmarks page shows the latest runs' plots"
    pages = {}
    for d, _, fs in os.walk(docs):
        for f in fs:
            if f.endswith(".md"):
                pages[os.path.relpath(os.path.join(d, f), ROOT)] = open(os.path.join(d, f)).read()
    for image in images:
        showing = [p for p, text in pages.items()
                   if os.path.relpath(image, os.path.dirname(p)) in text]
        assert showing, f"{image} is shown by no page"
        for page in showing:
            commands = [(m.group(1).replace("\\", "").split(), m.group(2))
                        for m in PLOTS_COMMAND.finditer(pages[page].replace("\\\n", " "))]
            made = [results for results, out in commands if out == os.path.dirname(image)]
            assert made, f"{page} shows {image} without the --plots command that writes it"
            for results in made:
                assert results and all(r.startswith("bench/results-committed/") for r in results), results
                assert all(os.path.isfile(os.path.join(ROOT, r)) for r in results), results


def test_the_figure_provenance_check_refuses_a_figure_without_its_command():
    # the control: the same pattern finds nothing in a page that shows a plot but gives no --plots command
    text = "![scaling](img/run-1-3/scaling.png)\n\n```bash\nllmdd bench --report a.json --markdown\n```\n"
    assert not PLOTS_COMMAND.findall(text)
    good = "llmdd bench --report bench/results-committed/x/run-1/results.json --markdown --plots docs/img/run-1-3"
    assert PLOTS_COMMAND.search(good).group(2) == "docs/img/run-1-3"
