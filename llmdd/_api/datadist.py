"""The ``LLMDataDist`` facade: argument checks of the contract, then internal commands.

One engine per process (``LLMDataDist.llm_engine_instance``), initialized again
after ``finalize`` on the same object if the caller wishes, and finalized by the
exit handler when its owner never calls ``finalize`` (vllm-ascend relies on it).
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

from llmdd._api.cache_manager import CacheManager
from llmdd._base.config import LLMClusterInfo
from llmdd._base.enums import ROLE_TO_STR, LLMRole, RegisterMemStatus
from llmdd._base.ranktable import parse_rank_table
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._engine.core import EngineCore
from llmdd._lifecycle.tables import ENGINE_UP, Machine
from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions, parse_listen_ip_info, prepare_engine_options
from llmdd._extension.manager import Hooks, LLMDDPluginManager, make_plugin_manager
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false
from llmdd._api.v1 import KvCacheManager
from llmdd._api.v1.datadist import not_in_v1, not_in_v2, v1_check_link_status, v1_link_clusters, v1_switch_listen
from llmdd._api.v1.options import V1Settings, prepare_v1_options
from llmdd._base.validation import check_int32, check_isinstance, check_uint32, check_uint64
from llmdd.plugin import EngineConfig
from llmdd._runtime.runtime import Runtime

__all__ = ["LLMDataDist", "engine_core", "use_runtime"]

_log = get_logger("llmdd.datadist")

_MAX_CLUSTER_NAME = 128
_MAX_NODE_NUM = 4


def _not_initialized() -> RuntimeError:
    return RuntimeError("llm datadist is not initialized")


class LLMDataDist:
    """An engine: one per process; server when its options carry ``llm.listenIpInfo``."""

    llm_engine_instance: Optional["LLMDataDist"] = None
    _instance_lock = threading.RLock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._core: EngineCore | None = None
        self._cache_manager: CacheManager | None = None
        self._kv_cache_manager: Optional[KvCacheManager] = None   # the legacy v1 mode's KvCacheManager (llmdd/_api/v1)
        self._engine_options: dict[str, str] = {}
        self._pm: Optional[LLMDDPluginManager] = None      # built once, by _ensure_plugins
        self._hooks: Optional[Hooks] = None
        self._engine_fsm: Optional[Tracked] = None
        self._lock = threading.RLock()
        self._v1: Optional[V1Settings] = None  # the legacy v1 mode's settings when init selected it (llmdd/_v1)
        self._runtime: Optional[Runtime] = None   # None: the process's own (see use_runtime)

    # -- properties ---------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        """The cluster id given at construction (peers key their links by it)."""
        return self._cluster_id

    @property
    def cache_manager(self):
        """The engine's ``CacheManager`` (RuntimeError before ``init`` / after ``finalize``)."""
        self._require_core()
        if self._v1 is not None:
            raise not_in_v1("cache_manager")
        return self._cache_manager

    @property
    def kv_cache_manager(self):
        """The legacy v1 ``KvCacheManager`` (engines initialized without cache-manager mode; docs/v1.md)."""
        self._require_core()
        if self._v1 is None:
            raise not_in_v2("kv_cache_manager")
        return self._kv_cache_manager

    def _set_role(self, role: LLMRole) -> None:
        """The one writer of the engine's role.  The role lives here only: the engine core, its link
        manager (the role later handshakes offer) and the v1 ``KvCacheManager`` read it through
        :meth:`_current_role`; the engine's options record it as ``llm.Role``."""
        self._role = role
        self._engine_options["llm.Role"] = self._role_to_str(role)

    def _current_role(self) -> LLMRole:
        """The engine's role now (the read-only view handed to the engine core)."""
        return self._role

    @staticmethod
    def _role_to_str(role: LLMRole) -> str:
        return ROLE_TO_STR[role]

    # -- lifecycle ----------------------------------------------------------------
    def _ensure_plugins(self) -> tuple[LLMDDPluginManager, Hooks, Tracked]:
        """The plugin manager, its hooks and the engine machine, built on the first call."""
        pm, hooks, fsm = self._pm, self._hooks, self._engine_fsm
        if pm is None or hooks is None or fsm is None:
            pm = make_plugin_manager()
            hooks = Hooks(pm)
            fsm = Lifecycle(Machine.ENGINE, hooks.emitter(Machine.ENGINE)).create(
                self._cluster_id, cluster_id=self._cluster_id)
            self._pm, self._hooks, self._engine_fsm = pm, hooks, fsm
        return pm, hooks, fsm

    def _engine(self) -> Tracked:
        """The engine machine, which exists from the first ``init`` (or ``add_plugin``) on."""
        fsm = self._engine_fsm
        if fsm is None:
            raise _not_initialized()
        return fsm

    def add_plugin(self, plugin: object, name: Optional[str] = None) -> None:
        """Register a pluggy plugin object (hook subscriber, transport, fault injector) on this
        engine's plugin manager.  llmdd extension, not part of upstream's API: call it before
        ``init`` for plugins that contribute transports, at any time for subscribers."""
        pm, _hooks, _fsm = self._ensure_plugins()
        pm.register(plugin, name=name)

    def init(self, options: Dict[str, str]) -> None:
        """Initialize the engine from ``options`` (usually ``LLMConfig().generate_options()``).

        Completes and checks the options as upstream does, builds the plugin manager (once per
        object), lifecycles, memory, cache manager, control and data planes, and listens when
        ``llm.listenIpInfo`` is set.  A no-op when already initialized; one engine per process.
        """
        deliver: list = []   # the engine's events, handed to subscribers once the locks are released
        with LLMDataDist._instance_lock, self._lock:
            if self._initialized():
                return
            live = LLMDataDist.llm_engine_instance if self._runtime is None else _runtime_engines.get(self._runtime)
            if live is not None and live is not self:
                raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
            check_isinstance("options", options, dict, allow_none=False)
            engine_options = prepare_engine_options(options, self._role)
            v1 = None
            if engine_options.get("llm.EnableCacheManager") != "1":  # legacy v1 mode (llmdd/_v1)
                engine_options, v1 = prepare_v1_options(engine_options, self._role, self._cluster_id)
            parsed = EngineOptions.parse(engine_options, self._role)
            _pm, hooks, engine_fsm = self._ensure_plugins()
            hooks.configure(EngineConfig(cluster_id=self._cluster_id, role=self._role, options=engine_options))
            core = EngineCore(cluster_id=self._cluster_id, role=self._current_role, options=parsed, hooks=hooks,
                              engine=engine_fsm, runtime=self._runtime)
            try:
                cache_manager = CacheManager(core.memory, parsed.raw, profile=core.profile, transfers=core.transfers)
                kv_cache_manager = KvCacheManager(core, cache_manager) if v1 is not None else None
            except BaseException:
                core.close()
                raise
            self._core = core
            self._cache_manager, self._kv_cache_manager = cache_manager, kv_cache_manager
            self._v1 = v1
            self._engine_options = engine_options
            if self._runtime is not None:   # the one engine of its runtime's (simulated) process
                _runtime_engines[self._runtime] = self
            else:
                LLMDataDist.llm_engine_instance = self
                # atexit is LIFO: modules imported while building the engine (memory backend, transport
                # plugins) registered exit handlers that unlink their segments; finalize must run before them
                atexit.unregister(_shutdown_handler)
                atexit.register(_shutdown_handler)
            engine_fsm.fire("init", role=self._role.name, defer=deliver.append)
            _log.info("llmdd.engine.init", cluster_id=self._cluster_id, role=self._role.name)
        for emit in deliver:
            emit()

    def finalize(self) -> None:
        """Tear everything down silently (links included); the object may be initialized again."""
        deliver: list = []
        try:
            with LLMDataDist._instance_lock, self._lock:
                core = self._core
                if core is None or not self._initialized():   # init sets the core, then the machine
                    return
                # the machine moves first: every call from now on finds the engine finalized
                self._engine().fire("finalize", defer=deliver.append)
                self._core = None
                for cm in (self._cache_manager, self._kv_cache_manager):
                    if cm is not None:
                        cm._mark_finalized()
                try:
                    core.close()
                finally:
                    if LLMDataDist.llm_engine_instance is self:
                        LLMDataDist.llm_engine_instance = None
                    if self._runtime is not None and _runtime_engines.get(self._runtime) is self:
                        del _runtime_engines[self._runtime]
        finally:
            for emit in deliver:
                emit()


    # -- links --------------------------------------------------------------------
    def _initialized(self) -> bool:
        """The engine machine says INITIALIZED (between ``init`` and ``finalize``)."""
        fsm = self._engine_fsm
        return fsm is not None and fsm.in_(ENGINE_UP)

    def _require_core(self) -> EngineCore:
        """The engine's parts, while the engine machine says INITIALIZED; else the contract's error."""
        core = self._core
        if core is None or not self._initialized():
            raise _not_initialized()
        return core

    def _check_clusters(self, clusters, timeout) -> None:
        check_isinstance("clusters", clusters, (list, tuple), inner_class=LLMClusterInfo, allow_none=False)
        check_int32("timeout", timeout)
        if timeout <= 0:
            raise LLMException(f"timeout must be > 0, but got {timeout}.", status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def link_clusters(self, clusters: Union[List[LLMClusterInfo], Tuple[LLMClusterInfo, ...]], timeout=3000):
        """Link to server engines, in parallel; returns ``(status, [status per cluster])``, never raises on failure."""
        core = self._require_core()
        self._check_clusters(clusters, timeout)
        if self._v1 is not None:
            for cluster in clusters:
                check_uint64("remote_cluster_id", cluster.remote_cluster_id)
            return v1_link_clusters(core, self._role, clusters, timeout)
        auto_comm_res = not core.options.local_comm_res
        for cluster in clusters:
            if auto_comm_res and not cluster.local_ip_info_list:
                raise LLMException("local_ip_info_list is empty. Call append_local_ip_info to set the local ip "
                                   "when local_comm_res is not configured or empty.",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)
        if not clusters:  # nothing to link (LinkManager's thread pool refuses zero workers)
            return LLMStatusCode.LLM_SUCCESS, []
        return core.link_manager.link_clusters(list(clusters), timeout)

    def unlink_clusters(self, clusters: Union[List[LLMClusterInfo], Tuple[LLMClusterInfo, ...]], timeout=3000,
                        force=False):
        """Unlink; non-force notifies the peer, force tears down only this side."""
        core = self._require_core()
        self._check_clusters(clusters, timeout)
        check_isinstance("force", force, bool, allow_none=False)
        for cluster in clusters:
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)
        return core.link_manager.unlink_clusters(list(clusters), timeout, force)

    def switch_role(self, role: LLMRole, switch_options: Optional[Dict[str, str]] = None) -> None:
        """Change role; ``llm.listenIpInfo`` in the options starts/moves listening, its absence stops it."""
        core = self._require_core()
        listen: Optional[tuple[str, int]] = None
        if self._v1 is not None:
            listen = v1_switch_listen(self._role, role, switch_options, self._v1.enable_switch_role)
        else:
            check_isinstance("role", role, LLMRole, allow_none=False)
            check_isinstance("switch_options", switch_options, dict)
            options = dict(switch_options or {})
            if "llm.listenIpInfo" in options:
                listen = parse_listen_ip_info(options["llm.listenIpInfo"])
        lm = core.link_manager
        if lm.has_links():
            raise LLMException("switch_role is not allowed while links exist; unlink them first.",
                               status_code=LLMStatusCode.LLM_EXIST_LINK)
        if core.options.transfer_backend and listen is not None and lm.listen_address is not None \
                and listen[1] != lm.listen_address[1]:
            raise LLMException("the listen port cannot be changed by switch_role with transfer_backend set.",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if listen is None:
            lm.stop_listening()
        elif lm.listen_address != listen:
            lm.listen(*listen)
        self._set_role(role)
        self._engine().fire("switch_role", role=role.name, listen=f"{listen[0]}:{listen[1]}" if listen else None)

    # -- bilateral comm groups (rank table) ---------------------------------------
    def link(self, comm_name: str, cluster_rank_info: Dict[int, int], rank_table: str) -> int:
        """Bilateral link of up to 4 members from a rank table; returns the comm id (from 1)."""
        core = self._require_core()
        self._refuse_in_v1("link")
        check_isinstance("comm_name", comm_name, str, allow_none=False)
        raise_if_false(0 < len(comm_name) < _MAX_CLUSTER_NAME,
                       "comm_name length must be in (0, {}), but got {}.", _MAX_CLUSTER_NAME, len(comm_name))
        check_isinstance("cluster_rank_info", cluster_rank_info, dict, allow_none=False)
        for cluster_id, rank in cluster_rank_info.items():
            check_uint64("cluster_rank_info key", cluster_id)
            check_uint32("cluster_rank_info value", rank)
        raise_if_false(len(cluster_rank_info) <= _MAX_NODE_NUM, "cluster num must be less than or equal to {}.",
                       _MAX_NODE_NUM)
        raise_if_false(len(cluster_rank_info) > 1, "cluster num must be bigger than 1.")
        ranks = list(cluster_rank_info.values())
        raise_if_false(ranks == sorted(ranks) and len(set(ranks)) == len(ranks),
                       "ranks in cluster_rank_info must be listed in ascending order without duplicates.")
        check_isinstance("rank_table", rank_table, str, allow_none=False)
        core.profile.require_api("link")
        table = parse_rank_table(rank_table)
        comm_id = core.comm_group_set.link(comm_name, dict(cluster_rank_info), table)
        cache_manager = self._cache_manager
        if cache_manager is None:   # init builds it together with the core
            raise _not_initialized()
        cache_manager.set_is_call_linked()
        return comm_id

    def unlink(self, comm_id: int) -> None:
        """Tear down the comm group ``comm_id`` (LLMException on failure)."""
        core = self._require_core()
        self._refuse_in_v1("unlink")
        check_uint64("comm_id", comm_id)
        core.profile.require_api("unlink")
        core.comm_group_set.unlink(comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING until every member's memory is exchanged, then OK (or FAILED)."""
        core = self._require_core()
        self._refuse_in_v1("query_register_mem_status")
        check_uint64("comm_id", comm_id)
        core.profile.require_api("query_register_mem_status")
        return core.comm_group_set.status(comm_id)

    def _refuse_in_v1(self, func_name: str) -> None:
        if self._v1 is not None:
            raise not_in_v1(func_name)

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Legacy v1 mode, DECODER: the link to ``remote_cluster_id`` answers in time, else LLMException."""
        core = self._require_core()
        if self._v1 is None:
            raise not_in_v2("check_link_status")
        v1_check_link_status(core, self._role, remote_cluster_id)

    def statistics(self) -> dict:
        """A snapshot of the engine: links, caches, pools, transports, lifecycle counters."""
        core = self._require_core()
        return {
            "cluster_id": self._cluster_id,
            "role": self._role.name,
            "links": core.link_manager.statistics(),
            "link_failures": core.link_manager.link_failures(),
            "memory": core.memory.statistics(),
            "lifecycles": {lc.machine.value: lc.statistics() for lc in
                           (core.links, core.comm_groups, core.caches, core.tasks, core.listeners)},
            "hooks": core.hooks.statistics(),
            "listen": core.link_manager.listen_address,
        }


def _shutdown_handler() -> None:
    """At interpreter exit, finalize the engine its owner never finalized."""
    engine = LLMDataDist.llm_engine_instance
    if engine is None:
        return
    try:
        engine.finalize()
    except LLMException as exc:
        _log.warning("llmdd.engine.exit_finalize_failed", error=str(exc))


atexit.register(_shutdown_handler)


#: the engine of each runtime handed to :func:`use_runtime` (the one engine of a simulated process)
_runtime_engines: "weakref.WeakKeyDictionary[Any, LLMDataDist]" = weakref.WeakKeyDictionary()


def use_runtime(dd: LLMDataDist, runtime: Runtime) -> None:
    """Build ``dd``'s engine on ``runtime`` at its next ``init`` instead of the process's own I/O loop
    (:class:`llmdd.testing.sim.SimRuntime`: many engines, each the one engine of its simulated
    process, in one real process).  Such an engine is not ``LLMDataDist.llm_engine_instance`` and
    registers no exit handler: its runtime's owner finalizes it."""
    if dd._initialized():
        raise RuntimeError("use_runtime: the engine is initialized already")
    dd._runtime = runtime


def engine_core(dd: LLMDataDist) -> Optional[EngineCore]:
    """The parts of ``dd``'s engine while it is initialized, else None: for the facade's siblings in
    this package that stand on the engine (:mod:`llmdd._api.bridge_api`), never for callers."""
    return dd._core if dd._initialized() else None
