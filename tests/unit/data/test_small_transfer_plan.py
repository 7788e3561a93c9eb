"""The small-transfer path's pieces (issue 21): its op rows equal the planner's, and lifecycles that
build events only while someone listens."""

from __future__ import annotations

import logging
import threading
import types

import numpy as np
import pytest

from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine, TaskState
from llmdd._data.planner import CacheLayout, plan_blocks
from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd._base.status import LocalUsageError
from llmdd._data.busy import BusyTable
from llmdd._data.prepared import PreparedPlan as _PreparedPlan
from llmdd.plugin import hookimpl

pytestmark = pytest.mark.timeout(60)


def _plan(rng, push: bool):
    su, du = int(rng.integers(1, 40)), int(rng.integers(1, 40))
    bs = int(rng.choice([1, 64, 4096]))
    sn, dn = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    src = CacheLayout(cache_id=1, region_ids=tuple(int(x) for x in rng.permutation(100)[:sn]), tensor_size=su * bs,
                      units=su, is_blocks=True)
    dst = CacheLayout(cache_id=2, region_ids=tuple(int(x) for x in rng.permutation(100)[:dn] + 200),
                      tensor_size=du * bs, units=du, is_blocks=True)
    k = int(rng.integers(1, min(sn, dn) + 1))
    s0, d0 = int(rng.integers(0, sn - k + 1)), int(rng.integers(0, dn - k + 1))
    st, dt = range(s0, s0 + k), range(d0, d0 + k)
    local, remote = (src, dst) if push else (dst, src)
    rec = types.SimpleNamespace(regions=(), cache_id=local.cache_id)
    tables = types.SimpleNamespace(cache_table_version=1, regions_version=1)
    link = types.SimpleNamespace(peer_cluster_id=9, transfer_lock=threading.Lock())
    turn = BusyTable(port=None, timeout_s=1.0).turn(link)   # type: ignore[arg-type]  # never entered here
    return _PreparedPlan(link, tables, rec, remote.cache_id, src, dst, st, dt, push, turn=turn), src, dst, st, dt


@pytest.mark.parametrize("push", [False, True])
def test_quick_ops_are_the_planners_ops(push):
    rng = np.random.default_rng(31 + push)
    checked = 0
    for _ in range(600):
        plan, src, dst, st, dt = _plan(rng, push)
        n = int(rng.integers(1, 17))
        # runs, repeats and shuffles: consecutive pairs coalesce, a repeated destination keeps its last pair
        if rng.random() < 0.3:
            a = int(rng.integers(0, max(1, src.units - n + 1)))
            b = int(rng.integers(0, max(1, dst.units - n + 1)))
            sb = [min(a + i, src.units - 1) for i in range(n)]
            db = [min(b + i, dst.units - 1) for i in range(n)]
        else:
            sb = [int(x) for x in rng.integers(0, src.units, n)]
            db = [int(x) for x in rng.integers(0, dst.units, n)]
        want = plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=st, dst_tensors=dt,
                           local="src" if push else "dst")
        got, nbytes = plan.ops(sb, db)
        assert got.dtype == want.dtype and np.array_equal(got, want), (sb, db, st, dt)
        assert nbytes == int(want["length"].sum())
        checked += 1
    assert checked == 600


@pytest.mark.parametrize("push", [False, True])
def test_quick_ops_refuse_what_the_planner_refuses(push):
    rng = np.random.default_rng(41 + push)
    plan, src, dst, st, dt = _plan(rng, push)
    bad = [([src.units], [0]), ([0], [dst.units]), ([-1], [0]), ([0, 0], [0]), ([0.5], [0])]
    for sb, db in bad:
        with pytest.raises(LocalUsageError) as quick:
            plan.ops(sb, db)
        with pytest.raises(LocalUsageError) as full:
            plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=st, dst_tensors=dt,
                        local="src" if push else "dst")
        assert str(quick.value) == str(full.value)
    # control: a valid list is planned
    assert len(plan.ops([0], [0])[0]) == len(st)


class _Recorder:
    def __init__(self) -> None:
        self.events: list = []

    @hookimpl
    def llmdd_task_transition(self, event) -> None:
        self.events.append(event)


def test_task_events_are_built_only_while_someone_listens(monkeypatch):
    pm = make_plugin_manager()
    hooks = Hooks(pm)
    built = []
    from llmdd._lifecycle import events as _events

    real = _events.TransitionEvent

    def counting(**kw):
        built.append(kw["trigger"])
        return real(**kw)

    import llmdd._lifecycle.machines as machines

    monkeypatch.setattr(machines, "TransitionEvent", counting)
    logging.getLogger("llmdd.task").setLevel(logging.INFO)   # the log observer's task level (DEBUG) is off
    emit, wants = hooks.live_emitter(Machine.TASK)
    lc = Lifecycle(Machine.TASK, emit, wants=wants)
    t = lc.create(1, kind="pull_blocks")
    assert t.fire("start", bytes=3) is None and t.fire("transfer_succeeded", bytes=3) is None
    assert built == []
    assert lc.statistics().triggers == {"start": 1, "transfer_succeeded": 1}   # counted all the same
    # a failure is logged at WARNING, which is enabled: that event is built for the log observer
    t = lc.create(2, kind="pull_blocks")
    t.fire("start")
    ev = t.fire("transfer_failed", error=RuntimeError("x"))
    assert ev is not None and ev.dest is TaskState.FAILED and built == ["transfer_failed"]
    # a subscriber registered later gets every later event
    rec = _Recorder()
    pm.register(rec)
    t = lc.create(3, kind="push_blocks", peer=9)
    t.fire("start", bytes=5)
    t.fire("transfer_succeeded", bytes=5)
    assert [(e.id, e.trigger, e.info["bytes"], e.info["peer"]) for e in rec.events] == [
        (3, "start", 5, 9), (3, "transfer_succeeded", 5, 9)]
    # and none once it is gone
    pm.unregister(rec)
    t = lc.create(4, kind="push_blocks")
    t.fire("start")
    assert len(rec.events) == 2 and built.count("start") == 1
    # the log observer's level turned on: events are built again
    logging.getLogger("llmdd.task").setLevel(logging.DEBUG)
    try:
        t.fire("transfer_succeeded")
        assert built[-1] == "transfer_succeeded"
    finally:
        logging.getLogger("llmdd.task").setLevel(logging.NOTSET)


def test_an_illegal_task_trigger_is_refused_and_counted():
    lc = Lifecycle(Machine.TASK)
    t = lc.create(1)
    t.fire("start")
    t.fire("transfer_succeeded")
    with pytest.raises(Exception) as err:
        t.fire("start")
    assert "not allowed" in str(err.value) and t.state is TaskState.COMPLETED
    stats = lc.statistics()
    assert stats.refused == 1 and stats.live == {}
