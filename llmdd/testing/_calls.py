"""What crosses the pipe between the harness and a peer: calls pickled by reference, and errors.

Part of the multi-process test harness (:mod:`llmdd.testing._harness`, the parent side;
:mod:`llmdd.testing._peer`, the child side).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import pickle
import sys
import traceback
import types
from typing import Any, Callable, Mapping

__all__ = ["CheckpointError", "PeerCallError", "PeerExitedError", "RemoteTraceback"]

# --------------------------------------------------------------------------- errors


class RemoteTraceback(Exception):
    """Carries the child's formatted traceback; set as ``__cause__`` of a re-raised exception."""

    def __init__(self, tb_text: str) -> None:
        super().__init__(tb_text)
        self.tb_text = tb_text

    def __str__(self) -> str:
        return f'\n"""\n{self.tb_text}"""'


class PeerCallError(RuntimeError):
    """A call failed in a way that cannot be expressed by the child's own exception.

    Raised when the child's exception (or the call's result) cannot be pickled or unpickled,
    or when the function cannot be loaded in the child.  The message names the original type.
    """


class PeerExitedError(ConnectionError):
    """The peer process exited (or was killed) before answering; ``exitcode`` as ``Process``."""

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode

    def __reduce__(self):
        return (type(self), (str(self), self.exitcode))


class CheckpointError(RuntimeError):
    """Raised in the child by a checkpoint armed with ``action="raise"``."""


# -------------------------------------------------------------- pickling across processes
#
# Functions and classes are pickled by reference (module + qualified name).  A module the
# parent imported from a file that is not importable through sys.path in the child (pytest's
# ``--import-mode=importlib`` names test modules ``tests.unit.test_x`` without touching
# sys.path) is loaded in the child from the same file, under the same name.


class _CallPickler(pickle.Pickler):
    """Records ``module -> file`` of every function and class it pickles."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.origins: dict[str, str] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            name = getattr(obj, "__module__", None)
            if name and name not in self.origins:
                path = getattr(sys.modules.get(name), "__file__", None)
                if path:
                    self.origins[name] = path
        return NotImplemented


def _dumps_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    pickler = _CallPickler(buf)
    pickler.dump((fn, args, kwargs))
    return pickle.dumps((pickler.origins, buf.getvalue()))


def _load_from_file(name: str, path: str) -> None:
    """Import module ``name`` from ``path``, creating missing parent packages as namespaces."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in sys.modules:
            continue
        try:
            importlib.import_module(parent)
        except ImportError:
            pkg = types.ModuleType(parent)
            pkg.__path__ = []
            sys.modules[parent] = pkg
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], pkg)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name!r} from {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)


class _CallUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, origins: Mapping[str, str]) -> None:
        super().__init__(file)
        self._origins = origins

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except ImportError:
            if module not in self._origins or module in sys.modules:
                raise
        _load_from_file(module, self._origins[module])
        return super().find_class(module, name)


def _loads_call(payload: bytes) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    origins, blob = pickle.loads(payload)
    return _CallUnpickler(io.BytesIO(blob), origins).load()


def _error_message(cid: int, exc: BaseException) -> tuple[Any, ...]:
    tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # refuse exceptions that would not rebuild in the parent
    except Exception:
        blob = None
    return ("err", cid, blob, tb_text, type_name, str(exc))
