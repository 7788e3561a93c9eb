"""Opt-in drop-in alias: make ``import llm_datadist`` (and its submodules) resolve to llmdd.

Two ways to opt in:

* call :func:`install_alias` early (before the client imports ``llm_datadist``), or
* install the tiny ``llm-datadist-alias`` distribution shipped in ``compat/`` of this
  repository (``pip install ./compat/llm-datadist-alias``), whose ``llm_datadist``
  package installs the alias when imported: unmodified client code then runs as is.

Nothing is aliased unless you opt in.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

__all__ = ["install_alias", "uninstall_alias", "ALIAS", "SUBMODULES"]

ALIAS = "llm_datadist"

#: upstream submodule path -> llmdd module serving it (llmdd's public modules of the same path)
SUBMODULES = {
    "status": "llmdd.status",
    "configs": "llmdd.configs",
    "data_type": "llmdd.data_type",
    "v2": "llmdd.v2",
    "v2.llm_types": "llmdd.v2.llm_types",
    "v2.llm_datadist": "llmdd.v2.llm_datadist",
    "v2.cache_manager": "llmdd.v2.cache_manager",
    "v2.llm_utils": "llmdd.v2.llm_utils",
    "v2.config": "llmdd.v2.config",
    "utils": "llmdd.utils",
    "utils.utils": "llmdd.utils.utils",
    "utils.log": "llmdd.utils.log",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self._target = target

    def create_module(self, spec):
        return importlib.import_module(self._target)

    def exec_module(self, module) -> None:  # the target module is already executed
        return None


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == ALIAS:
            target_name = "llmdd"
        elif fullname.startswith(ALIAS + "."):
            submodule = SUBMODULES.get(fullname[len(ALIAS) + 1:])
            if submodule is None:
                return None
            target_name = submodule
        else:
            return None
        is_pkg = target_name == "llmdd" or fullname[len(ALIAS) + 1:] in ("v2", "utils")
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_name), is_package=is_pkg)


_FINDER = _AliasFinder()


def install_alias() -> None:
    """Resolve ``llm_datadist`` and its client-visible submodules to llmdd from now on."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall_alias() -> None:
    """Remove the alias (modules already imported under ``llm_datadist`` stay in sys.modules)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        del sys.modules[name]
