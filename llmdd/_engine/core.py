"""The composition root: one initialized engine's parts, each built with its typed collaborators.

:class:`EngineCore` is the only place that knows how the layers fit together: it builds the chip
profile, the lifecycles, memory, the control plane, the data plane (bound to each other through
the port of :mod:`llmdd._protocol.port`) and the rank-table comm groups, and closes them again.  It
imports no facade module; the facade (:mod:`llmdd._api.datadist`) owns one and builds its
``CacheManager`` over its parts.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from llmdd._base.config import parse_mem_pool_cfg
from llmdd._base.enums import LLMRole
from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions
from llmdd._base.profiles import check_pool_options, profile_from_options
from llmdd._control.comm_group import CommGroups
from llmdd._runtime.ioloop import IoLoop
from llmdd._runtime.runtime import Runtime
from llmdd._control.manager import LinkManager
from llmdd._control.settings import LinkSettings
from llmdd._data.engine import TransferEngine
from llmdd._extension.manager import Hooks
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import Machine
from llmdd._memory.manager import MemoryManager

__all__ = ["EngineCore"]

_log = get_logger("llmdd.datadist")


class _Closeable(Protocol):
    def close(self) -> None: ...


class EngineCore:
    """The composition root: everything an initialized engine owns, built by ``init`` with each part
    given its typed collaborators through its constructor, torn down by ``finalize``.

    Build order (each part depends only on the ones before it): chip profile, lifecycles, memory,
    control plane (:class:`LinkManager`), data plane (:class:`TransferEngine`, given the control plane
    as its :class:`~llmdd._protocol.port.ControlPort`; the control plane is then bound to it as its
    :class:`~llmdd._protocol.port.DataService`) and rank-table comm groups.  The facade
    (:mod:`llmdd._api`) builds its managers over these parts; nothing here imports the facade.

    ``runtime``: where every part takes its time, timers, waiting, workers and sockets (the seam
    :class:`~llmdd._runtime.runtime.Runtime`); ``None`` (production) builds the engine's own
    :class:`~llmdd._runtime.ioloop.IoLoop`.  A test hands a simulated one
    (:class:`llmdd.testing.sim.SimRuntime`).  Either way the control plane closes it last."""

    def __init__(self, *, cluster_id: int, role: Callable[[], LLMRole], options: EngineOptions, hooks: Hooks,
                 engine: Tracked, runtime: Optional[Runtime] = None) -> None:
        self.options = options
        self.cluster_id = cluster_id
        self._role = role   # the engine's (the facade's) role, read-only here
        self.hooks = hooks
        self.profile = profile_from_options(options.raw)
        host_pool = options.raw.get("llm.HostMemPoolConfig")
        check_pool_options(self.profile, parse_mem_pool_cfg(host_pool)[0] if host_pool else None)
        # events are built only while someone listens, decided per event (Hooks.live_emitter): a
        # subscriber registered after init gets every later transition
        self.caches = self._lifecycle(Machine.CACHE)
        self.tasks = self._lifecycle(Machine.TASK)
        self.links = self._lifecycle(Machine.LINK)
        self.comm_groups = self._lifecycle(Machine.COMM_GROUP)
        self.listeners = self._lifecycle(Machine.LISTENER)
        # the runtime goes to the control plane, which closes it last (after its links and listeners)
        loop: Runtime = runtime if runtime is not None else IoLoop(
            f"{self.cluster_id & 0xffff:x}", workers=LinkSettings.from_options(options).io_workers)
        self.runtime = loop
        try:
            self.memory = MemoryManager.from_options(options.raw, caches=self.caches, threads=loop)
        except BaseException:
            loop.close()
            raise
        link_manager: Optional[LinkManager] = None
        transfers: Optional[TransferEngine] = None
        comm_group_set: Optional[CommGroups] = None
        try:
            link_manager = LinkManager(cluster_id=self.cluster_id, role=self._role, options=options,
                                       hooks=self.hooks, links=self.links, memory=self.memory,
                                       profile=self.profile, loop=loop, engine=engine,
                                       listeners=self.listeners)
            transfers = TransferEngine(port=link_manager, memory=self.memory, tasks=self.tasks,
                                       hooks=self.hooks, options=options, profile=self.profile, runtime=loop)
            link_manager.bind_data_service(transfers)
            comm_group_set = CommGroups(cluster_id=self.cluster_id, links=link_manager,
                                        lifecycle=self.comm_groups, runtime=loop)
        except BaseException:
            _close_parts((comm_group_set, transfers, link_manager, loop, self.memory))   # the ones built
            raise
        # every part exists for the whole life of the object: none of them is Optional
        self.link_manager: LinkManager = link_manager
        self.transfers: TransferEngine = transfers
        self.comm_group_set: CommGroups = comm_group_set

    @property
    def role(self) -> LLMRole:
        """The engine's role now (read-only: ``LLMDataDist.switch_role`` changes it)."""
        return self._role()

    def _lifecycle(self, machine: Machine) -> Lifecycle:
        emit, wants = self.hooks.live_emitter(machine)
        return Lifecycle(machine, emit, wants=wants)

    def close(self) -> None:
        """Close every part, in reverse build order, even when an earlier one fails."""
        _close_parts((self.comm_group_set, self.transfers, self.link_manager, self.memory))


def _close_parts(parts: tuple[_Closeable | None, ...]) -> None:
    """Close each part that exists, in the order given, even when an earlier one fails; raise the
    first failure after the last (memory must never leak a segment)."""
    first_error: BaseException | None = None
    for part in parts:
        if part is None:
            continue
        try:
            part.close()
        except BaseException as exc:
            _log.error("llmdd.engine.close_failed", part=type(part).__name__, error=repr(exc))
            if first_error is None:
                first_error = exc
    if first_error is not None:
        raise first_error
