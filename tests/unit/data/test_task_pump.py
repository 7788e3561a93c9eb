"""The transfer engine's task machine, driven through an in-memory channel: no socket, no process.

The data plane is built as the composition root builds it, with a recording control port and a
link whose data channel is a pump over two in-process byte arrays: a batch copies its ops' bytes
(seeded random data, compared on the other side) or ends the way the test scripts it (a timeout,
a lost peer, a refusal, corruption, a cancel).  Every task transition ``run_ops`` can reach is
reached, each with its one event, and what the engine then asks of the control plane is checked.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Optional

import numpy as np
import pytest

from llmdd import LLMRole, LLMStatusCode
from llmdd._base.options import EngineOptions
from llmdd._base.profiles import PROFILES
from llmdd._base.status import LLMException
from llmdd._data.engine import TransferEngine
from llmdd._data.notices import READ
from llmdd._data.tasks import TransferTimedOut
from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import LINK_IN_USE, Machine, TaskState
from llmdd._memory.manager import MemoryManager
from llmdd._base.status import TransportError
from llmdd._seam.abc import Completion
from llmdd._seam.errors import Cancelled, Corrupt, PeerGone, Refused, TransportTimeout
from llmdd._seam.ops import OP_DTYPE

pytestmark = pytest.mark.timeout(30)

S = LLMStatusCode


class PumpCompletion(Completion):
    """A batch of the pump: finished at once, or stalled (a peer that never answers).  It keeps the seam's
    contract: a stalled batch is failed TransportTimeout and drained (``cancelled``) by the transport when
    its deadline passes during ``wait`` (modelled without a real wait: the deadline has passed)."""

    def __init__(self, error: Optional[TransportError], finished: bool) -> None:
        self._error = error
        self._finished = finished
        self.cancelled = False

    def done(self) -> bool:
        return self._finished

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._finished:         # stalled: its deadline passes, the transport fails and drains it
            self._error = TransportTimeout("batch missed its deadline")
            self.cancelled = True
            self._finished = True
        return True

    @property
    def error(self) -> Optional[TransportError]:
        return self._error

    def cancel(self) -> None:
        self.cancelled = True


class PumpChannel:
    """Moves the ops' bytes between two in-process regions, or fails the batch as scripted."""

    def __init__(self, local: np.ndarray, remote: np.ndarray) -> None:
        self.regions = {0: local, 1: remote}
        self.outcome: Any = None         # None: copy; "stall": never finishes; an error: fails with it
        self.batches: list[PumpCompletion] = []

    def _run(self, ops: np.ndarray, *, read: bool) -> PumpCompletion:
        if self.outcome == "stall":
            completion = PumpCompletion(None, finished=False)
        elif self.outcome is not None:
            completion = PumpCompletion(self.outcome, finished=True)
        else:
            for op in ops:
                lo, ro, n = int(op["local_offset"]), int(op["remote_offset"]), int(op["length"])
                local, remote = self.regions[int(op["local_region"])], self.regions[int(op["remote_region"])]
                if read:
                    local[lo:lo + n] = remote[ro:ro + n]
                else:
                    remote[ro:ro + n] = local[lo:lo + n]
            completion = PumpCompletion(None, finished=True)
        self.batches.append(completion)
        return completion

    def read(self, ops: np.ndarray, *, deadline: float) -> PumpCompletion:
        return self._run(ops, read=True)

    def write(self, ops: np.ndarray, *, deadline: float) -> PumpCompletion:
        return self._run(ops, read=False)


class PumpLink:
    """A linked link (its machine driven to LINKED) whose data channel is the pump."""

    def __init__(self, peer: int, channel: PumpChannel) -> None:
        self.peer_cluster_id = peer
        self.transfer_lock = threading.Lock()
        self.fsm = Lifecycle(Machine.LINK).create(peer)
        self.fsm.fire("link")
        self.fsm.fire("handshake_succeeded")
        self.failure_status = None
        self.channel = channel

    @property
    def in_use(self) -> bool:
        return self.fsm.in_(LINK_IN_USE)


