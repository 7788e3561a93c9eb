"""Type checking (issue 17, point 6): the configuration covers llmdd/ and every plugin package.

mypy itself runs as a step of .ci/run (scripts/typecheck.sh: no error in llmdd/ and every plugin, then
a control proving the check sees llmdd's own types).  It is not a test of the default suite (issue 41):
mypy on a cold cache is CPU-bound work of a minute or more, and a deadline on it failed the suite on a
busy machine.  What stays here needs no subprocess: [tool.mypy] names every package, and the package
says it is typed.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_configuration_checks_llmdd_and_every_plugin():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    plugins = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "src").is_dir())
    packages = sorted(d.name for p in plugins for d in (p / "src").iterdir() if (d / "__init__.py").is_file())
    assert len(plugins) >= 6 and len(packages) == len(plugins), (plugins, packages)
    # a plugin package left out of [tool.mypy] would go unchecked
    assert sorted(config["packages"]) == sorted(["llmdd", *packages])
    assert sorted(pathlib.PurePath(p).parts[-2] for p in config["mypy_path"][1:]) == [p.name for p in plugins]


def test_the_package_says_it_is_typed():
    assert (ROOT / "llmdd" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()
