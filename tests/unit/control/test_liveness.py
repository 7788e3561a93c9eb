"""Link liveness driven by a fake clock and an in-memory pump: no socket, no thread, no sleep.

Two ends exchange Keepalive/KeepaliveAck through a pump that delivers each message ``latency``
seconds after it was sent; every keepalive interval each end ticks.  The link machine of the end
that gives its peer up is driven as the link manager drives it (``offer("peer_lost")``).
"""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from llmdd._control.liveness import Liveness, PeerLost, SendKeepalive
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import LINK_FAILED, LINK_IN_USE, Machine


def test_keepalives_are_numbered_and_silence_is_counted_from_the_last_message():
    live = Liveness(peer=7, timeout_s=5.0, last_rx=100.0)
    assert [live.tick(100.0 + t, None) for t in (1, 2, 3)] == [SendKeepalive(1), SendKeepalive(2), SendKeepalive(3)]
    live.received(104.0)
    assert live.tick(109.0, None) == SendKeepalive(4)          # 5.0 s of silence is not more than 5.0
    lost = live.tick(109.25, None)
    assert lost == PeerLost("no message from peer 7 for 5.2 s")
    assert live.seq == 4                                        # no keepalive goes to a lost peer


def test_a_peer_that_reads_nothing_is_lost_even_while_it_talks():
    live = Liveness(peer=3, timeout_s=2.0, last_rx=0.0)
    for now in (0.5, 1.0, 1.5, 2.0, 2.5):
        live.received(now)
        assert isinstance(live.tick(now, stalled_since=0.5), SendKeepalive)
    live.received(2.75)
    assert live.tick(2.75, stalled_since=0.5) == PeerLost("peer 3 has read nothing for 2.2 s")


def test_restart_counts_silence_from_linked_not_from_a_slow_handshake():
    live = Liveness(peer=1, timeout_s=1.0, last_rx=0.0)
    assert live.lost(30.0, None) is not None                    # control: 30 s after creation
    live.restart(29.5)
    assert live.lost(30.0, None) is None


def test_round_trip_is_measured_from_the_echoed_timestamp():
    live = Liveness(peer=1, timeout_s=1.0, last_rx=0.0)
    live.acked(now_ns=5_250_000, echo_sent_at_ns=1_000_000)
    assert live.rtt_s == pytest.approx(0.00425)
    live.acked(now_ns=1, echo_sent_at_ns=2)                     # a clock that went backwards: never negative
    assert live.rtt_s == 0.0


class Pump:
    """Two ends, a fake clock, a queue of messages in flight (delivered ``latency`` s after sending)."""

    def __init__(self, *, interval: float, timeout: float, latency: float, seed: int) -> None:
        self.now = 0.0
        self.interval = interval
        self.latency = latency
        self.rng = random.Random(seed)
        self.ends = {name: Liveness(peer=peer, timeout_s=timeout, last_rx=0.0)
                     for name, peer in (("a", 2), ("b", 1))}
        lifecycle = Lifecycle(Machine.LINK)
        self.links = {name: lifecycle.create(name) for name in self.ends}
        for fsm in self.links.values():
            fsm.fire("link")
            fsm.fire("handshake_succeeded")
        self.queue: list = []
        self.order = itertools.count()
        self.cut: set[str] = set()        # ends whose outgoing messages are lost
        self.reasons: dict[str, str] = {}
        self.failed_at: dict[str, float] = {}
        self.sent = {"a": 0, "b": 0}

    def send(self, src: str, kind: str, payload: int) -> None:
        self.sent[src] += 1
        if src in self.cut:
            return
        jitter = self.rng.uniform(0.0, self.latency / 4)
        heapq.heappush(self.queue, (self.now + self.latency + jitter, next(self.order), src, kind, payload))

    def deliver_until(self, t: float) -> None:
        while self.queue and self.queue[0][0] <= t:
            at, _, src, kind, payload = heapq.heappop(self.queue)
            self.now = at
            dst = "b" if src == "a" else "a"
            if not self.links[dst].in_(LINK_IN_USE):
                continue
            self.ends[dst].received(at)
            if kind == "keepalive":
                self.send(dst, "ack", payload)
            else:
                self.ends[dst].acked(int(at * 1e9), payload)
        self.now = t

    def run(self, until: float) -> None:
        ticks = itertools.count(1)
        while True:
            t = next(ticks) * self.interval
            if t > until:
                return
            self.deliver_until(t)
            for name, live in self.ends.items():
                if not self.links[name].in_(LINK_IN_USE):
                    continue
                action = live.tick(t, None)
                if isinstance(action, PeerLost):
                    self.reasons[name] = action.reason
                    self.failed_at[name] = t
                    assert self.links[name].offer("peer_lost", reason=action.reason)
                else:
                    self.send(name, "keepalive", int(t * 1e9))


def test_live_peers_are_never_given_up_and_measure_their_round_trip():
    pump = Pump(interval=1.0, timeout=5.0, latency=0.2, seed=11)
    pump.run(until=600.0)
    assert pump.reasons == {}
    assert all(fsm.in_(LINK_IN_USE) for fsm in pump.links.values())
    assert pump.sent["a"] >= 2 * 599 and pump.sent["b"] >= 2 * 599     # keepalive + ack per tick each
    for live in pump.ends.values():
        assert 0.4 <= live.rtt_s <= 0.5                        # two hops of 0.2 s + at most 0.05 s jitter each


def test_a_silent_peer_is_given_up_after_the_timeout_and_only_its_partner_fails():
    pump = Pump(interval=1.0, timeout=5.0, latency=0.1, seed=12)
    pump.run(until=20.0)
    assert pump.reasons == {}
    pump.cut.add("b")                       # b's messages are lost from t=20 on (b still hears a)
    pump.run(until=30.0)
    # a last heard b at 20.1-20.125 (b's ack of a's keepalive sent at 20.0 was in flight): the tick at
    # 25 finds 4.9 s of silence, the one at 26 more than 5 s
    assert pump.failed_at == {"a": 26.0}
    assert pump.reasons["a"] == "no message from peer 2 for 5.9 s"
    assert pump.links["a"].in_(LINK_FAILED) and pump.links["b"].in_(LINK_IN_USE)
    # a failed link sends nothing more: b last heard a's keepalive of t=25 (at ~25.1) and gives up at 31
    pump.run(until=40.0)
    assert pump.failed_at == {"a": 26.0, "b": 31.0}


def test_control_a_pump_that_delivers_nothing_fails_both_ends():
    pump = Pump(interval=1.0, timeout=5.0, latency=0.1, seed=13)
    pump.cut.update({"a", "b"})
    pump.run(until=10.0)
    assert set(pump.reasons) == {"a", "b"}
    assert all(fsm.in_(LINK_FAILED) for fsm in pump.links.values())
