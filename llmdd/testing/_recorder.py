"""Recorders for tests: hook calls (pytester's ``HookRecorder``) and llmdd log lines."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union, final

import attrs
import pluggy

from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.tables import Machine
from llmdd._extension.manager import TRANSITION_HOOKS

__all__ = ["HookCall", "HookRecorder", "LogOutput", "capture_log_output"]


@final
@attrs.frozen(kw_only=True)
class HookCall:
    """One recorded hook call: ``name`` and its keyword arguments (also as attributes)."""

    name: str
    kwargs: Mapping[str, Any]
    plugins: tuple[str, ...] = ()

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self.kwargs[key]
        except KeyError:
            raise AttributeError(f"{self.name} was not called with {key!r}") from None


@final
class HookRecorder:
    """Records every hook call of a plugin manager (through ``add_hookcall_monitoring``).

    ::

        recorder = HookRecorder(pm)
        ...
        [call] = recorder.getcalls("llmdd_link_transition")
        assert call.event.dest is LinkState.LINKED
        recorder.finish_recording()

    Also a context manager (finishes recording on exit).
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm
        self._lock = threading.Lock()
        self.calls: list[HookCall] = []

        def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
            call = HookCall(name=hook_name, kwargs=dict(kwargs),
                            plugins=tuple(impl.plugin_name for impl in hook_impls))
            with self._lock:
                self.calls.append(call)

        def after(outcome: pluggy.Result[Any], hook_name: str, hook_impls: Sequence[pluggy.HookImpl],
                  kwargs: Mapping[str, Any]) -> None:
            return None

        self._undo: Optional[Any] = pm.add_hookcall_monitoring(before, after)

    def finish_recording(self) -> None:
        """Stop recording (idempotent); what was recorded stays available."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> "HookRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish_recording()

    def getcalls(self, names: Union[str, Iterable[str]]) -> list[HookCall]:
        """Calls of the hooks named (one name, a space-separated string, or an iterable), in order."""
        wanted = set(names.split()) if isinstance(names, str) else set(names)
        with self._lock:
            return [call for call in self.calls if call.name in wanted]

    def events(self, machine: Optional[Machine] = None) -> list[TransitionEvent]:
        """Transition events delivered to subscribers, in order, of one machine or of all."""
        names = [TRANSITION_HOOKS[machine]] if machine is not None else list(TRANSITION_HOOKS.values())
        return [call.kwargs["event"] for call in self.getcalls(names)]

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()


@final
class LogOutput(logging.Handler):
    """Captures the log lines of the ``llmdd`` loggers as dicts.

    Each entry is the line's structured fields (what llmdd's loggers put in
    ``record.llmdd``) plus ``event``, ``log_level`` and ``logger``, the shape of
    structlog's ``capture_logs`` entries, so tests compare whole dicts::

        assert log_output.entries == [{"event": "llmdd.link.transition", ...}]
    """

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.entries: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "llmdd", None)
        entry = dict(fields) if isinstance(fields, Mapping) else {"event": record.getMessage()}
        entry["log_level"] = record.levelname.lower()
        entry["logger"] = record.name
        self.entries.append(entry)

    def events(self, name: Optional[str] = None) -> list[dict[str, Any]]:
        """Entries whose ``event`` is ``name`` (all when None)."""
        return [e for e in self.entries if name is None or e.get("event") == name]

    def clear(self) -> None:
        self.entries.clear()


@contextlib.contextmanager
def capture_log_output(level: int = logging.DEBUG, logger: str = "llmdd") -> Iterator[LogOutput]:
    """Capture the lines of ``logger`` and its children at ``level`` and above; restore everything after."""
    target = logging.getLogger(logger)
    handler = LogOutput()
    old_level = target.level
    target.addHandler(handler)
    target.setLevel(level)
    try:
        yield handler
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)
