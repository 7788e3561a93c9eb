"""The typed internal API the C++ library stands on (cpp/python/llmdd_cpp_bridge.py).

The C++ ``LlmDataDist`` keeps one Python ``Bridge`` over one :class:`llmdd.LLMDataDist`; what the
public API offers (init, link, unlink, switch_role, the cache manager) the bridge calls there, and
what the C++ API does beyond it goes through :class:`EngineApi`, its one door into the engine:

* caches keyed by their own id (``BlocksCacheKey(cluster_id, model_id=cache_id)``, so that Python
  peers pull a C++ cache's blocks by key): :meth:`EngineApi.allocate_own_key`,
  :meth:`EngineApi.register_own_key`;
* transfers naming the peer's cache by id, planned as the call asks over both caches' geometry
  (upstream's "mix" caches): :meth:`EngineApi.move`, the data plane's ``TransferEngine.move`` (its
  small block transfers take the same prepared path as ``pull_blocks`` / ``push_blocks``);
* local copies between two caches with the contract's checks: :meth:`EngineApi.copy_cache`,
  :meth:`EngineApi.copy_blocks` (:mod:`llmdd._memory.copy`, shared with the cache manager);
* the cache records the C++ checks read (:meth:`EngineApi.record`, :meth:`EngineApi.live`).

Nothing here is public API; the bridge imports nothing else of llmdd that is private.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from llmdd._api.datadist import LLMDataDist, engine_core
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._base.types import BlocksCacheKey, Cache, CacheDesc
from llmdd._engine.core import EngineCore
from llmdd._memory.copy import copy_block_lists, copy_slot
from llmdd._memory.manager import CacheRecord

__all__ = ["EngineApi", "OWN_KEY_TRIES"]

#: how often a cache is made again when another allocation took the id it was keyed by
OWN_KEY_TRIES = 8


class EngineApi:
    """What the C++ bridge does with one engine beyond the public API (this module's docstring)."""

    def __init__(self, dd: LLMDataDist) -> None:
        self._dd = dd
        self._own_key_lock = threading.Lock()   # caches keyed by their own id are made one at a time

    def initialized(self) -> bool:
        """True between the engine's ``init`` and ``finalize``."""
        return engine_core(self._dd) is not None

    def _core(self) -> EngineCore:
        core = engine_core(self._dd)
        if core is None:
            raise LLMException("the engine is not initialized", status_code=LLMStatusCode.LLM_FAILED)
        return core

    # ------------------------------------------------------------------ cache records
    def record(self, cache_id: int) -> Optional[CacheRecord]:
        """The record of ``cache_id`` (live or released), None when unknown."""
        return self._core().memory.get(cache_id)

    def live(self, cache_id: int) -> CacheRecord:
        """The live record of ``cache_id``; ``LLM_KV_CACHE_NOT_EXIST`` when unknown or released."""
        return self._core().memory.live(cache_id)

    # ------------------------------------------------------------------ caches keyed by their own id
    def allocate_own_key(self, desc: CacheDesc) -> Cache:
        """A blocks cache allocated from the pool of ``desc.placement``, keyed by its own id."""
        cm = self._dd.cache_manager
        return self._with_own_key(lambda key: cm.allocate_blocks_cache(desc, key), cm.deallocate_blocks_cache)

    def register_own_key(self, desc: CacheDesc, addrs: Sequence[int]) -> Cache:
        """Caller memory registered as a remote-accessible blocks cache, keyed by its own id."""
        cm = self._dd.cache_manager
        return self._with_own_key(lambda key: cm.register_blocks_cache(desc, list(addrs), key, True),
                                  lambda cache: cm.unregister_cache(cache.cache_id))

    def _with_own_key(self, make: Callable[[BlocksCacheKey], Cache], drop: Callable[[Cache], None]) -> Cache:
        """A cache made under ``BlocksCacheKey(cluster_id, model_id=<its own id>)``.  The id is the
        memory manager's next one; should anything else take that id first, the cache is dropped
        and made again (at most :data:`OWN_KEY_TRIES` times)."""
        memory = self._core().memory
        with self._own_key_lock:
            for _ in range(OWN_KEY_TRIES):
                cache_id = memory.next_cache_id()
                cache = make(BlocksCacheKey(self._dd.cluster_id, cache_id))
                if cache.cache_id == cache_id:
                    return cache
                drop(cache)
        raise LLMException("could not give a cache its own id as its key (concurrent allocations)",
                           status_code=LLMStatusCode.LLM_FAILED)

    # ------------------------------------------------------------------ transfers by cache id
    def move(self, *, write: bool, blocks: bool, local_id: int, cluster_id: int, remote_id: int,
             local_unit: int = 0, remote_unit: int = 0, size: int = -1,
             local_blocks: Optional[Sequence[int]] = None, remote_blocks: Optional[Sequence[int]] = None,
             src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
             tnpl: int = 2) -> None:
        """A pull (``write`` False) or push with the peer ``cluster_id``'s cache ``remote_id``
        (``TransferEngine.move``: planned as a block or a batch-slot transfer, as ``blocks`` says)."""
        self._core().transfers.move(write=write, blocks=blocks, local_id=local_id, cluster_id=cluster_id,
                                    remote_id=remote_id, local_unit=local_unit, remote_unit=remote_unit,
                                    size=size, local_blocks=local_blocks, remote_blocks=remote_blocks,
                                    src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)

    # ------------------------------------------------------------------ local copies
    def copy_cache(self, src_id: int, dst_id: int, src_batch: int, dst_batch: int, offset: int, size: int) -> None:
        """Copy ``size`` bytes (``-1``: the rest) at ``offset`` of slot ``src_batch`` of cache ``src_id``
        to slot ``dst_batch`` of cache ``dst_id``, every tensor (the contract's checks)."""
        memory = self._core().memory
        copy_slot(memory.live(src_id), memory.live(dst_id), src_batch, dst_batch, offset, size)

    def copy_blocks(self, src_id: int, dst_id: int, src_blocks: Sequence[int],
                    dst_lists: Sequence[Sequence[int]]) -> None:
        """Copy the blocks ``src_blocks`` of cache ``src_id`` to each list of ``dst_lists`` in cache
        ``dst_id``, every tensor; every list is checked before the first byte moves."""
        memory = self._core().memory
        copy_block_lists(memory.live(src_id), memory.live(dst_id), src_blocks, dst_lists)
