"""The link table (llmdd/_control/table.py) without sockets: links by peer, aliases, links being made.

Links are real ``Link`` records driven through the real link lifecycle (no connection is ever used:
the table reads only a link's machine, its side and its peer's incarnation).  Cluster ids are drawn
from a seeded generator; each rule has a control that must come out the other way.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from llmdd._base.enums import LLMRole
from llmdd._base.status import LLMStatusCode
from llmdd._runtime.ioloop import Pool, Strand
from llmdd._control.link import Link
from llmdd._control.liveness import Liveness
from llmdd._protocol import messages as m
from llmdd._control.table import LinkTable
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine

S = LLMStatusCode

pytestmark = pytest.mark.timeout(30)


class _Peer:
    """What the table reads of a handshake's PeerInfo."""

    def __init__(self, incarnation: bytes) -> None:
        self.incarnation = incarnation


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return rng.sample(range(2, 1 << 30), n)


def _link(lc: Lifecycle, peer_id: int, *, client: bool, state: str, incarnation: bytes = b"i" * 16) -> Link:
    fsm = lc.create(peer_id, peer=peer_id)
    link = Link(peer_cluster_id=peer_id, fsm=fsm, control=None, peer=_Peer(incarnation),   # no connection: never used
                is_client=client, transport="tcp", strand=Strand(Pool(1, "table-test")),
                tables_ready=threading.Event(), settled=threading.Event(), created_at=time.monotonic(),
                liveness=Liveness(peer=peer_id, timeout_s=5.0, last_rx=time.monotonic()))
    if state != "unlinked":
        fsm.fire("link" if client else "accept", transport="tcp")
    if state in ("linked", "failed"):
        fsm.fire("handshake_succeeded", transport="tcp", reason="test")
    if state == "failed":
        fsm.fire("peer_lost", error=RuntimeError("gone"), reason="gone")
    return link


def _hello(cluster_id: int, incarnation: bytes = b"i" * 16) -> m.Hello:
    return m.Hello(cluster_id=cluster_id, role=LLMRole.PROMPT, incarnation=incarnation, host=m.HostIdentity.local(),
                   transports=(), min_version=1, max_version=1, nonce=random.Random(cluster_id).randbytes(16))


@pytest.fixture
def lc() -> Lifecycle:
    return Lifecycle(Machine.LINK)


def test_get_follows_aliases_and_remove_drops_only_the_current_entry(lc):
    me, peer, alias = _ids(1, 3)
    table = LinkTable(cluster_id=me, max_links=None, event=threading.Event)
    first = _link(lc, peer, client=True, state="linked")
    assert table.put(first) is None
    table.set_alias(alias, peer)
    assert table.get(peer) is first and table.get(alias) is first
    second = _link(lc, peer, client=True, state="linking")
    assert table.put(second) is first            # the replaced link goes back to the caller
    table.remove(first)                          # control: a replaced link no longer removes the entry
    assert table.get(alias) is second
    table.remove(second)
    assert table.get(peer) is None and table.links() == []


def test_reserve_answers_the_contract_status_and_hands_back_a_failed_link(lc):
    me, linked, setting_up, failed, fresh = _ids(2, 5)
    table = LinkTable(cluster_id=me, max_links=None, event=threading.Event)
    table.put(_link(lc, linked, client=True, state="linked"))
    table.put(_link(lc, setting_up, client=True, state="linking"))
    stale = _link(lc, failed, client=True, state="failed")
    table.put(stale)
    assert table.reserve(linked) == (S.LLM_ALREADY_LINK, None)
    assert table.reserve(setting_up) == (S.LLM_PROCESSING_LINK, None)
    assert table.reserve(failed) == (None, stale)   # reserved: the caller replaces it
    assert table.reserve(fresh) == (None, None)
    assert table.reserve(fresh) == (S.LLM_PROCESSING_LINK, None)   # one link_clusters per cluster at a time
    table.release(fresh)
    assert table.reserve(fresh) == (None, None)


