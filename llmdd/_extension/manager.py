"""Plugin manager per engine, and the typed ``Hooks`` facade core code calls.

Theory of operation
-------------------
:func:`make_plugin_manager` builds one pluggy manager per ``LLMDataDist``
(never a module global): hookspecs from :mod:`llmdd.hookspecs`, the default
plugins by dotted name, then the ``llmdd`` entry-point group, the same path for
built-in and third-party transports.  Environment switches (read at creation):

* ``LLMDD_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point;
* ``LLMDD_DISABLED_PLUGINS=tcp,llmdd._extension.builtin.log_events``: block plugins by name
  (entry-point names, or dotted names of default plugins);
* ``LLMDD_TRACE_HOOKS=1``: log every hook call and its outcome on the
  ``llmdd.hooks`` logger (INFO).

Core code never calls ``pm.hook.*``: it calls :class:`Hooks`, whose methods are
typed.  Notifications go through :class:`~llmdd._extension.dispatch.ContainedCalls`,
which runs every subscriber in pluggy's order even when one raises (pluggy alone
would stop at the first exception): an exception is logged as ``llmdd.hook.failed``
with the plugin's name, counted in :meth:`Hooks.statistics`, and re-raised after all
subscribers ran only in strict mode (tests); ``add_hookcall_monitoring``
(``LLMDD_TRACE_HOOKS``, :class:`llmdd.testing.HookRecorder`) sees one call per event.
No plugin is special-cased by its name: what the fast paths skip, subscribers
declare themselves (:mod:`llmdd._extension.dispatch`: ``llmdd_wants``,
``llmdd_passthrough``).
"""

from __future__ import annotations

import collections
import importlib
import os
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, final

import attrs
import pluggy

#: pluggy's hook-call tracers (``PluginManager.add_hookcall_monitoring``; pluggy names them privately)
BeforeTrace = Callable[[str, Sequence[pluggy.HookImpl], Mapping[str, Any]], None]
AfterTrace = Callable[[pluggy.Result[Any], str, Sequence[pluggy.HookImpl], Mapping[str, Any]], None]

from llmdd import hookspecs
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.machines import Tracked
from llmdd._lifecycle.tables import Machine
from llmdd._base.log import get_logger
from llmdd._extension.dispatch import PASSTHROUGH, WANTS, ContainedCalls, where
from llmdd.plugin import PROJECT, EngineConfig, LinkInfo, TransferTask, TransportCandidate, TransportRegistry

__all__ = [
    "DEFAULT_PLUGINS",
    "HOOK_PREFIX",
    "TRANSITION_HOOKS",
    "ENV_DISABLE_AUTOLOAD",
    "ENV_DISABLED_PLUGINS",
    "ENV_TRACE_HOOKS",
    "LLMDDPluginManager",
    "make_plugin_manager",
    "Hooks",
    "HookStatistics",
]

_log = get_logger("llmdd.plugins")

HOOK_PREFIX = PROJECT + "_"

#: Registered first, by dotted name (which is also the name to block them by).
DEFAULT_PLUGINS: tuple[str, ...] = (
    "llmdd._extension.builtin.select_transport",
    "llmdd._extension.builtin.run_transfer",
    "llmdd._extension.builtin.log_events",
)

#: The notification hook of each lifecycle machine.
TRANSITION_HOOKS: Mapping[Machine, str] = {
    Machine.ENGINE: "llmdd_engine_transition",
    Machine.LINK: "llmdd_link_transition",
    Machine.COMM_GROUP: "llmdd_comm_group_transition",
    Machine.CACHE: "llmdd_cache_transition",
    Machine.TASK: "llmdd_task_transition",
    Machine.LISTENER: "llmdd_listener_transition",
}

#: Hooks whose implementations are contained (a raising one is logged, the others still run).
_CONTAINED_HOOKS = frozenset(TRANSITION_HOOKS.values()) | {"llmdd_register_transports"}

