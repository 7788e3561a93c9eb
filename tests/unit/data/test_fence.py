"""Block fences (llmdd/_data/fence.py) without processes: generations, epochs, the puller's check
arguments, and the bounds on every number of a peer's ``fence_check`` before any work."""

from __future__ import annotations

import types

import pytest

from llmdd import BlockFence, LLMException, LLMStatusCode
from llmdd._data.fence import GEN_MAX, MAX_FENCE_SPANS, FENCE_FAILED, FenceTable, check_args
from llmdd._data.peer_input import PeerInputError

pytestmark = pytest.mark.timeout(30)


def _rec(cache_id: int = 5, rows: int = 64, *, blocks: bool = True, live: bool = True):
    return types.SimpleNamespace(cache_id=cache_id, rows=rows, is_blocks=blocks, live=live)


LINK = object()


def test_generations_go_up_once_per_fence_and_the_check_follows():
    table, rec = FenceTable(memory=None), _rec()
    f = table.expect(rec, [3, 4, 40])
    assert f.generations == (0, 0, 0) and 0 < f.epoch <= GEN_MAX
    args = check_args(rec.cache_id, [3, 4, 40], f)
    assert args["bounds"] == [3, 5, 40, 41] and args["gens"] == [0, 0]
    assert table.serve_check(LINK, args, rec) == (0, {})
    table.fence(rec, [4, 4, 7])                 # a duplicate counts once
    assert table.expect(rec, [3, 4, 7]).generations == (0, 1, 1)
    status, result = table.serve_check(LINK, args, rec)
    assert status == FENCE_FAILED.value and "[3, 5)" in result["error"]
    assert table.serve_check(LINK, check_args(rec.cache_id, [3, 4, 40], table.expect(rec, [3, 4, 40])), rec)[0] == 0


def test_another_registration_of_the_id_has_another_epoch_and_a_released_cache_fails():
    table, rec = FenceTable(memory=None), _rec()
    args = check_args(rec.cache_id, [1], table.expect(rec, [1]))
    again = _rec()                               # the same cache id registered anew
    assert table.serve_check(LINK, args, again)[0] == FENCE_FAILED.value
    assert table.serve_check(LINK, args, None)[0] == FENCE_FAILED.value
    assert table.serve_check(LINK, args, _rec(live=False))[0] == FENCE_FAILED.value


def test_the_puller_refuses_a_fence_that_does_not_fit_its_blocks():
    f = BlockFence(epoch=9, generations=[1, 2])
    with pytest.raises(LLMException) as info:
        check_args(1, [1, 2, 3], f)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        check_args(1, [4, 4], f)                 # one block, two generations
    assert check_args(1, [4, 4], BlockFence(epoch=9, generations=[2, 2]))["bounds"] == [4, 5]
    for bad in (-1, GEN_MAX + 1, True, 1.0):
        with pytest.raises(ValueError):
            BlockFence(epoch=bad, generations=[])
        with pytest.raises(ValueError):
            BlockFence(epoch=1, generations=[bad])
    assert BlockFence.from_dict(f.as_dict()) == f


def test_owner_api_refuses_blocks_outside_the_cache_and_a_non_blocks_cache():
    table = FenceTable(memory=None)
    for blocks in ([64], [-1]):
        with pytest.raises(LLMException) as info:
            table.fence(_rec(), blocks)
        assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        table.expect(_rec(blocks=False), [0])


@pytest.mark.parametrize("args,why", [
    ("not a map", "must be a map"),
    ({"epoch": -1, "bounds": [0, 1], "gens": [0]}, "epoch"),
    ({"epoch": GEN_MAX + 1, "bounds": [0, 1], "gens": [0]}, "epoch"),
    ({"epoch": 1, "bounds": [0, 1], "gens": "0"}, "gens"),
    ({"epoch": 1, "bounds": [0, 1] * (MAX_FENCE_SPANS + 1), "gens": [0] * (MAX_FENCE_SPANS + 1)}, "gens"),
    ({"epoch": 1, "bounds": [0, 65], "gens": [0]}, "outside"),
    ({"epoch": 1, "bounds": [0, 1, 2], "gens": [0]}, "odd"),
    ({"epoch": 1, "bounds": [0, 1, 2, 3], "gens": [0]}, "2 spans for 1"),
    ({"epoch": 1, "bounds": [2, 3, 0, 1], "gens": [0, 0]}, "sorted"),
    ({"epoch": 1, "bounds": [0, 4, 2, 6], "gens": [0, 0]}, "disjoint"),
    ({"epoch": 1, "bounds": [3, 3], "gens": [0]}, "non-empty"),
    ({"epoch": 1, "bounds": [0, 1], "gens": [-5]}, "generation"),
    ({"epoch": 1, "bounds": [0, 1], "gens": [2 ** 64]}, "generation"),
])
def test_a_peers_check_is_bounded_before_any_work(args, why):
    table, rec = FenceTable(memory=None), _rec()
    table.expect(rec, [0])
    with pytest.raises(PeerInputError) as info:
        table.serve_check(LINK, args, rec)
    assert why in str(info.value)
