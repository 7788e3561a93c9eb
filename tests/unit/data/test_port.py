"""The typed port between the control plane and the data plane (llmdd/_protocol/port.py), without processes.

The data plane (TransferEngine) is built as the composition root builds it, but with a recording
ControlPort instead of the link manager: what it asks of the control plane is seen call by call.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from llmdd import CacheDesc, CacheKey, DataType, LLMRole, LLMStatusCode
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import LINK_IN_USE, LINK_SERVES, Machine
from llmdd._memory.manager import MemoryManager
from llmdd._base.options import EngineOptions
from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd._protocol.port import ControlPort, DataService, RequestOp, request_op
from llmdd._base.profiles import PROFILES
from llmdd._protocol import messages as m
from llmdd._base.status import InvalidStateError, LLMException
from llmdd._data.engine import TransferEngine

pytestmark = pytest.mark.timeout(30)


class RecordingPort:
    """A ControlPort that records every call (the data plane's view of the control plane)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def require(self, cluster_id: int) -> Any:
        raise LLMException(f"cluster {cluster_id} is not linked", status_code=LLMStatusCode.LLM_NOT_YET_LINK)

    def get(self, cluster_id: int) -> Any:
        return None

    def request(self, link: Any, op: RequestOp, args: dict, *, deadline: float) -> tuple[int, dict]:
        self.calls.append(("request", op, args))
        return 0, {}

    def ask(self, link: Any, message: m.TaggedDone, *, deadline: float) -> tuple[int, dict]:
        self.calls.append(("ask", message))
        return 0, {}

    def notify(self, link: Any, message: Any) -> None:
        self.calls.append(("notify", message))

    def fail_link(self, link: Any, error: BaseException, *,
                  status: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED) -> None:
        self.calls.append(("fail_link", status))

    def transfer_timed_out(self, link: Any, error: BaseException) -> None:
        self.calls.append(("timed_out",))

    def record_transfer(self, link: Any, *, read: int = 0, written: int = 0, failed: bool = False) -> None:
        self.calls.append(("record", read, written, failed))


class FakeLink:
    """What the data plane reads of a link: its peer, its transfer lock and its state (a real link
    machine, driven to LINKED as the link manager would)."""

    def __init__(self, peer: int) -> None:
        self.peer_cluster_id = peer
        self.transfer_lock = threading.Lock()
        self.fsm = Lifecycle(Machine.LINK).create(peer)
        self.fsm.fire("link")
        self.fsm.fire("handshake_succeeded")
        self.failure_status = None

    @property
    def in_use(self) -> bool:
        return self.fsm.in_(LINK_IN_USE)

    @property
    def serves_peer(self) -> bool:
        return self.fsm.in_(LINK_SERVES)


@pytest.fixture
def engine():
    options = EngineOptions.parse({"llm.EnableCacheManager": "1"}, LLMRole.PROMPT)
    memory = MemoryManager.from_options(options.raw, caches=Lifecycle(Machine.CACHE))
    port = RecordingPort()
    te = TransferEngine(port=port, memory=memory, tasks=Lifecycle(Machine.TASK), hooks=Hooks(make_plugin_manager(
        autoload=False)), options=options, profile=PROFILES["generic"])
    yield te, port
    te.close()
    memory.close()


def test_the_recording_port_and_the_engine_satisfy_the_port_protocols(engine):
    te, port = engine
    port_api = [n for n in vars(ControlPort) if not n.startswith("_")]
    service_api = [n for n in vars(DataService) if not n.startswith("_")]
    assert sorted(port_api) == ["ask", "fail_link", "get", "notify", "record_transfer", "request", "require",
                                "transfer_timed_out"]
    assert all(callable(getattr(port, n)) for n in port_api)
    assert sorted(service_api) == ["on_link_down", "on_notice", "quiesce", "serve", "serve_tagged"]
    assert all(callable(getattr(te, n)) for n in service_api)


def test_request_ops_on_the_wire_map_to_the_typed_vocabulary_and_nothing_else():
    assert [request_op(op.value) for op in RequestOp] == list(RequestOp)
    for op in ("release_key", "push_done", "read_done", "link_descriptor", "__read_done__", "", "RESERVE_KEY"):
        assert request_op(op) is None, op


def test_claim_links_is_all_or_none(engine):
    te, _ = engine
    a, b, c = FakeLink(1), FakeLink(2), FakeLink(3)
    te.claim_links([b])
    with pytest.raises(LLMException) as err:
        te.claim_links([a, b])
    assert err.value.status_code is LLMStatusCode.LLM_LINK_BUSY
    te.claim_links([a, c])          # a was not taken by the refused claim
    with pytest.raises(LLMException):
        te.claim_links([c])
    te.release_links([a, b, c])
    te.claim_links([a, b, c])       # every hold was released once
    te.release_links([a, b, c])


def test_quiesce_refuses_a_busy_link_and_takes_an_idle_one_out_of_use_before_any_transfer_starts(engine):
    te, _ = engine
    link = FakeLink(5)
    unlinked = []

    def unlink() -> None:   # the control plane's move to UNLINKING
        unlinked.append(link.transfer_lock.locked())   # no transfer can start meanwhile
        link.fsm.fire("unlink")

    te.claim_links([link])                     # an async task holds it
    assert te.quiesce(link, unlink) is False
    te.release_links([link])
    link.transfer_lock.acquire()               # a blocking transfer holds it
    assert te.quiesce(link, unlink) is False
    link.transfer_lock.release()
    assert unlinked == [] and link.in_use      # a refused quiesce leaves the link in use
    assert te.quiesce(link, unlink) is True    # idle: UNLINKING, moved while the link's turn was held
    assert unlinked == [True] and not link.in_use and not link.transfer_lock.locked()
    with pytest.raises(LLMException) as err:   # out of use: the control plane says why (this port: not linked)
        with te._busy.turn(link):
            raise AssertionError("a blocking transfer got the turn of a link quiesced for an unlink")
    assert err.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK
    assert not link.transfer_lock.locked()
    with pytest.raises(LLMException) as err:   # nor may an async task take it
        te.claim_links([link])
    assert err.value.status_code is LLMStatusCode.LLM_LINK_BUSY


def test_a_quiesce_whose_unlink_is_refused_releases_the_link_and_raises(engine):
    te, _ = engine
    link = FakeLink(6)
    link.fsm.fire("peer_lost")                 # FAILED meanwhile: the table refuses "unlink"
    with pytest.raises(InvalidStateError):
        te.quiesce(link, lambda: link.fsm.fire("unlink"))
    assert not link.transfer_lock.locked()


def test_a_notice_with_numbers_outside_the_owners_tables_fails_the_link_through_the_port(engine):
    te, port = engine
    link = FakeLink(7)
    te.on_notice(link, m.ReleaseKey(id=3, model_id=0))          # a key this link never reserved: benign
    assert port.calls == []
    bad = m.PushDone(entries=(m.TransferDone(cache_id=-1, block_spans=(m.Span(start=0, stop=2**40),)),))
    te.on_notice(link, bad)
    kinds = [c[0] for c in port.calls]
    assert kinds == ["notify", "fail_link"], port.calls
    error = port.calls[0][1]
    assert isinstance(error, m.Error) and error.fatal and error.status_code == LLMStatusCode.LLM_PARAM_INVALID.value
    assert port.calls[1][1] is LLMStatusCode.LLM_LINK_FAILED


def test_a_request_for_an_unknown_cache_key_is_answered_not_exist_without_touching_the_link(engine):
    te, port = engine
    status, result = te.serve(FakeLink(8), RequestOp.RESERVE_KEY, {"id": 1, "model_id": 0})
    assert (status, result) == (LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.value, {})
    with pytest.raises(LLMException) as err:          # a malformed one is refused (typed) and fails the link
        te.serve(FakeLink(8), RequestOp.RESERVE_KEY, {"id": True, "model_id": 0})
    assert err.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert [c[0] for c in port.calls] == ["notify", "fail_link"]


def test_a_reserve_key_on_a_failed_link_is_refused_and_holds_nothing():
    """A failed link is fenced down to the owner: its reserve_key is refused with the link's status
    and the key stays free (a live link then reserves it); a reservation a live link holds goes
    back when that link goes down (issue 36, item 4)."""
    options = EngineOptions.parse({"llm.EnableCacheManager": "1", "llm.MemPoolConfig": '{"memory_size": 1048576}'},
                                  LLMRole.PROMPT)
    memory = MemoryManager.from_options(options.raw, caches=Lifecycle(Machine.CACHE))
    te = TransferEngine(port=RecordingPort(), memory=memory, tasks=Lifecycle(Machine.TASK),
                        hooks=Hooks(make_plugin_manager(autoload=False)), options=options, profile=PROFILES["generic"])
    try:
        _reserve_on_failed_and_live_links(te, memory)
    finally:
        te.close()
        memory.close()


def _reserve_on_failed_and_live_links(te: TransferEngine, memory: MemoryManager) -> None:
    memory.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_UINT8), keys=(CacheKey(1, 11), CacheKey(1, 12)),
                                   is_blocks=False)
    failed, live = FakeLink(9), FakeLink(10)
    failed.fsm.fire("peer_lost")
    failed.failure_status = LLMStatusCode.LLM_LINK_FAILED
    status, result = te.serve(failed, RequestOp.RESERVE_KEY, {"id": 11, "model_id": 0})
    assert status == LLMStatusCode.LLM_LINK_FAILED.value and "link is down" in result["error"], (status, result)
    status, result = te.serve(live, RequestOp.RESERVE_KEY, {"id": 11, "model_id": 0})   # control: it is free
    assert status == 0 and result["batch_index"] == 0, (status, result)
    assert te.serve(FakeLink(11), RequestOp.RESERVE_KEY, {"id": 11, "model_id": 0})[0] == \
        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.value                                    # taken by ``live`` now
    live.fsm.fire("peer_lost")
    te.on_link_down(live)                                                             # dies with its link
    status, result = te.serve(FakeLink(12), RequestOp.RESERVE_KEY, {"id": 11, "model_id": 0})
    assert status == 0 and result["batch_index"] == 0, (status, result)