ENV_DISABLE_AUTOLOAD = "LLMDD_DISABLE_PLUGIN_AUTOLOAD"
ENV_DISABLED_PLUGINS = "LLMDD_DISABLED_PLUGINS"
ENV_TRACE_HOOKS = "LLMDD_TRACE_HOOKS"

_FALSE = frozenset({"", "0", "false", "no", "off"})


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in _FALSE


def _env_names(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


class LLMDDPluginManager(pluggy.PluginManager):
    """A pluggy manager that enforces llmdd's rules on hook implementations.

    * the hook name of every marked implementation (its ``specname`` or its
      attribute name) starts with ``llmdd_`` (as pytest enforces ``pytest_``);
    * notification hooks and ``llmdd_register_transports`` take no wrappers:
      their implementations are called one by one, contained.
    """

    def __init__(self, *, strict: bool = False) -> None:
        super().__init__(PROJECT)
        #: Re-raise subscriber exceptions (after every subscriber ran); tests switch it on.
        self.strict = strict
        #: the installed ``add_hookcall_monitoring`` tracers, oldest first (see :meth:`traced_call`)
        self._tracers: list[tuple[BeforeTrace, AfterTrace]] = []
        #: entry point name -> the distribution it came from (:meth:`list_plugin_distinfo`)
        self._dists: dict[str, Any] = {}
        #: Bumped by every register/unregister: cached hook dispatch is rebuilt after a change.
        self.generation = 0

    def register(self, plugin: object, name: Optional[str] = None) -> Optional[str]:
        try:
            return super().register(plugin, name)
        finally:
            self.generation += 1

    def unregister(self, plugin: object = None, name: Optional[str] = None) -> Any:
        try:
            return super().unregister(plugin, name)
        finally:
            self.generation += 1

    @property
    def monitored(self) -> bool:
        """True while some ``add_hookcall_monitoring`` tracer is installed."""
        return bool(self._tracers)

    def add_hookcall_monitoring(self, before: BeforeTrace, after: AfterTrace) -> Callable[[], None]:
        undo = super().add_hookcall_monitoring(before, after)
        entry = (before, after)
        self._tracers.append(entry)

        def undo_and_forget() -> None:
            undo()
            if entry in self._tracers:
                self._tracers.remove(entry)

        return undo_and_forget

    def traced_call(self, hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any],
                    call: Callable[[], Any]) -> Any:
        """Run ``call`` (llmdd's own dispatch of ``impls``) as pluggy runs a hook call under its
        tracers: every ``before`` (the latest installed first), the call, every ``after`` with its
        :class:`pluggy.Result` (the oldest first).  Public pluggy API only."""
        tracers = list(self._tracers)
        for before, _ in reversed(tracers):
            before(hook_name, impls, kwargs)
        outcome = pluggy.Result.from_call(call)
        for _, after in tracers:
            after(outcome, hook_name, impls, kwargs)
        return outcome.get_result()

    def list_plugin_distinfo(self) -> list[tuple[object, Any]]:
        """``(plugin, distribution)`` of every plugin an entry point loaded (``importlib.metadata``
        distributions: ``dist.metadata["Name"]``, ``dist.version``)."""
        return [(self.get_plugin(name), dist) for name, dist in self._dists.items() if self.has_plugin(name)]

    def load_setuptools_entrypoints(self, group: str, name: Optional[str] = None) -> int:
        """pluggy's loader, one entry point at a time: a plugin that fails to load is logged as
        ``llmdd.plugin.load_failed`` and skipped (strict mode: the error propagates)."""
        import importlib.metadata as metadata

        count = 0
        for dist in list(metadata.distributions()):
            for ep in dist.entry_points:
                if (ep.group != group or (name is not None and ep.name != name)
                        or self.get_plugin(ep.name) or self.is_blocked(ep.name)):
                    continue
                try:
                    plugin = ep.load()
                except Exception as exc:
                    if self.strict:
                        raise
                    _log.error("llmdd.plugin.load_failed", plugin=ep.name, value=ep.value,
                               error=f"{type(exc).__name__}: {exc}")
                    continue
                self.register(plugin, name=ep.name)
                self._dists[ep.name] = dist   # which distribution it came from (list_plugin_distinfo)
                count += 1
        return count

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Optional[pluggy.HookimplOpts]:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None:
            return None
        hook_name = opts.get("specname") or name
        if not hook_name.startswith(HOOK_PREFIX):
            raise pluggy.PluginValidationError(
                plugin, f"hook implementation {name!r} of {plugin!r}: llmdd hook names start with {HOOK_PREFIX!r}")
        if hook_name in _CONTAINED_HOOKS and (opts.get("wrapper") or opts.get("hookwrapper")):
            raise pluggy.PluginValidationError(
                plugin, f"{hook_name} of {plugin!r} cannot be a wrapper: its implementations are called one "
                        f"by one so that a failing subscriber cannot stop the others")
        return opts


