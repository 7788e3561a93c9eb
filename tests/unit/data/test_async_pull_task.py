"""A non-blocking pull (llmdd/_data/tasks.py ``AsyncPull``) is a task of the task machine from its
submission: the worker's ``start`` and a cancellation's ``withdraw`` race on that machine only.

Driven without threads or processes: the pull is called as its worker would call it, and its link
goes down or the engine finalizes at chosen points; every transition the task machine emits is
recorded and checked whole.
"""

from __future__ import annotations

import pytest

from llmdd import LLMStatusCode
from llmdd._base.status import LLMException
from llmdd._data.tasks import AsyncPull
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine, TaskState
from llmdd._runtime.threads import SYSTEM

pytestmark = pytest.mark.timeout(30)

S = LLMStatusCode
T = TaskState


class _Engine:
    """The engine's side of a pull's end: the pulls it still counts."""

    runtime = SYSTEM   # where a task takes its waiting (llmdd._data.tasks.TaskHost)

    def __init__(self) -> None:
        self.ended: list[AsyncPull] = []

    def task_ended(self, pull: AsyncPull) -> None:
        self.ended.append(pull)


class _Link:
    def __init__(self, peer: int) -> None:
        self.peer_cluster_id = peer


class _Rig:
    def __init__(self, run=None) -> None:
        self.events: list[TransitionEvent] = []
        self.tasks = Lifecycle(Machine.TASK, self.events.append)
        self.engine = _Engine()
        self.link = _Link(7)
        self.runs = 0
        self.callbacks: list[LLMStatusCode] = []
        self._run = run

        def run_once() -> None:
            self.runs += 1
            if self._run is not None:
                self._run(self)

        self.pull = AsyncPull(self.engine, self.link, run_once, self.callbacks.append,  # type: ignore[arg-type]
                              task=self.tasks.create(41, kind="pull_blocks_async", peer=7))

    def transitions(self) -> list[tuple[str, TaskState, TaskState]]:
        return [(e.trigger, e.source, e.dest) for e in self.events]


def test_a_queued_pull_withdrawn_by_its_link_going_down_emits_its_cancel_and_never_runs():
    rig = _Rig()
    rig.pull.link_down(rig.link)
    assert rig.pull.status is S.LLM_LINK_FAILED and rig.pull.wait(0)
    assert rig.transitions() == [("withdraw", T.CREATED, T.CANCELLED)]
    event = rig.events[0]
    assert event.id == 41 and event.info["kind"] == "pull_blocks_async" and event.info["peer"] == 7
    assert isinstance(event.error, LLMException) and event.error.status_code is S.LLM_LINK_FAILED
    # the worker picks it up later: the machine absorbs its start, nothing runs, nothing more is told
    rig.pull()
    assert rig.runs == 0 and rig.transitions() == [("withdraw", T.CREATED, T.CANCELLED)]
    assert rig.callbacks == [S.LLM_LINK_FAILED] and rig.engine.ended == [rig.pull]


def test_a_queued_pull_withdrawn_by_finalize_ends_engine_finalized():
    rig = _Rig()
    rig.pull.cancel()
    assert rig.pull.status is S.LLM_ENGINE_FINALIZED
    assert rig.transitions() == [("withdraw", T.CREATED, T.CANCELLED)]
    assert rig.events[0].error.status_code is S.LLM_ENGINE_FINALIZED
    rig.pull()
    assert rig.runs == 0 and rig.callbacks == [S.LLM_ENGINE_FINALIZED]


def test_a_started_pull_is_not_withdrawn_it_ends_as_its_blocking_call_did():
    # the link goes down while the pull runs (it waited for the link's transfer slot): the withdrawal
    # is absorbed, and the blocking call's refusal ends the pull with the link's typed status
    def run(rig: _Rig) -> None:
        rig.pull.link_down(rig.link)
        raise LLMException("not linked", status_code=S.LLM_NOT_YET_LINK)

    rig = _Rig(run)
    rig.pull()
    assert rig.runs == 1 and rig.pull.status is S.LLM_LINK_FAILED
    assert rig.transitions() == [("start", T.CREATED, T.RUNNING), ("transfer_failed", T.RUNNING, T.FAILED)]
    assert rig.events[1].error.status_code is S.LLM_NOT_YET_LINK
    assert rig.callbacks == [S.LLM_LINK_FAILED] and rig.engine.ended == [rig.pull]


@pytest.mark.parametrize("outcome,status,trigger,dest", [
    (None, S.LLM_SUCCESS, "transfer_succeeded", T.COMPLETED),
    (S.LLM_TIMEOUT, S.LLM_TIMEOUT, "deadline_expired", T.TIMED_OUT),
    (S.LLM_LINK_BUSY, S.LLM_LINK_BUSY, "transfer_failed", T.FAILED),
])
def test_a_run_pull_ends_its_task_by_the_blocking_calls_outcome(outcome, status, trigger, dest):
    def run(rig: _Rig) -> None:
        if outcome is not None:
            raise LLMException("the blocking call failed", status_code=outcome)

    rig = _Rig(run)
    rig.pull()
    assert rig.pull.status is status and rig.callbacks == [status]
    assert rig.transitions() == [("start", T.CREATED, T.RUNNING), (trigger, T.RUNNING, dest)]
    # a finalize after the end changes nothing (absorbed) and tells nobody
    rig.pull.cancel()
    assert rig.pull.status is status and len(rig.events) == 2 and rig.callbacks == [status]
