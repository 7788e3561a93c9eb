"""The ``LLMDataDist`` facade: argument checks of the contract, then internal commands.

One engine per process (``LLMDataDist.llm_engine_instance``), initialized again
after ``finalize`` on the same object if the caller wishes, and finalized by the
exit handler when its owner never calls ``finalize`` (vllm-ascend relies on it).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Dict, Optional

from ._enums import LLMRole
from ._lifecycle.machines import Lifecycle
from ._lifecycle.tables import Machine
from ._log import get_logger
from ._options import EngineOptions, prepare_engine_options
from ._status import LLMException, LLMStatusCode
from ._validation import check_isinstance, check_uint64

__all__ = ["LLMDataDist"]

_log = get_logger("llmdd.datadist")

_MAX_CLUSTER_NAME = 128
_MAX_NODE_NUM = 4


def _not_initialized() -> RuntimeError:
    return RuntimeError("llm datadist is not initialized")


class _EngineCore:
    """Everything an initialized engine owns; built by ``init``, torn down by ``finalize``."""

    def __init__(self, owner: "LLMDataDist", options: EngineOptions) -> None:
        from ._cache_manager import CacheManager
        from ._memory.manager import MemoryManager

        self.options = options
        self.cluster_id = owner._cluster_id
        self.hooks = owner._hooks
        self.caches = Lifecycle(Machine.CACHE, self.hooks.emitter(Machine.CACHE))
        self.tasks = Lifecycle(Machine.TASK, self.hooks.emitter(Machine.TASK))
        self.links = Lifecycle(Machine.LINK, self.hooks.emitter(Machine.LINK))
        self.comm_groups = Lifecycle(Machine.COMM_GROUP, self.hooks.emitter(Machine.COMM_GROUP))
        self.memory = MemoryManager.from_options(options.raw, caches=self.caches)
        try:
            self.cache_manager = CacheManager(self.memory, options.raw)
        except BaseException:
            self.memory.close()
            raise

    def close(self) -> None:
        self.cache_manager._initialized = False
        self.memory.close()


class LLMDataDist:
    """An engine: one per process; server when its options carry ``llm.listenIpInfo``."""

    llm_engine_instance: Optional["LLMDataDist"] = None
    _instance_lock = threading.RLock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._core: _EngineCore | None = None
        self._engine_options: dict[str, str] = {}
        self._pm = None
        self._hooks = None
        self._engine_fsm = None
        self._lock = threading.RLock()

    # -- properties ---------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_manager(self):
        core = self._core
        if core is None:
            raise _not_initialized()
        return core.cache_manager

    @property
    def kv_cache_manager(self):
        if self._core is None:
            raise _not_initialized()
        raise LLMException("kv_cache_manager is not supported in cache manager mode, use cache_manager.",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)

    @staticmethod
    def _role_to_str(role: LLMRole) -> str:
        from ._enums import ROLE_TO_STR

        return ROLE_TO_STR[role]

    # -- lifecycle ----------------------------------------------------------------
    def _ensure_plugins(self) -> None:
        if self._pm is not None:
            return
        from ._plugins import Hooks, make_plugin_manager

        self._pm = make_plugin_manager()
        self._hooks = Hooks(self._pm)
        self._engine_fsm = Lifecycle(Machine.ENGINE, self._hooks.emitter(Machine.ENGINE)).create(
            self._cluster_id, cluster_id=self._cluster_id)

    def init(self, options: Dict[str, str]) -> None:
        with LLMDataDist._instance_lock, self._lock:
            if self._core is not None:
                return
            live = LLMDataDist.llm_engine_instance
            if live is not None and live is not self:
                raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
            check_isinstance("options", options, dict, allow_none=False)
            engine_options = prepare_engine_options(options, self._role)
            if engine_options.get("llm.EnableCacheManager") != "1":
                raise LLMException(
                    "[LLMDataDist.init] failed: llmdd implements the cache-manager mode only; set "
                    "LLMConfig.enable_cache_manager = True (or local_comm_res) to use it. The legacy "
                    "non-cache-manager mode (kv_cache_manager) is not available.",
                    status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
            parsed = EngineOptions.parse(engine_options, self._role)
            self._ensure_plugins()
            self._pm.hook.llmdd_configure.call_historic(kwargs=dict(config=parsed))
            self._core = _EngineCore(self, parsed)
            self._engine_options = engine_options
            LLMDataDist.llm_engine_instance = self
            self._engine_fsm.fire("init", role=self._role.name)
            _log.info("llmdd.engine.init", cluster_id=self._cluster_id, role=self._role.name)

    def finalize(self) -> None:
        with LLMDataDist._instance_lock, self._lock:
            core = self._core
            if core is None:
                return
            self._core = None
            try:
                core.close()
            finally:
                if LLMDataDist.llm_engine_instance is self:
                    LLMDataDist.llm_engine_instance = None
                self._engine_fsm.fire("finalize")


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