def make_plugin_manager(autoload: bool = True, blocked: Iterable[str] = (), strict: bool = False) -> LLMDDPluginManager:
    """Build the plugin manager of one engine.

    :param autoload: load the ``llmdd`` entry-point group (also switched off by
        ``LLMDD_DISABLE_PLUGIN_AUTOLOAD``).
    :param blocked: plugin names never to register (added to ``LLMDD_DISABLED_PLUGINS``).
    :param strict: subscriber exceptions are re-raised (tests) instead of only logged.

    A plugin whose entry point fails to load is skipped and logged as
    ``llmdd.plugin.load_failed`` (one broken or half-installed plugin must not stop
    every engine of the machine); in strict mode the error propagates.  Unknown ``llmdd_*`` hook
    implementations fail :meth:`~pluggy.PluginManager.check_pending`.
    """
    pm = LLMDDPluginManager(strict=strict)
    pm.add_hookspecs(hookspecs)
    for name in (*blocked, *_env_names(ENV_DISABLED_PLUGINS)):
        pm.set_blocked(name)
    if _env_flag(ENV_TRACE_HOOKS):
        _install_trace(pm)
    pm.hook.llmdd_addhooks.call_historic(kwargs={"pluginmanager": pm})
    for dotted in DEFAULT_PLUGINS:
        if not pm.is_blocked(dotted):
            pm.register(importlib.import_module(dotted), name=dotted)
    if autoload and not _env_flag(ENV_DISABLE_AUTOLOAD):
        pm.load_setuptools_entrypoints(PROJECT)
    pm.check_pending()
    _log.debug("llmdd.plugins.loaded", plugins=sorted(name for name, _ in pm.list_name_plugin()),
               blocked=sorted(set(blocked) | set(_env_names(ENV_DISABLED_PLUGINS))))
    return pm


def _install_trace(pm: pluggy.PluginManager) -> Callable[[], None]:
    log = get_logger("llmdd.hooks")

    def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        log.info("llmdd.hooks.call", hook=hook_name, plugins=[i.plugin_name for i in hook_impls],
                 kwargs=dict(kwargs))

    def after(outcome: pluggy.Result[Any], hook_name: str, hook_impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, Any]) -> None:
        if outcome.exception is not None:
            log.info("llmdd.hooks.raised", hook=hook_name, error=repr(outcome.exception))
        else:
            log.info("llmdd.hooks.returned", hook=hook_name, result=outcome.get_result())

    return pm.add_hookcall_monitoring(before, after)


# ----------------------------------------------------------------------------- facade


@final
@attrs.frozen(kw_only=True)
class HookStatistics:
    """Snapshot of one engine's hook traffic."""

    events: Mapping[str, int]               # notifications emitted, per machine value
    failures: int                           # subscriber exceptions contained
    failures_by_plugin: Mapping[str, int]
    last_failure: Optional[str]


def _task_view(task: object) -> object:
    """What a plugin sees of a task: the engine's tracked task as a :class:`TransferTask` (read-only);
    anything else (a test's stand-in, a view already) as it is."""
    if isinstance(task, Tracked):
        assert isinstance(task.id, int), "a task's id is an int (its task machine's resource id)"
        info = dict(task.info)
        peer = info.get("peer")
        return TransferTask(id=task.id, kind=info.get("kind"), peer=peer if isinstance(peer, int) else None,
                            info=info)
    return task