def test_the_link_limit_counts_links_that_are_not_closed(lc):
    me, *peers = _ids(3, 4)
    table = LinkTable(cluster_id=me, max_links=2, event=threading.Event)
    table.put(_link(lc, peers[0], client=True, state="linked"))
    assert table.reserve(peers[2]) == (None, None)   # control: one link of two
    table.release(peers[2])
    table.put(_link(lc, peers[1], client=False, state="linking"))
    assert table.reserve(peers[2]) == (S.LLM_CLUSTER_NUM_EXCEED_LIMIT, None)
    over, cross, accepting = table.begin_accept(_hello(peers[2]))
    assert over and not cross and accepting is None


def test_a_cross_link_is_refused_only_by_the_lower_cluster_id(lc):
    low, high = sorted(_ids(4, 2))
    lower = LinkTable(cluster_id=low, max_links=None, event=threading.Event)
    assert lower.reserve(high) == (None, None)            # the lower side is dialling the higher one
    over, cross, accepting = lower.begin_accept(_hello(high))
    assert cross and not over and accepting is None
    higher = LinkTable(cluster_id=high, max_links=None, event=threading.Event)   # control: the higher side keeps the lower's link
    assert higher.reserve(low) == (None, None)
    over, cross, accepting = higher.begin_accept(_hello(low))
    assert not cross and accepting is not None
    higher.end_accept(low, accepting)


def test_a_restarted_peer_is_no_cross_link(lc):
    low, high = sorted(_ids(5, 2))
    table = LinkTable(cluster_id=low, max_links=None, event=threading.Event)
    table.put(_link(lc, high, client=True, state="linked", incarnation=b"a" * 16))
    assert table.begin_accept(_hello(high, b"a" * 16))[1] is True     # same incarnation: cross
    over, cross, accepting = table.begin_accept(_hello(high, b"b" * 16))
    assert not cross and accepting is not None                        # a new incarnation replaces it
    table.end_accept(high, accepting)


def test_an_accept_in_progress_is_claimed_once_and_its_event_released(lc):
    me, peer = _ids(6, 2)
    table = LinkTable(cluster_id=me, max_links=None, event=threading.Event)
    over, cross, accepting = table.begin_accept(_hello(peer))
    assert accepting is not None and not accepting.is_set()
    assert table.begin_accept(_hello(peer))[2] is None      # a second accept of that peer waits on none
    assert table.peer_started(peer)                         # link_clusters claims instead of dialling
    link, event = table.peer_link(peer)
    assert link is None and event is accepting
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: accepting.wait(5.0) and woke.set(), daemon=True)
    waiter.start()
    table.end_accept(peer, accepting)
    waiter.join(5.0)
    assert woke.is_set() and not table.peer_started(peer)
    server = _link(lc, peer, client=False, state="linked")
    table.put(server)
    assert table.peer_started(peer)
    assert table.claim(server, peer) is True
    assert table.claim(server, peer) is False               # the second claim: LLM_ALREADY_LINK
    assert not table.peer_started(peer)                     # claimed: a later call finds it linked
    assert table.reserve(peer) == (S.LLM_ALREADY_LINK, None)


def test_link_failures_are_kept_until_an_attempt_succeeds():
    me, a, b = _ids(7, 3)
    table = LinkTable(cluster_id=me, max_links=None, event=threading.Event)
    table.record_attempt(a, S.LLM_LINK_FAILED, "refused")
    table.record_attempt(b, S.LLM_TIMEOUT, "slow")
    got = table.link_failures()
    assert {k: (v["status"], v["error"]) for k, v in got.items()} == {a: ("LLM_LINK_FAILED", "refused"),
                                                                      b: ("LLM_TIMEOUT", "slow")}
    got[a]["error"] = "changed"                             # a copy: the table's record is unchanged
    table.record_attempt(b, S.LLM_SUCCESS, None)
    assert {k: v["error"] for k, v in table.link_failures().items()} == {a: "refused"}
