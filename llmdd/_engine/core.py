"""The composition root: one initialized engine's parts, each built with its typed collaborators.

:class:`EngineCore` is the only place that knows how the layers fit together: it builds the chip
profile, the lifecycles, memory, the control plane, the data plane (bound to each other through
the port of :mod:`llmdd._data.port`) and the rank-table comm groups, and closes them again.  It
imports no facade module; the facade (:mod:`llmdd._api.datadist`) owns one and builds its
``CacheManager`` over its parts.
"""

from __future__ import annotations

from typing import Optional

from llmdd._base.config import parse_mem_pool_cfg
from llmdd._base.enums import LLMRole
from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions
from llmdd._base.profiles import check_pool_options, profile_from_options
from llmdd._control.comm_group import CommGroups
from llmdd._control.manager import LinkManager
from llmdd._data.engine import TransferEngine
from llmdd._extension.manager import Hooks
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import Machine
from llmdd._memory.manager import MemoryManager

__all__ = ["EngineCore"]

_log = get_logger("llmdd.datadist")


class EngineCore:
    """The composition root: everything an initialized engine owns, built by ``init`` with each part
    given its typed collaborators through its constructor, torn down by ``finalize``.

    Build order (each part depends only on the ones before it): chip profile, lifecycles, memory,
    control plane (:class:`LinkManager`), data plane (:class:`TransferEngine`, given the control plane
    as its :class:`~llmdd._data.port.ControlPort`; the control plane is then bound to it as its
    :class:`~llmdd._data.port.DataService`) and rank-table comm groups.  The facade
    (:mod:`llmdd._api`) builds its managers over these parts; nothing here imports the facade."""

    def __init__(self, *, cluster_id: int, role: LLMRole, options: EngineOptions, hooks: Hooks,
                 engine: Tracked) -> None:
        self.options = options
        self.cluster_id = cluster_id
        self._role = role
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
        self.memory = MemoryManager.from_options(options.raw, caches=self.caches)
        self.link_manager: Optional[LinkManager] = None
        self.transfers: Optional[TransferEngine] = None
        self.comm_group_set: Optional[CommGroups] = None
        try:
            self.link_manager = LinkManager(cluster_id=self.cluster_id, role=self._role, options=options,
                                            hooks=self.hooks, links=self.links, memory=self.memory,
                                            profile=self.profile, engine=engine,
                                            listeners=self.listeners)
            self.transfers = TransferEngine(port=self.link_manager, memory=self.memory, tasks=self.tasks,
                                            hooks=self.hooks, options=options, profile=self.profile)
            self.link_manager.bind_data_service(self.transfers)
            self.comm_group_set = CommGroups(cluster_id=self.cluster_id, links=self.link_manager,
                                             lifecycle=self.comm_groups)
        except BaseException:
            self.close()
            raise

    @property
    def role(self) -> LLMRole:
        return self._role

    def set_role(self, role: LLMRole) -> None:
        """``switch_role``: the role later handshakes offer."""
        self._role = role
        if self.link_manager is not None:
            self.link_manager.set_role(role)

    def _lifecycle(self, machine: Machine) -> Lifecycle:
        emit, wants = self.hooks.live_emitter(machine)
        return Lifecycle(machine, emit, wants=wants)

    def close(self) -> None:
        """Close every part, in reverse build order, even when an earlier one fails."""
        # every part is closed even when an earlier one fails (memory must never leak a segment)
        first_error: BaseException | None = None
        for part in (self.comm_group_set, self.transfers, self.link_manager, self.memory):
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