class _RunOnce:
    """``run`` for ``llmdd_run_transfer``: the transfer runs at most once whoever calls it."""

    __slots__ = ("_run", "called", "_result", "_error")

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run = run
        self.called = False
        self._result: object = None
        self._error: Optional[BaseException] = None

    def __call__(self) -> Any:
        if not self.called:
            self.called = True
            try:
                self._result = self._run()
            except BaseException as exc:
                self._error = exc
                raise
            return self._result
        if self._error is not None:
            raise self._error
        return self._result


class LazyCandidates(Sequence):
    """The candidates of a link (registered here, available, offered by the peer), most preferred
    first, probed only as far as they are looked at.

    A transport's ``probe()`` may be costly (the ucx transport loads NIXL: a quarter of a second
    and ~18 MiB); the default policy stops at the first same-host or network transport, so a link
    that ends on shm never probes what comes after it.  ``len()``, indexing from the end and
    ``tuple()`` probe everything, as a policy that looks at every candidate must."""

    def __init__(self, registry: TransportRegistry, offered: Optional[Iterable[str]] = None) -> None:
        self._registry = registry
        self._offered = None if offered is None else frozenset(offered)
        self._names = [n for n in registry.names() if self._offered is None or n in self._offered]
        self._seen: list[TransportCandidate] = []
        self._next = 0   # index into _names of the next name to probe

    def _candidate(self, name: str) -> Optional[TransportCandidate]:
        info = self._registry.probe(name)
        if not info.available:
            return None
        cls = self._registry.get(name)
        return TransportCandidate(name=name, priority=int(cls.priority), same_host_only=bool(cls.same_host_only),
                                  info=info)

    def _more(self) -> bool:
        while self._next < len(self._names):
            cand = self._candidate(self._names[self._next])
            self._next += 1
            if cand is not None:
                self._seen.append(cand)
                return True
        return False

    def __iter__(self):
        i = 0
        while i < len(self._seen) or self._more():
            yield self._seen[i]
            i += 1

    def __len__(self) -> int:
        while self._more():
            pass
        return len(self._seen)

    def __getitem__(self, index):
        if isinstance(index, slice) or index < 0:
            len(self)
            return tuple(self._seen)[index]
        while index >= len(self._seen) and self._more():
            pass
        return self._seen[index]

    def has(self, name: str) -> bool:
        """Is ``name`` a candidate?  Probes that transport only."""
        if name not in self._names:
            return False
        return any(c.name == name for c in self._seen) or self._candidate(name) is not None

    def __repr__(self) -> str:
        return f"<LazyCandidates {[c.name for c in self._seen]} probed, {self._names[self._next:]} not yet>"


