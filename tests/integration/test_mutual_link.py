"""Two engines that both listen link_clusters to each other (the hixl_transfer_backend sample's shape):
at the same moment and one after the other.  Both calls return LLM_SUCCESS, each side holds one
usable link to the other, it carries transfers both ways (bytes compared), and each side's non-force
unlink succeeds on its own, one after the other or at the same moment (hicann/hixl 9ed283b: the
sample checks both unlinks, ``hixl_transfer_backend_sample.py`` 115-117 and 184-186; each side
destroys only its own entity, ``hixl_transfer_engine.cc:186-219``, ``comm_entity_manager.cc:33-61``).
One engine per process; every wait is bounded."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest

from llmdd import LLMStatusCode
from llmdd.testing._harness import peers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}
OK = (S.LLM_SUCCESS, [S.LLM_SUCCESS])

pytestmark = pytest.mark.timeout(120)


def _both_ways(a, b, a_id, b_id, a_seed, b_seed):
    """a pulls two blocks of b, then b pulls one block of a: the pulled bytes are compared with what
    the source holds (its seeded pattern, or what an earlier pull put there)."""
    src_b = b.call(P.blocks)
    assert a.call(P.pull, b_id, [1, 2], [0, 3])[0] == "LLM_SUCCESS"
    got = a.call(P.blocks)
    np.testing.assert_array_equal(got[:, 0], src_b[:, 1])
    np.testing.assert_array_equal(got[:, 3], src_b[:, 2])
    assert not np.array_equal(src_b[:, 1], P.pattern(a_id, a_seed)[:, 0])   # the control: they differ
    src_a = a.call(P.blocks)
    assert b.call(P.pull, a_id, [2], [1])[0] == "LLM_SUCCESS"
    np.testing.assert_array_equal(b.call(P.blocks)[:, 1], src_a[:, 2])
    np.testing.assert_array_equal(src_a[:, 2], P.pattern(a_id, a_seed)[:, 2])   # a's own block, untouched


_CLOSING = ("peer_unlinked", "unlink_succeeded", "force_unlink", "finalize")


def _current(triggers: list) -> list:
    """The triggers of the live link: those after the last one that closed an earlier link."""
    ends = [i for i, t in enumerate(triggers) if t in _CLOSING]
    return triggers[ends[-1] + 1:] if ends else triggers


def _one_link_each(a, b, a_id, b_id) -> str:
    """Each side has one LINKED link to the other, made by one connection: exactly one side fired
    ``link`` (it connected) and the other ``accept``.  Returns which side connected (either is legal
    when both call at once: the lower id's connection when they crossed, else the one that came first)."""
    assert a.call(P.link_states) == {b_id: "linked"}
    assert b.call(P.link_states) == {a_id: "linked"}
    ta = _current([e["trigger"] for e in a.call(P.events) if e["id"] == b_id])
    tb = _current([e["trigger"] for e in b.call(P.events) if e["id"] == a_id])
    assert ta.count("handshake_succeeded") == 1 and tb.count("handshake_succeeded") == 1, (ta, tb)
    assert sorted([ta[0], tb[0]]) == ["accept", "link"], (ta, tb)
    assert "failed" not in ta + tb and "force_unlink" not in ta + tb, (ta, tb)
    return "a" if ta[0] == "link" else "b"


def _unlink_in_sequence(x, y, x_id, y_id, x_port, y_port):
    """x unlinks first: LLM_SUCCESS, and y, which still holds the link, keeps using it (it pulls x's
    bytes); x no longer does (LLM_NOT_YET_LINK, and so does a repeated unlink).  Then y unlinks:
    LLM_SUCCESS, and the link is gone on both sides."""
    assert x.call(P.unlink, [(y_id, HOST, y_port)]) == OK
    assert y.call(P.link_states) == {x_id: "linked"}
    assert x.call(P.link_states) == {y_id: "linked"}   # still up here: it serves y
    assert x.call(P.link_released) == {y_id: True} and y.call(P.link_released) == {x_id: False}
    assert x.call(P.pull, y_id, [0], [0])[0] == "LLM_NOT_YET_LINK"
    assert x.call(P.unlink, [(y_id, HOST, y_port)]) == (S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
    src_x = x.call(P.blocks)
    assert not np.array_equal(y.call(P.blocks)[:, 0], src_x[:, 2])   # the control: they differ before
    assert y.call(P.pull, x_id, [2], [0])[0] == "LLM_SUCCESS"
    np.testing.assert_array_equal(y.call(P.blocks)[:, 0], src_x[:, 2])
    assert [e["trigger"] for e in x.call(P.events) if e["id"] == y_id][-2:] == ["unlink", "unlink_kept"]
    assert y.call(P.unlink, [(x_id, HOST, x_port)]) == OK
    state, _ = x.call(P.wait_link_state, y_id, (None,), 5.0)
    assert state is None, state
    assert y.call(P.link_states) == {}
    assert [e["trigger"] for e in y.call(P.events) if e["id"] == x_id][-2:] == ["unlink", "unlink_succeeded"]
    assert [e["trigger"] for e in x.call(P.events) if e["id"] == y_id][-1] == "peer_unlinked"
    assert y.call(P.pull, x_id, [0], [0])[0] == "LLM_NOT_YET_LINK"


@pytest.mark.parametrize("unlink_side", ["lower", "higher"])
def test_simultaneous_mutual_link_gives_one_link_used_both_ways(unlink_side):
    outcomes = []
    with peers("a", "b", env=ENV) as (a, b):
        for rnd in range(3):
            a_id, b_id = 10 + rnd, 20 + rnd
            if rnd % 2:
                a_id, b_id = b_id, a_id   # the lower id on either process
            a_port = a.call(P.start, "PROMPT", a_id, f"{HOST}:0", seed=rnd + 1)
            b_port = b.call(P.start, "DECODER", b_id, f"{HOST}:0", seed=rnd + 5)
            fa = a.call_async(P.link, [(b_id, HOST, b_port)], 8000)
            fb = b.call_async(P.link, [(a_id, HOST, a_port)], 8000)
            assert fa.result(30.0) == OK and fb.result(30.0) == OK
            connected = _one_link_each(a, b, a_id, b_id)
            outcomes.append("lower connected" if (connected == "a") == (a_id < b_id) else "higher connected")
            _both_ways(a, b, a_id, b_id, rnd + 1, rnd + 5)
            # a second link_clusters from either side: the link exists
            assert a.call(P.link, [(b_id, HOST, b_port)]) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
            assert b.call(P.link, [(a_id, HOST, a_port)]) == (S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK])
            lower_is_a = a_id < b_id
            if (unlink_side == "lower") == lower_is_a:
                _unlink_in_sequence(a, b, a_id, b_id, a_port, b_port)
            else:
                _unlink_in_sequence(b, a, b_id, a_id, b_port, a_port)
            a.call(P.finalize)
            b.call(P.finalize)
    print("simultaneous mutual links:", outcomes)


@pytest.mark.parametrize("first", ["lower", "higher"])
def test_mutual_link_one_after_the_other(first):
    with peers("lo", "hi", env=ENV) as (lo, hi):
        lo_port = lo.call(P.start, "PROMPT", 3, f"{HOST}:0", seed=7)
        hi_port = hi.call(P.start, "DECODER", 9, f"{HOST}:0", seed=8)
        if first == "lower":
            assert lo.call(P.link, [(9, HOST, hi_port)]) == OK
            assert hi.call(P.link, [(3, HOST, lo_port)]) == OK
        else:
            assert hi.call(P.link, [(3, HOST, lo_port)]) == OK
            assert lo.call(P.link, [(9, HOST, hi_port)]) == OK
        _one_link_each(lo, hi, 3, 9)
        _both_ways(lo, hi, 3, 9, 7, 8)
        # unlink from the side that did not start the link
        if first == "lower":
            _unlink_in_sequence(hi, lo, 9, 3, hi_port, lo_port)
        else:
            _unlink_in_sequence(lo, hi, 3, 9, lo_port, hi_port)
        # and they link again afterwards, the other way round
        assert lo.call(P.link, [(9, HOST, hi_port)]) == OK
        _one_link_each(lo, hi, 3, 9)
        _both_ways(lo, hi, 3, 9, 7, 8)


def test_mutual_unlinks_at_the_same_moment_both_succeed():
    """Both sides of a mutual link unlink at once (released by one go over a barrier socket): both
    get LLM_SUCCESS and the link is gone on both.  Two interleavings are legal and each is checked:
    the requests crossed (each side answered the other's and closed with ``unlink_succeeded``), or
    one arrived first (that side's link was kept, ``unlink_kept``, and closed by the other's
    request, ``peer_unlinked``).  Before: LLM_NOTIFY_PROMPT_UNLINK_FAILED on the side whose own
    request was never answered (8 of 8 runs of the sample)."""
    outcomes = []
    with peers("x", "y", env=ENV) as (x, y):
        for rnd in range(4):
            x_id, y_id = 30 + rnd, 40 + rnd
            x_port = x.call(P.start, "PROMPT", x_id, f"{HOST}:0", seed=rnd + 1)
            y_port = y.call(P.start, "DECODER", y_id, f"{HOST}:0", seed=rnd + 5)
            assert x.call(P.link, [(y_id, HOST, y_port)]) == OK
            assert y.call(P.link, [(x_id, HOST, x_port)]) == OK
            _one_link_each(x, y, x_id, y_id)
            with socket.socket() as barrier:
                barrier.bind((HOST, 0))
                barrier.listen(2)
                barrier.settimeout(30.0)
                fx = x.call_async(P.unlink_on_go, barrier.getsockname()[1], [(y_id, HOST, y_port)])
                fy = y.call_async(P.unlink_on_go, barrier.getsockname()[1], [(x_id, HOST, x_port)])
                conns = [barrier.accept()[0] for _ in range(2)]
                for conn in conns:
                    conn.sendall(b"g")
                for conn in conns:
                    conn.close()
                assert fx.result(30.0) == OK and fy.result(30.0) == OK
            for h, peer in ((x, y_id), (y, x_id)):
                state, _ = h.call(P.wait_link_state, peer, (None,), 5.0)
                assert state is None, state
            tx = [e["trigger"] for e in x.call(P.events) if e["id"] == y_id]
            ty = [e["trigger"] for e in y.call(P.events) if e["id"] == x_id]
            assert "failed" not in tx + ty and "unlink_failed" not in tx + ty and "force_unlink" not in tx + ty
            if tx[-2:] == ["unlink", "unlink_succeeded"] and ty[-2:] == ["unlink", "unlink_succeeded"]:
                outcomes.append("crossed")
            elif tx[-3:] == ["unlink", "unlink_kept", "peer_unlinked"]:
                assert ty[-2:] == ["unlink", "unlink_succeeded"], (tx, ty)
                outcomes.append("x first")
            else:
                assert ty[-3:] == ["unlink", "unlink_kept", "peer_unlinked"], (tx, ty)
                assert tx[-2:] == ["unlink", "unlink_succeeded"], (tx, ty)
                outcomes.append("y first")
            x.call(P.finalize)
            y.call(P.finalize)
    print("mutual unlinks at the same moment:", outcomes)
