"""numpy, imported at its first use (issue 22, target 5: an idle engine <= 45 MiB RSS).

``import llmdd`` and an idle engine (configured, listening, links up) need no numpy; its import
costs 12-15 MiB of RSS (the library, OpenBLAS, the Python objects), a third of the budget.  The
modules that build op arrays, region tables and iovecs write ``from llmdd._base.lazy import np`` and use
``np.<name>`` as before: the first attribute read imports numpy (under the import lock, so
threads racing to it get the one module) and then runs the hooks registered with
:func:`when_numpy_loaded`, which define a module's numpy-derived constants (``OP_DTYPE``).  Each
attribute read is cached on the proxy, so a hot path pays an instance-dict lookup as it paid a
module one.  Whether numpy is loaded: ``"numpy" in sys.modules``.

A module with such constants also answers them as attributes through a module ``__getattr__``
(:func:`numpy_constants`), so ``from llmdd.lowlevel import OP_DTYPE`` keeps working (it imports
numpy then).  Inside a module, a function reads such a constant only after it has touched ``np``.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Callable

__all__ = ["np", "when_numpy_loaded", "numpy_constants"]

_hooks: list[Callable[[Any], None]] = []
_hooks_lock = threading.RLock()   # hooks use their argument, never np (no re-entry)
_loaded = [False]   # True once numpy is imported and every hook registered so far has run (set under the lock)


class _LazyNumpy:
    """Stands for the numpy module until an attribute is read (see the module docstring)."""

    def __getattr__(self, name: str) -> Any:   # only called for names not cached yet
        value = getattr(_load(), name)
        self.__dict__[name] = value
        return value

    def __repr__(self) -> str:
        return "<numpy, imported at first use>" if not _loaded[0] else repr(_load())


def _load() -> Any:
    numpy = importlib.import_module("numpy")
    if not _loaded[0]:
        with _hooks_lock:
            if not _loaded[0]:
                for hook in _hooks:
                    hook(numpy)
                _loaded[0] = True
    return numpy


def when_numpy_loaded(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """Run ``hook(numpy)`` when numpy is first used through :data:`np` (now, if it already was)."""
    with _hooks_lock:
        if not _loaded[0]:
            _hooks.append(hook)
            if "numpy" not in sys.modules:
                return hook
    if "numpy" in sys.modules and not _loaded[0]:
        _load()   # numpy came in some other way: define the constants now
        return hook
    hook(importlib.import_module("numpy"))
    return hook


def numpy_constants(module_globals: dict, *names: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering ``names`` (set in ``module_globals`` by a
    :func:`when_numpy_loaded` hook) by importing numpy first."""
    wanted = frozenset(names)
    module = module_globals["__name__"]

    def __getattr__(name: str) -> Any:
        if name in wanted:
            _load()
            return module_globals[name]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


np: Any = _LazyNumpy()