@final
class Hooks:
    """Typed calls into one engine's plugins (one per ``LLMDataDist``).

    :param pm: the engine's plugin manager (:func:`make_plugin_manager`).
    :param strict: re-raise subscriber exceptions; default: ``pm.strict``.
    """

    def __init__(self, pm: pluggy.PluginManager, *, strict: Optional[bool] = None) -> None:
        self._pm = pm
        self._strict = bool(getattr(pm, "strict", False)) if strict is None else strict
        self._stats_lock = threading.Lock()
        self._events: collections.Counter[str] = collections.Counter()
        self._failures: collections.Counter[str] = collections.Counter()
        self._last_failure: Optional[str] = None
        self._notify = ContainedCalls(pm, self._record_failure, self._strict).notify
        self._transition_hooks = {m: getattr(pm.hook, name) for m, name in TRANSITION_HOOKS.items()}
        self._emitters = {m: self._make_emitter(m) for m in Machine}
        self._run_direct: tuple = (None, False)  # (pm generation, no plugin intercepts llmdd_run_transfer)

    @property
    def pm(self) -> pluggy.PluginManager:
        return self._pm

    @property
    def strict(self) -> bool:
        return self._strict

    # -- notifications -------------------------------------------------------------

    def emitter(self, machine: Machine) -> Callable[[TransitionEvent], None]:
        """The ``emit`` callable for ``Lifecycle(machine, emit)``: it calls whoever subscribes when an
        event comes, so a subscriber registered after the lifecycle was built gets every later event
        (:meth:`live_emitter` adds a ``wants`` test that skips building events nobody listens to)."""
        return self._emitters[machine]

    def live_emitter(self, machine: Machine) -> tuple[Callable[[TransitionEvent], None], Callable[[Any], bool]]:
        """``(emit, wants)`` for ``Lifecycle(machine, emit, wants=wants)``: decided per event, not once.

        ``wants(error)`` says whether an event of ``machine`` (with ``error`` or without) has a
        listener *now*: a hook-call tracer, a subscriber that declares nothing, or a subscriber whose
        declared ``llmdd_wants(error)`` (:mod:`llmdd._extension.dispatch`) is true (the built-in log
        observer declares its logger's level).  A lifecycle then builds no event object while
        nobody listens, and a subscriber registered later gets every later event.  Costs one
        integer compare (and each declared predicate, e.g. a logger level check) per transition."""
        hook = self._transition_hooks[machine]
        pm = self._pm
        # [generation seen, some subscriber wants every event, the declared predicates, the one predicate
        # when there is exactly one (the usual case: the log observer alone), else None]
        state: list = [None, False, (), None]

        if not isinstance(pm, LLMDDPluginManager):
            return self._emitters[machine], lambda error: True  # no generation to follow: always emit
        tracers = pm._tracers   # read directly, not through the ``monitored`` property: one call less per event

        def wants(error: Optional[BaseException]) -> bool:
            if pm.generation != state[0]:
                declared = [getattr(impl.function, WANTS, None) for impl in hook.get_hookimpls()]
                state[1] = any(w is None for w in declared)
                state[2] = tuple(w for w in declared if w is not None)
                state[3] = state[2][0] if len(state[2]) == 1 else None
                state[0] = pm.generation
            if state[1] or tracers:
                return True
            single = state[3]
            if single is not None:
                return single(error)
            return any(declared_wants(error) for declared_wants in state[2])

        return self._emitters[machine], wants

    def engine_transition(self, event: TransitionEvent) -> None:
        self._emitters[Machine.ENGINE](event)

    def link_transition(self, event: TransitionEvent) -> None:
        self._emitters[Machine.LINK](event)

    def comm_group_transition(self, event: TransitionEvent) -> None:
        self._emitters[Machine.COMM_GROUP](event)

    def cache_transition(self, event: TransitionEvent) -> None:
        self._emitters[Machine.CACHE](event)

    def task_transition(self, event: TransitionEvent) -> None:
        self._emitters[Machine.TASK](event)

    def listener_transition(self, event: TransitionEvent) -> None:
        self._emitters[Machine.LISTENER](event)

    def _make_emitter(self, machine: Machine) -> Callable[[TransitionEvent], None]:
        hook = self._transition_hooks[machine]
        key = machine.value
        notify = self._notify
        lock = self._stats_lock
        events = self._events

        def emit(event: TransitionEvent) -> None:
            with lock:
                events[key] += 1
            notify(hook, {"event": event})

        emit.__qualname__ = f"Hooks.emit_{key}"
        return emit

    def _record_failure(self, hook_name: str, plugin_name: str, exc: Exception) -> None:
        with self._stats_lock:
            self._failures[plugin_name] += 1
            self._last_failure = f"{plugin_name}.{hook_name}: {type(exc).__name__}: {exc}"
        _log.error("llmdd.hook.failed", hook=hook_name, plugin=plugin_name, error=repr(exc), where=where(exc),
                   strict=self._strict)

    # -- configuration and registration ----------------------------------------------

    def configure(self, config: EngineConfig) -> None:
        """``llmdd_configure`` (historic): plugins registered later receive it too."""
        self._pm.hook.llmdd_configure.call_historic(kwargs={"config": config})

    def register_transports(self) -> TransportRegistry:
        """A new registry filled by every ``llmdd_register_transports`` (contained)."""
        registry = TransportRegistry()
        self._notify(self._pm.hook.llmdd_register_transports, {"register": registry})
        return registry

    # -- decisions and interception --------------------------------------------------

    def select_transport(self, link: LinkInfo, candidates: Sequence[TransportCandidate]) -> Optional[str]:
        """The transport name chosen for ``link``, or None when no plugin chose one of ``candidates``.

        A plugin answering a name that is not a candidate is logged
        (``llmdd.hook.invalid_result``) and the answer treated as None (the link
        then fails for want of a transport); in strict mode it raises
        :class:`ValueError`.  Exceptions raised by a policy propagate.
        """
        if not isinstance(candidates, LazyCandidates):
            candidates = tuple(candidates)
        name = self._pm.hook.llmdd_select_transport(link=link, candidates=candidates)
        if name is None:
            return name
        if candidates.has(name) if isinstance(candidates, LazyCandidates) else any(c.name == name for c in candidates):
            return name
        message = f"llmdd_select_transport chose {name!r}, not one of {[c.name for c in candidates]}"
        _log.error("llmdd.hook.invalid_result", hook="llmdd_select_transport", result=repr(name),
                   candidates=[c.name for c in candidates])
        if self._strict:
            raise ValueError(message)
        return None

    def runs_transfers_directly(self) -> bool:
        """True while every ``llmdd_run_transfer`` implementation declares that it only calls
        ``run()`` (``llmdd_passthrough``, :mod:`llmdd._extension.dispatch`; the built-in default
        does) and no tracer monitors hook calls: a task's transfer may then run without the hook
        (what :meth:`run_transfer` does in that case).  Decided once per plugin-manager generation."""
        pm = self._pm
        if getattr(pm, "monitored", True):
            return False
        generation = getattr(pm, "generation", None)
        direct = self._run_direct
        if generation is None or direct[0] != generation:
            impls = pm.hook.llmdd_run_transfer.get_hookimpls()
            direct = self._run_direct = (generation, all(getattr(i.function, PASSTHROUGH, False) is True for i in impls))
        return direct[1]

    def run_transfer(self, task: object, run: Callable[[], Any]) -> Any:
        """Run one task through ``llmdd_run_transfer``; ``run`` executes at most once.

        When no implementation ran it (the default plugin blocked) it is run
        here; an implementation that returns a value without calling ``run``
        replaces the transfer.  Exceptions propagate (they are the task's outcome).
        """
        if self.runs_transfers_directly():
            return run()  # nobody intercepts: skip the hook machinery on the per-task path
        hook = self._pm.hook.llmdd_run_transfer
        once = _RunOnce(run)
        result = hook(task=_task_view(task), run=once)
        if result is None:
            return once()
        return result

    def drops_control_message(self, peer_cluster_id: int, msg: object) -> bool:
        """``llmdd_control_message`` for a received message: True when a plugin drops it.  Costs one
        attribute lookup while no plugin implements the hook."""
        hook = self._pm.hook.llmdd_control_message
        if not hook.get_hookimpls():
            return False
        name = type(msg).__name__
        op = getattr(msg, "op", None)
        if isinstance(op, str):
            name = f"{name}:{op}"
        try:
            return hook(peer_cluster_id=peer_cluster_id, message=name, direction="received") is True
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the link
            self._record_failure("llmdd_control_message", "?", exc)
            return False

    # -- observability ---------------------------------------------------------------

    def statistics(self) -> HookStatistics:
        with self._stats_lock:
            return HookStatistics(
                events=dict(self._events),
                failures=sum(self._failures.values()),
                failures_by_plugin=dict(self._failures),
                last_failure=self._last_failure,
            )

    def __repr__(self) -> str:
        plugins = sorted(name for name, _ in self._pm.list_name_plugin())
        return f"<Hooks strict={self._strict} plugins={plugins}>"
