"""README.md and every page under docs/ stay inside the repository: relative links resolve to
files of this repository, and no page refers to documents or results a clone does not have."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _snippets as S  # noqa: E402

ROOT = S.ROOT
PAGES = S.doc_pages()

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,}).*?^[ \t]*\1[ \t]*$", re.S | re.M)
_INLINE = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
_HTML = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_CODE_SPAN = re.compile(r"`([^`\s]+)`")

#: documents that live beside the repository, not in it (the design notes a clone lacks)
_OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(?:spec|seeds|bench)\b|\bDESIGN\.md\b|\bSTYLE\.md\b"
                      r"|\bllm_datadist_api\.md\b|\bRESULTS\.md\b|/work/")


def _targets(text: str) -> list[str]:
    prose = _INLINE.sub("", _FENCE.sub("", text))
    return _LINK.findall(prose) + _REF_DEF.findall(prose) + _HTML.findall(prose)


def link_problems(page: Path, text: str | None = None, root: Path = ROOT) -> list[str]:
    """Relative links of ``page`` that leave ``root`` or name a missing file."""
    text = page.read_text(encoding="utf-8") if text is None else text
    problems = []
    for target in _targets(text):
        if _SCHEME.match(target) or target.startswith("#"):
            continue   # http:, mailto: ... or an anchor on the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path:
            continue
        if path.startswith("/"):
            problems.append(f"{target}: absolute path (use a relative link)")
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{target}: leaves the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
    return problems


def reference_problems(text: str, root: Path = ROOT) -> list[str]:
    """Mentions (in prose or code) of files a clone does not have."""
    problems = [f"{m.group(0)!r}: a document outside the repository"
                for m in _OUTSIDE.finditer(text)]
    for span in _CODE_SPAN.findall(text):
        if any(c in span for c in "<*{$"):
            continue   # a placeholder or a pattern, not a file
        if span.startswith("bench/results/") and span.rstrip("/") != "bench/results" \
                and not span.split("/")[2].startswith("."):
            problems.append(f"{span}: a run directory of the ignored bench/results/ (cite a committed "
                            "copy under bench/results-committed/)")
        elif span.startswith("bench/results-committed/") and not (root / span).exists():
            problems.append(f"{span}: no such committed results file")
        elif span.endswith(".md") and "/" in span and not (root / span).exists():
            problems.append(f"{span}: no such page in the repository")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[S._display(p) for p in PAGES])
def test_links_stay_in_the_repository_and_resolve(page: Path):
    assert link_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=[S._display(p) for p in PAGES])
def test_no_reference_to_files_a_clone_lacks(page: Path):
    assert reference_problems(page.read_text(encoding="utf-8")) == []


def test_checks_catch_bad_links_and_references(tmp_path):
    """The control: each kind of bad link or reference is reported."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "there.md").write_text("# there\n")
    page = root / "docs" / "page.md"
    text = ("[ok](there.md#x) [web](https://example.org) [anchor](#here) `[not a link](gone.md)`\n"
            "[missing](gone.md) [out](../../elsewhere/x.md) ![img](img/none.png) [abs](/etc/hosts)\n"
            "[ref]: ../../../outside.md\n"
            "```text\n[in a fence](nowhere.md)\n```\n")
    page.write_text(text)
    assert link_problems(page, root=root) == [
        "gone.md: no such file", "../../elsewhere/x.md: leaves the repository",
        "img/none.png: no such file", "/etc/hosts: absolute path (use a relative link)",
        "../../../outside.md: leaves the repository"]
    refs = reference_problems("see ../shared/DESIGN.md and `bench/results/20261129T091226Z`, "
                              "`bench/results/<stamp>` `bench/results/.peers-venv` `docs/nope.md`", root)
    assert refs == ["'../shared': a document outside the repository",
                    "'DESIGN.md': a document outside the repository",
                    "bench/results/20261129T091226Z: a run directory of the ignored bench/results/ "
                    "(cite a committed copy under bench/results-committed/)",
                    "docs/nope.md: no such page in the repository"]
