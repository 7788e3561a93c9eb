"""The docs site (mkdocs.yml): its nav names every page of docs/ and only pages that exist, the
theme loads no web fonts, and, where the docs tools are installed, `mkdocs build --strict`
passes (links, anchors, nav), as scripts/build_docs.sh runs it in CI."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIG = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def _nav_pages() -> list[str]:
    nav = CONFIG.split("\nnav:\n", 1)[1]
    return re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", nav, re.M)


def test_nav_lists_every_page_once_and_only_pages_that_exist():
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
                   if "_tools" not in p.relative_to(DOCS).parts)
    nav = _nav_pages()
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    assert sorted(nav) == pages, (
        f"mkdocs.yml nav and docs/ disagree: add to the nav {sorted(set(pages) - set(nav))}, "
        f"remove from it {sorted(set(nav) - set(pages))}")


def test_site_is_built_offline_and_strict():
    assert re.search(r"^strict: true$", CONFIG, re.M)
    assert re.search(r"^\s+font: false$", CONFIG, re.M), "the theme must not load web fonts"
    for key in ("omitted_files", "not_found", "anchors", "unrecognized_links"):
        assert re.search(rf"^\s+{key}: warn$", CONFIG, re.M), key


@pytest.mark.timeout(300)
def test_mkdocs_build_strict_passes(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("the docs tools are not installed here (pip install -e '.[docs]'); "
                    "scripts/build_docs.sh installs them and builds the site in CI")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0, "\n".join(warnings) or proc.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "llmdd.html").exists()
    html = (tmp_path / "site" / "api" / "llmdd.html").read_text(encoding="utf-8")
    assert 'id="llmdd.LLMDataDist.link_clusters"' in html      # rendered from the docstrings
    import llmdd

    shown = re.sub(r"<[^>]+>", "", html)
    assert "_BASE + " not in shown                                # enum members show their values
    assert re.search(rf"LLM_TIMEOUT\s*=\s*{int(llmdd.LLMStatusCode.LLM_TIMEOUT)}\b", shown)
    assert "fonts.googleapis.com" not in (tmp_path / "site" / "index.html").read_text(encoding="utf-8")


def test_rst_constructs_in_docstrings_become_markdown():
    spec = importlib.util.spec_from_file_location("griffe_rst", DOCS / "_tools" / "griffe_rst.py")
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("griffe (part of the docs tools) is not installed here")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = ("Uses :class:`~llmdd.events.TransitionEvent` and :meth:`.pull_blocks`, see :mod:`llmdd.plugin`::\n"
            "\n    from llmdd.plugin import hookimpl\n\n    .. versionadded:: 0.1\n"
            "a = {'k': 1}  # no role here: a::b stays\n")
    assert module.to_markdown(text) == (
        "Uses `llmdd.events.TransitionEvent` and `pull_blocks`, see `llmdd.plugin`:\n"
        "\n    from llmdd.plugin import hookimpl\n\n    *New in version 0.1.*\n"
        "a = {'k': 1}  # no role here: a::b stays\n")
