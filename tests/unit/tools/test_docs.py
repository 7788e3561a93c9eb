"""The documentation stays true to the code: generated pages are fresh, links resolve,
and the README's quick-start commands exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _load_gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "_tools" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
def test_api_pages_are_up_to_date():
    module = _load_gen_api()
    pages = module.render()
    assert DOCS / "api.md" in pages and len(pages) > 1
    assert module.stale(pages) == [], "API pages are stale: run python docs/_tools/gen_api.py"


@pytest.mark.timeout(60)
def test_api_pages_cover_every_public_module():
    module = _load_gen_api()
    assert "llmdd.abc" in module.public_modules()
    assert module.covered_modules() == module.public_modules(), \
        "a public module has no API page: add it to PAGES in docs/_tools/gen_api.py"


@pytest.mark.timeout(60)
def test_gen_api_check_mode_agrees():
    assert _load_gen_api().main(["--check"]) == 0


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    return _LINK.findall(text)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_links_between_docs_resolve(page: Path):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # external (http:, mailto:) or same-page anchor
        path = target.split("#", 1)[0]
        if not path:
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.exists():
            broken.append(target)
    assert not broken, f"{page.name} links to missing files: {broken}"


def test_readme_quick_start_commands_exist_as_scripts():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    scripts = re.findall(r"^\s*bash\s+(\S+\.sh)", section, re.M)
    assert len(scripts) == 2, f"expected the two quick-start commands, found {scripts}"
    for script in scripts:
        path = ROOT / script
        assert path.is_file(), f"README quick start runs {script}, which does not exist"
        assert path.read_text(encoding="utf-8").startswith("#!"), f"{script} has no shebang"
