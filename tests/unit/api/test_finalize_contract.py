"""A CacheManager outlives its engine only as a dead handle: every call raises
``LLMException(LLM_ENGINE_FINALIZED)`` once that engine was finalized, also after the same
``LLMDataDist`` object was initialized again and while another engine runs; the live engine's
own manager keeps working and none of its caches are touched by the stale handle.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmdd import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LayerSynchronizer,
                   LLMDataDist, LLMException, LLMRole, LLMStatusCode, MemInfo, Memtype, Placement,
                   TransferWithCacheKeyConfig)

pytestmark = pytest.mark.timeout(60)

POOL = '{"memory_size": 1048576, "page_shift": 12}'
OPTS = {"llm.EnableCacheManager": "1", "llm.MemPoolConfig": POOL}
RA_OPTS = {**OPTS, "llm.EnableRemoteCacheAccessible": "1"}
DESC = CacheDesc(2, [4, 16], DataType.DT_UINT8, Placement.DEVICE)


class _Sync(LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


@pytest.fixture(autouse=True)
def _no_engine_left():
    yield
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()


def _calls(cache):
    """One call of every CacheManager method, with arguments valid for a live engine."""
    buf = np.zeros(64, np.uint8)
    return {
        "register_cache": lambda cm: cm.register_cache(DESC, [buf.ctypes.data, buf.ctypes.data]),
        "register_blocks_cache": lambda cm: cm.register_blocks_cache(DESC, [buf.ctypes.data, buf.ctypes.data]),
        "unregister_cache": lambda cm: cm.unregister_cache(cache.cache_id),
        "allocate_cache": lambda cm: cm.allocate_cache(DESC),
        "allocate_blocks_cache": lambda cm: cm.allocate_blocks_cache(DESC),
        "deallocate_cache": lambda cm: cm.deallocate_cache(cache),
        "deallocate_blocks_cache": lambda cm: cm.deallocate_blocks_cache(cache),
        "remove_cache_key": lambda cm: cm.remove_cache_key(CacheKey(7, req_id=1)),
        "copy_cache": lambda cm: cm.copy_cache(cache, cache),
        "copy_blocks": lambda cm: cm.copy_blocks(cache, {0: [1]}),
        "swap_blocks": lambda cm: cm.swap_blocks(cache, cache, {0: 1}),
        "remap_registered_memory": lambda cm: cm.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, 1, 1)]),
        "pull_cache": lambda cm: cm.pull_cache(CacheKeyByIdAndIndex(9, 1, 0), cache),
        "pull_blocks": lambda cm: cm.pull_blocks(BlocksCacheKey(9, 0), cache, [0], [0]),
        "push_cache": lambda cm: cm.push_cache(CacheKeyByIdAndIndex(9, 1, 0), cache),
        "push_blocks": lambda cm: cm.push_blocks(BlocksCacheKey(9, 0), cache, [0], [0]),
        "transfer_cache_async": lambda cm: cm.transfer_cache_async(
            cache, _Sync(), [TransferWithCacheKeyConfig(BlocksCacheKey(9, 0), range(0, 1), range(0, 1))]),
    }


NAMES = sorted(_calls(None))


def _assert_finalized(call, cm):
    with pytest.raises(LLMException) as info:
        call(cm)
    assert info.value.status_code is LLMStatusCode.LLM_ENGINE_FINALIZED
    assert isinstance(info.value, RuntimeError)
    assert "llm datadist is not initialized" in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_every_method_after_finalize(name):
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(RA_OPTS)
    cm = dd.cache_manager
    cache = cm.allocate_cache(DESC)
    dd.finalize()
    _assert_finalized(_calls(cache)[name], cm)


@pytest.mark.parametrize("name", NAMES)
def test_stale_manager_after_the_same_object_is_initialized_again(name):
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(RA_OPTS)
    stale = dd.cache_manager
    old_cache = stale.allocate_cache(DESC)
    dd.finalize()
    dd.init(RA_OPTS)
    fresh = dd.cache_manager
    assert fresh is not stale
    live_cache = fresh.allocate_cache(DESC)
    _assert_finalized(_calls(live_cache)[name], stale)
    _assert_finalized(_calls(old_cache)[name], stale)
    # the live manager is untouched: its cache still copies (control: the same call works there)
    fresh.copy_cache(live_cache, live_cache)
    fresh.deallocate_cache(live_cache)
    dd.finalize()


@pytest.mark.parametrize("name", NAMES)
def test_stale_manager_while_another_engine_runs(name):
    first = LLMDataDist(LLMRole.PROMPT, 1)
    first.init(RA_OPTS)
    stale = first.cache_manager
    first.finalize()
    second = LLMDataDist(LLMRole.DECODER, 2)
    second.init(RA_OPTS)
    live = second.cache_manager
    cache = live.allocate_cache(DESC)
    before = second.statistics()
    _assert_finalized(_calls(cache)[name], stale)
    assert second.statistics() == before
    live.deallocate_cache(cache)
    second.finalize()


def test_live_manager_works_before_finalize_control():
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(OPTS)
    cm = dd.cache_manager
    cache = cm.allocate_cache(DESC)
    cm.copy_cache(cache, cache)
    cm.deallocate_cache(cache)
    dd.finalize()
    with pytest.raises(LLMException) as info:
        cm.allocate_cache(DESC)
    assert info.value.status_code is LLMStatusCode.LLM_ENGINE_FINALIZED
