"""The tcp data port's pending streams (``_server.PendingStreams``): the per-address cap, the total cap and
which stream makes room, as the listener applies them to each accepted stream (issue 13's caps; issue 37
moved them out of the endpoint)."""

from __future__ import annotations

import random

import pytest

from llmdd.lowlevel import Refused
from llmdd_tcp._server import PendingStreams


class _Conn:
    def __init__(self, ip: str) -> None:
        self.ip = ip


def test_room_while_under_both_caps_then_the_oldest_of_the_busiest_address_makes_room():
    rng = random.Random(3701)
    pending = PendingStreams()
    ips = [f"10.0.0.{n}" for n in rng.sample(range(1, 250), 3)]
    conns = []
    for ip in (ips[0], ips[1], ips[0], ips[2], ips[0], ips[1]):   # ips[0] holds 3, ips[1] 2, ips[2] 1
        assert pending.admit(ip, 6, 4) is None
        c = _Conn(ip)
        pending.add(c)   # type: ignore[arg-type]  # only .ip is read
        conns.append(c)
    assert len(pending) == 6
    # full: a newcomer from an address holding fewer evicts the oldest stream of the busiest address
    assert pending.admit("192.168.1.1", 6, 4) is conns[0]
    assert pending.admit(ips[2], 6, 4) is conns[0]
    # the busiest address itself gets no room (nobody holds more than it does)
    with pytest.raises(Refused, match="too many connections"):
        pending.admit(ips[0], 6, 4)
    # proven streams no longer count: the oldest left of the busiest is chosen next
    pending.discard(conns[0])   # type: ignore[arg-type]
    assert conns[0] not in pending and conns[2] in pending  # type: ignore[operator]
    assert len(pending) == 5
    assert pending.admit("192.168.1.1", 6, 4) is None   # room again under a cap of 6
    # at a cap of 5: ips[0] and ips[1] hold 2 each; the address counted first holding the most (ips[0],
    # first added) gives its oldest stream left
    assert pending.admit("192.168.1.1", 5, 4) is conns[2]
    pending.discard(conns[2])   # type: ignore[arg-type]
    pending.discard(conns[4])   # type: ignore[arg-type]
    # ips[0] holds none now: ips[1] (2) is the busiest, its oldest is conns[1]
    assert pending.admit("192.168.1.1", 3, 4) is conns[1]


def test_the_per_address_cap_refuses_before_the_total_cap_is_looked_at():
    pending = PendingStreams()
    for _ in range(2):
        pending.add(_Conn("10.1.1.1"))   # type: ignore[arg-type]
    with pytest.raises(Refused, match="10.1.1.1 has too many"):
        pending.admit("10.1.1.1", 100, 2)
    assert pending.admit("10.1.1.2", 100, 2) is None   # the control: another address has room
    # discarding a stream that was never pending changes nothing
    pending.discard(_Conn("10.1.1.1"))   # type: ignore[arg-type]
    assert len(pending) == 2
    with pytest.raises(Refused):
        pending.admit("10.1.1.1", 100, 2)
