"""Contained calls of the notification hooks, and what a subscriber may declare about itself.

pluggy's own call loop stops at the first implementation that raises; a notification
(``llmdd_*_transition``, ``llmdd_register_transports``) must reach every subscriber even when one
raises (docs/plugins.md: a subscriber cannot break the engine).  :class:`ContainedCalls` calls the
implementations pluggy would call, in the order pluggy would call them (``HookCaller.get_hookimpls()``
reversed: the last registered first, ``tryfirst`` before, ``trylast`` after; these hooks take no
wrappers, :class:`~llmdd._extension.manager.LLMDDPluginManager` refuses them), each one wrapped
once so that what it raises is handed to ``on_failure`` and the next one still runs.  The wrapped
implementations are cached per hook until the manager's ``generation`` changes.
``tests/unit/extension/test_hook_dispatch.py`` checks, against pluggy's own call loop, that the
order, the arguments and the tracers' view are pluggy's and that a failure is contained.

A subscriber may declare two things about itself, by an attribute of its implementation function
(read when the manager's generation changes; never by the plugin's name):

* ``llmdd_wants`` (:data:`WANTS`) on a ``llmdd_*_transition`` implementation: a predicate
  ``wants(error) -> bool`` saying whether it would do anything with an event (``error``: the
  event's error or None).  A lifecycle builds no event while every subscriber declares it does
  not want it (:meth:`~llmdd._extension.manager.Hooks.live_emitter`); the built-in log observer
  declares its logger's level.
* ``llmdd_passthrough = True`` (:data:`PASSTHROUGH`) on a ``llmdd_run_transfer`` implementation:
  it only calls ``run()`` and returns its result.  While every implementation is one, a task's
  transfer runs without the hook (:meth:`~llmdd._extension.manager.Hooks.runs_transfers_directly`).
"""

from __future__ import annotations

import functools
import traceback
from typing import Any, Callable, Mapping, Optional

import pluggy

__all__ = ["WANTS", "PASSTHROUGH", "ContainedCalls", "declare_wants", "declare_passthrough"]

#: the attribute of an implementation function that declares which events it wants
WANTS = "llmdd_wants"
#: the attribute of a ``llmdd_run_transfer`` implementation that only calls ``run()``
PASSTHROUGH = "llmdd_passthrough"


def declare_wants(function: Callable[..., Any], wants: Callable[[Any], bool]) -> None:
    """Declare on ``function`` (a transition hook implementation) which events it wants."""
    setattr(function, WANTS, wants)


def declare_passthrough(function: Callable[..., Any]) -> None:
    """Declare that ``function`` (a ``llmdd_run_transfer`` implementation) only calls ``run()``."""
    setattr(function, PASSTHROUGH, True)


class _Failure:
    """What a contained implementation returns instead of raising."""

    __slots__ = ("error", "plugin_name")

    def __init__(self, error: Exception, plugin_name: str) -> None:
        self.error = error
        self.plugin_name = plugin_name


class _Dispatch:
    """The contained implementations of one hook, valid for one generation of the manager."""

    __slots__ = ("generation", "originals", "contained", "direct")

    def __init__(self, generation: Optional[int], originals: list[pluggy.HookImpl],
                 contained: list[pluggy.HookImpl]) -> None:
        self.generation = generation
        self.originals = originals
        self.contained = contained
        self.direct = tuple((i.function, i.argnames, i.kwargnames) for i in reversed(contained))


def _run_direct(dispatch: _Dispatch, kwargs: Mapping[str, Any]) -> list:
    """Call the contained implementations in pluggy's order (LIFO, tryfirst first), without its
    per-call machinery; their results, a :class:`_Failure` for each that raised."""
    results = []
    for function, argnames, kwargnames in dispatch.direct:
        if kwargnames:
            result = function(*[kwargs[name] for name in argnames],
                              **{k: kwargs[k] for k in kwargnames if k in kwargs})
        elif len(argnames) == 1:
            result = function(kwargs[argnames[0]])
        else:
            result = function(*[kwargs[name] for name in argnames])
        results.append(result)
    return results


def where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback ("" without one)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{last.filename}:{last.lineno}"


class ContainedCalls:
    """Calls every implementation of a hook, in pluggy's order, containing what each raises.

    :param pm: the plugin manager (its ``generation``, bumped by every register and unregister,
        invalidates the cache; a manager without one is re-read at every call; its ``monitored``
        and ``traced_call`` let ``add_hookcall_monitoring`` tracers see one call per event).
    :param on_failure: ``on_failure(hook_name, plugin_name, exc)`` for each implementation that
        raised (after it raised, before the next one runs).
    :param strict: re-raise the first failure (in call order) after every implementation ran.
    """

    def __init__(self, pm: pluggy.PluginManager, on_failure: Callable[[str, str, Exception], None],
                 strict: bool) -> None:
        self._pm = pm
        self._on_failure = on_failure
        self._strict = strict
        self._cache: dict[str, _Dispatch] = {}

    def notify(self, hook: pluggy.HookCaller, kwargs: Mapping[str, Any]) -> None:
        """Call every implementation of ``hook`` with ``kwargs``; contain what raises."""
        pm = self._pm
        generation = getattr(pm, "generation", None)
        dispatch = self._cache.get(hook.name)
        if dispatch is None or generation is None or dispatch.generation != generation:
            impls = hook.get_hookimpls()
            if dispatch is None or dispatch.originals != impls:
                dispatch = _Dispatch(generation, impls, [self._contain(hook.name, impl) for impl in impls])
                self._cache[hook.name] = dispatch
            else:
                dispatch.generation = generation
        if not dispatch.originals:
            return
        if getattr(pm, "monitored", False):
            # the tracers see one call with every (contained) subscriber, as for a pluggy hook call
            results = pm.traced_call(hook.name, dispatch.contained, kwargs,  # type: ignore[attr-defined]
                                     lambda: _run_direct(dispatch, kwargs))
        else:
            results = _run_direct(dispatch, kwargs)
        if self._strict:
            for result in results:
                if result.__class__ is _Failure:
                    raise result.error

    def _contain(self, hook_name: str, impl: pluggy.HookImpl) -> pluggy.HookImpl:
        function = impl.function
        plugin_name = impl.plugin_name
        on_failure = self._on_failure

        @functools.wraps(function)
        def contained(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a subscriber cannot break the engine
                on_failure(hook_name, plugin_name, exc)
                return _Failure(exc, plugin_name)

        wrapped = pluggy.HookImpl(impl.plugin, plugin_name, contained, impl.opts)
        if (wrapped.argnames, wrapped.kwargnames) != (impl.argnames, impl.kwargnames):  # pragma: no cover
            raise RuntimeError(f"cannot contain {hook_name} of {plugin_name!r}: signature lost")
        return wrapped
