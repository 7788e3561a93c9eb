"""The prepared path's bookkeeping (issue 37): the one validity check of a kept plan
(``PreparedPlans.current``), the plans of a link that went down, and a link's busy turn
(``with BusyTable.turn(link):``) given back however its body ends."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._data.busy import BusyTable
from llmdd._data.planner import CacheLayout
from llmdd._data.prepared import PreparedPlan, PreparedPlans

pytestmark = pytest.mark.timeout(30)


class _Port:
    def __init__(self) -> None:
        self.links: dict[int, Any] = {}

    def get(self, cluster_id: int) -> Any:
        return self.links.get(cluster_id)

    def require(self, cluster_id: int) -> Any:
        link = self.links.get(cluster_id)
        if link is None:
            raise LLMException("not linked", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        return link


class _Memory:
    def __init__(self) -> None:
        self.records: dict[int, Any] = {}

    def get(self, cache_id: int) -> Any:
        return self.records.get(cache_id)


def _world():
    port, memory = _Port(), _Memory()
    tables = types.SimpleNamespace(cache_table_version=3, regions_version=5)
    link = types.SimpleNamespace(peer_cluster_id=9, in_use=True, failure_status=None, channel=object(), tables=tables,
                                 transfer_lock=threading.Lock())
    rec = types.SimpleNamespace(cache_id=4, live=True, regions=("r1", "r2"))
    port.links[9], memory.records[4] = link, rec
    src = CacheLayout(cache_id=7, region_ids=(10, 11), tensor_size=8 * 64, units=8, is_blocks=True)
    dst = CacheLayout(cache_id=4, region_ids=(1, 2), tensor_size=8 * 64, units=8, is_blocks=True)
    busy = BusyTable(port=port, timeout_s=1.0)   # type: ignore[arg-type]
    plan = PreparedPlan(link, tables, rec, 7, src, dst, range(0, 2), range(0, 2), False, turn=busy.turn(link))
    plan.chan = link.channel
    plans = PreparedPlans(port=port, memory=memory, layouts=None, busy=busy, timeout_s=1.0)   # type: ignore[arg-type]
    return plans, plan, port, memory, link, rec, tables


def _stale(what: str, port, memory, link, rec, tables) -> None:
    """Make one thing the plan was made on different from then."""
    if what == "cache unregistered":
        rec.live = False
    elif what == "regions replaced":
        rec.regions = ("r1", "r3")
    elif what == "another record under the id":
        memory.records[4] = types.SimpleNamespace(cache_id=4, live=True, regions=rec.regions)
    elif what == "link down":
        link.in_use = False
    elif what == "another channel":
        link.channel = object()
    elif what == "relinked":
        port.links[9] = types.SimpleNamespace(**vars(link))
    elif what == "peer tables replaced":
        link.tables = types.SimpleNamespace(cache_table_version=3, regions_version=5)
    elif what == "cache table version":
        tables.cache_table_version += 1
    elif what == "regions version":
        tables.regions_version += 1
    else:
        raise AssertionError(what)


STALE = ["cache unregistered", "regions replaced", "another record under the id", "link down", "another channel",
         "relinked", "peer tables replaced", "cache table version", "regions version"]


@pytest.mark.parametrize("what", STALE)
def test_a_kept_plan_is_current_until_one_thing_it_was_made_on_changes(what):
    plans, plan, port, memory, link, rec, tables = _world()
    assert plans.current(plan)                      # the control: nothing changed
    _stale(what, port, memory, link, rec, tables)
    assert not plans.current(plan), what


def test_a_link_that_went_down_takes_its_plans_and_its_memo():
    plans, plan, port, memory, link, rec, tables = _world()
    other = types.SimpleNamespace(peer_cluster_id=8)
    kept = PreparedPlan(other, tables, rec, 7, plan.src, plan.dst, range(0, 2), range(0, 2), False, turn=plan.turn)
    plans._plans.update({("a",): plan, ("b",): kept})
    plans._memo.update({False: (None, None, None, None, 2, plan), True: (None, None, None, None, 2, kept)})
    plans.forget(link)
    assert list(plans._plans.values()) == [kept] and list(plans._memo) == [True]


def test_the_busy_turn_is_given_back_however_its_body_ends():
    port = _Port()
    link = types.SimpleNamespace(peer_cluster_id=9, in_use=True, failure_status=None, transfer_lock=threading.Lock())
    port.links[9] = link
    busy = BusyTable(port=port, timeout_s=1.0)   # type: ignore[arg-type]
    with busy.turn(link):
        assert link.transfer_lock.locked()
    assert not link.transfer_lock.locked()
    with pytest.raises(KeyError):
        with busy.turn(link):
            raise KeyError("a failing body")
    assert not link.transfer_lock.locked()
    busy.claim_links([link])                     # an async task holds the link: no turn, nothing taken
    with pytest.raises(LLMException) as err:
        with busy.turn(link):
            raise AssertionError("the body of a refused turn ran")
    assert err.value.status_code is LLMStatusCode.LLM_LINK_BUSY and not link.transfer_lock.locked()
    busy.release_links([link])
    link.in_use = False                          # down: the turn is refused with the link's status
    with pytest.raises(LLMException) as err:
        with busy.turn(link):
            raise AssertionError("the body of a refused turn ran")
    assert err.value.status_code is LLMStatusCode.LLM_LINK_FAILED and not link.transfer_lock.locked()
