"""Pins for docs/deviations.md rows that no other test pins: None arguments fail at once."""

from __future__ import annotations

import pytest

from llmdd import CacheDesc, DataType, LlmConfig, LLMDataDist, LLMRole

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cm():
    dd = LLMDataDist(LLMRole.DECODER, 5)
    dd.init({"llm.EnableCacheManager": "1", "llm.MemPoolConfig": '{"memory_size": 1048576}'})
    try:
        yield dd.cache_manager
    finally:
        dd.finalize()


@pytest.mark.parametrize("call", [
    # upstream's checks let None through here and fail later, inside the call or the native layer
    lambda cm, c: cm.pull_cache(None, c),
    lambda cm, c: cm.pull_cache(None, c, 0, -1),
    lambda cm, c: cm.pull_blocks(None, c, [], [0]),
    lambda cm, c: cm.copy_cache(None, c),
])
def test_none_where_upstream_lets_it_pass_is_a_type_error(cm, call):
    cache = cm.allocate_cache(CacheDesc(1, [2, 8], DataType.DT_UINT8))
    with pytest.raises(TypeError, match="but got <class 'NoneType'>"):
        call(cm, cache)


def test_none_ge_options_is_a_type_error():
    cfg = LlmConfig()
    with pytest.raises(TypeError, match="ge_options only support \\['dict'\\], but got <class 'NoneType'>"):
        cfg.ge_options = None
    cfg.ge_options = {"a": "b"}   # control
    assert cfg.ge_options == {"a": "b"}