class Port:
    """The control plane as the data plane sees it, recording what it is asked."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def fail_link(self, link: Any, error: BaseException, *, status: S = S.LLM_LINK_FAILED) -> None:
        self.calls.append(("fail_link", status))
        link.fsm.offer("peer_lost", error=error)

    def transfer_timed_out(self, link: Any, error: BaseException) -> None:
        self.calls.append(("timed_out",))
        link.fsm.offer("transfer_timed_out", error=error)

    def record_transfer(self, link: Any, *, read: int = 0, written: int = 0, failed: bool = False) -> None:
        self.calls.append(("record", read, written, failed))

    def __getattr__(self, name: str) -> Any:      # require/get/request/ask/notify: not reached by run_ops
        raise AssertionError(f"run_ops must not call ControlPort.{name}")


@pytest.fixture
def pump():
    options = EngineOptions.parse({"llm.EnableCacheManager": "1"}, LLMRole.PROMPT)
    memory = MemoryManager.from_options(options.raw, caches=Lifecycle(Machine.CACHE))
    events: list = []
    tasks = Lifecycle(Machine.TASK, events.append)
    port = Port()
    te = TransferEngine(port=port, memory=memory, tasks=tasks, options=options, profile=PROFILES["generic"],
                        hooks=Hooks(make_plugin_manager(autoload=False)))
    rng = np.random.default_rng(20261202)
    local = np.zeros(1 << 16, dtype=np.uint8)
    remote = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    channel = PumpChannel(local, remote)
    yield te, port, channel, PumpLink(9, channel), events, tasks, rng
    te.close()
    memory.close()


def _ops(rng: np.random.Generator, n: int, block: int) -> np.ndarray:
    ops = np.zeros(n, dtype=OP_DTYPE)
    ops["local_region"] = 0
    ops["remote_region"] = 1
    ops["local_offset"] = np.arange(n) * block
    ops["remote_offset"] = rng.permutation((1 << 16) // block)[:n] * block
    ops["length"] = block
    return ops


def _trace(events: list) -> list[tuple]:
    return [(e.source, e.trigger, e.dest) for e in events]


T = TaskState


def test_a_pull_moves_the_bytes_and_completes(pump):
    te, port, channel, link, events, tasks, rng = pump
    ops = _ops(rng, 8, 1024)
    te.run_ops(link, ops, write=False, kind="pull_blocks")
    local, remote = channel.regions[0], channel.regions[1]
    for op in ops:
        lo, ro = int(op["local_offset"]), int(op["remote_offset"])
        assert np.array_equal(local[lo:lo + 1024], remote[ro:ro + 1024])
    assert local[8 * 1024:].sum() == 0                      # nothing outside the ops was written
    assert _trace(events) == [(T.CREATED, "start", T.RUNNING), (T.RUNNING, "transfer_succeeded", T.COMPLETED)]
    assert events[0].info["bytes"] == events[1].info["bytes"] == 8 * 1024
    assert port.calls == [("record", 8 * 1024, 0, False)]


def test_a_push_writes_the_remote_bytes(pump):
    te, port, channel, link, events, tasks, rng = pump
    channel.regions[0][:] = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    before = channel.regions[1].copy()
    ops = _ops(rng, 4, 4096)
    te.run_ops(link, ops, write=True, kind="push_blocks")
    touched = np.zeros(1 << 16, dtype=bool)
    for op in ops:
        lo, ro = int(op["local_offset"]), int(op["remote_offset"])
        assert np.array_equal(channel.regions[1][ro:ro + 4096], channel.regions[0][lo:lo + 4096])
        touched[ro:ro + 4096] = True
    assert np.array_equal(channel.regions[1][~touched], before[~touched])
    assert [e.trigger for e in events] == ["start", "transfer_succeeded"]
    assert port.calls == [("record", 0, 4 * 4096, False)]


@pytest.mark.parametrize("outcome, code, fails_link", [
    (PeerGone("peer went away"), S.LLM_LINK_FAILED, True),
    (Refused("outside the peer's regions", status_code=S.LLM_PARAM_INVALID), S.LLM_PARAM_INVALID, False),
    (Corrupt("bad frame"), S.LLM_FAILED, True),
    (Cancelled("cancelled"), S.LLM_FAILED, False),
], ids=["peer_gone", "refused", "corrupt", "cancelled"])
def test_a_failed_batch_fails_the_task_and_the_link_only_when_the_channel_is_lost(pump, outcome, code, fails_link):
    te, port, channel, link, events, tasks, rng = pump
    channel.outcome = outcome
    with pytest.raises(LLMException) as err:
        te.run_ops(link, _ops(rng, 2, 512), write=False, kind="pull_blocks")
    assert err.value.status_code is code
    assert _trace(events) == [(T.CREATED, "start", T.RUNNING), (T.RUNNING, "transfer_failed", T.FAILED)]
    assert events[1].error is outcome
    expected = [("record", 0, 0, True)]
    if fails_link:   # a lost peer fails with LLM_LINK_FAILED, a corrupt channel with its own status
        expected.append(("fail_link", S.LLM_LINK_FAILED if isinstance(outcome, PeerGone) else outcome.status_code))
    assert port.calls == expected
    assert link.fsm.in_(LINK_IN_USE) is not fails_link
    assert channel.regions[0].sum() == 0                    # no byte landed


def test_a_batch_past_its_deadline_is_cancelled_times_the_task_out_and_fails_the_link(pump):
    te, port, channel, link, events, tasks, rng = pump
    channel.outcome = "stall"
    with pytest.raises(TransferTimedOut) as err:
        te.run_ops(link, _ops(rng, 2, 512), write=False, kind="pull_blocks")
    assert err.value.status_code is S.LLM_TIMEOUT
    assert channel.batches[-1].cancelled
    assert _trace(events) == [(T.CREATED, "start", T.RUNNING), (T.RUNNING, "deadline_expired", T.TIMED_OUT)]
    assert port.calls == [("record", 0, 0, True), ("timed_out",)]
    assert not link.fsm.in_(LINK_IN_USE)


def test_a_step_of_a_running_task_leaves_the_task_to_its_owner(pump):
    te, port, channel, link, events, tasks, rng = pump
    owner = tasks.create(1, kind="transfer_cache_async")
    owner.fire("start")
    te.run_ops(link, _ops(rng, 1, 256), write=True, kind="transfer_cache_async", step_of=owner)
    channel.outcome = "stall"
    with pytest.raises(TransferTimedOut):
        te.run_ops(link, _ops(rng, 1, 256), write=True, kind="transfer_cache_async", step_of=owner)
    # only the owner's own start: a step fires nothing on the task it belongs to
    assert _trace(events) == [(T.CREATED, "start", T.RUNNING)]
    assert owner.in_(frozenset({T.RUNNING}))


def test_every_task_transition_run_ops_can_reach_is_reached(pump):
    """The pump reaches start, transfer_succeeded, transfer_failed and deadline_expired from RUNNING."""
    te, port, channel, link, events, tasks, rng = pump
    for outcome in (None, PeerGone("x"), "stall"):
        channel.outcome = outcome
        run_link = PumpLink(10, channel)
        try:
            te.run_ops(run_link, _ops(rng, 1, 128), write=False, kind="pull_blocks")
        except LLMException:
            pass
    seen = {(s, t) for s, t, _ in _trace(events)}
    assert seen == {(T.CREATED, "start"), (T.RUNNING, "transfer_succeeded"), (T.RUNNING, "transfer_failed"),
                    (T.RUNNING, "deadline_expired")}
    assert tasks.statistics().refused == 0 and tasks.statistics().absorbed == 0


# ---------------------------------------------------------------------- the prepared path (TransferEngine._run_prepared)

class _Notices:
    """The owner notices the one-call path queues, recorded."""

    def __init__(self) -> None:
        self.push_done: list[tuple] = []
        self.queued: list[tuple] = []

    def queue(self, link: Any, entry: tuple) -> None:
        self.queued.append(entry)

    def push_done_call(self, link: Any, cache_id: int, dst_blocks: Any, dst_tensors: range, *, failed: bool) -> None:
        self.push_done.append((cache_id, list(dst_blocks), dst_tensors, failed))


def _one_call(pump, fast: Any, *, push: bool, live: bool = True):
    """``TransferEngine._run_prepared`` of a planned shape whose prepared transfer is ``fast``, with task events
    quiet (the one-call path's condition); returns (result or raised LLMException, port, tasks, notices)."""
    te, port, channel, link, _, _, _ = pump
    tasks = Lifecycle(Machine.TASK)             # no listener: the one-call path may run
    te._tasks = tasks
    notices = _Notices()
    te._notices = types.SimpleNamespace(push_done=notices.push_done_call, queue=notices.queue,
                                        close=te._notices.close)   # the engine's own, closed with it
    rec = types.SimpleNamespace(live=live, cache_id=3)
    plan = types.SimpleNamespace(prepared=fast, link=link, rec=rec, chan=channel, push=push, cache_id=7, per_block=512,
                                 dst_tensors=range(0, 2), pairs=[], bs=512, su=4, du=4, turn=te._busy.turn(link))
    kind = "push_blocks" if push else "pull_blocks"
    try:
        out: Any = te._run_prepared(plan, [1, 2], [0, 3], kind)
    except LLMException as exc:
        out = exc
    assert not link.transfer_lock.locked()      # released whatever happened
    return out, port, tasks, notices


def _task_triggers(tasks: Lifecycle) -> dict:
    return tasks.statistics().triggers


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_a_one_call_transfer_that_moved_the_bytes_is_counted_as_a_completed_task(pump, push):
    out, port, tasks, notices = _one_call(pump, lambda s, d: 1024, push=push)
    assert out is True
    assert port.calls == [("record", 0, 1024, False) if push else ("record", 1024, 0, False)]
    assert _task_triggers(tasks) == {"start": 1, "transfer_succeeded": 1}
    # the owner is told once: a push's push-done for the destination blocks, a pull's queued read-done
    # of the source blocks
    if push:
        assert notices.push_done == [(7, [0, 3], range(0, 2), False)] and notices.queued == []
    else:
        assert notices.push_done == [] and notices.queued == [(READ, 7, (1, 2))]


def test_a_declined_one_call_transfer_leaves_no_trace_and_asks_for_the_ops_path(pump, monkeypatch):
    te = pump[0]
    replanned = []
    monkeypatch.setattr(te.prepared, "prepare", lambda plan: replanned.append(te.timeout_s))
    out, port, tasks, notices = _one_call(pump, lambda s, d: -3, push=True)
    assert out is False
    assert port.calls == [] and _task_triggers(tasks) == {} and notices.push_done == [] and notices.queued == []
    assert replanned == [te.timeout_s]          # the plan is made again on the tables of now


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("error, code, trigger, calls", [
    (PeerGone("owner exited"), S.LLM_LINK_FAILED, "transfer_failed", [("record", 0, 0, True), ("fail_link", S.LLM_LINK_FAILED)]),
    (TransportTimeout("no answer"), S.LLM_TIMEOUT, "deadline_expired", [("record", 0, 0, True), ("timed_out",)]),
    (Refused("region gone", status_code=S.LLM_PARAM_INVALID), S.LLM_PARAM_INVALID, "transfer_failed",
     [("record", 0, 0, True)]),
    (Corrupt("bad answer"), S.LLM_FAILED, "transfer_failed", [("record", 0, 0, True), ("fail_link", S.LLM_FAILED)]),
], ids=["peer_gone", "timeout", "refused", "corrupt"])
def test_a_one_call_transfer_that_failed_is_reported_as_the_ops_path_reports_it(pump, push, error, code, trigger,
                                                                                 calls):
    def fast(src, dst):
        raise error

    out, port, tasks, notices = _one_call(pump, fast, push=push)
    assert isinstance(out, LLMException) and out.status_code is code, out
    assert port.calls == calls
    # the task the ops path would have made: created, started, ended by the failure's trigger
    assert _task_triggers(tasks) == {"start": 1, trigger: 1}
    assert tasks.statistics().live == {}         # ended: no task left running
    # a push tells the owner its blocks were not written (the owner's push_done event), a pull tells nothing
    assert notices.push_done == ([(7, [0, 3], range(0, 2), True)] if push else [])
    assert notices.queued == []
    # the control: the same failure through the ops path gives the same status and the same requests
    te, port2, channel, link, _, _, rng = pump
    port2.calls.clear()
    channel.outcome = error
    relink = PumpLink(11, channel)
    with pytest.raises(LLMException) as ops_err:
        te.run_ops(relink, _ops(rng, 1, 512), write=push, kind="push_blocks" if push else "pull_blocks")
    assert ops_err.value.status_code is code and port2.calls == calls


def test_a_one_call_transfer_whose_local_cache_went_ends_with_kv_cache_not_exist(pump):
    def fast(src, dst):
        raise Cancelled("region deregistered while the transfer ran")

    out, port, tasks, notices = _one_call(pump, fast, push=False, live=False)
    assert isinstance(out, LLMException) and out.status_code is S.LLM_KV_CACHE_NOT_EXIST
