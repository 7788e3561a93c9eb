"""The simulated world's own promises (llmdd.testing.sim): its network's faults and its process faults.

Two simulated processes ("a" and "b", each a :class:`SimRuntime`) talk over the world's in-memory
sockets; every payload is seeded random bytes, compared on the other side.
"""

from __future__ import annotations

import errno
import socket

import numpy as np
import pytest

from llmdd.testing.sim import SimRuntime, World

pytestmark = pytest.mark.timeout(120)


def _pair(world: World) -> tuple[SimRuntime, SimRuntime, object, object]:
    """Runtimes a and b, and a connection from a to b: (a, b, a's end, b's end)."""
    a, b = SimRuntime(world, "a"), SimRuntime(world, "b")
    server = b.create_server(("127.0.0.1", 0), 8)
    client = a.create_connection(server.getsockname(), 5.0)
    accepted, _ = server.accept()
    return a, b, client, accepted


def _payloads(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes() for _ in range(n)]


def _read_all(world: World, sock, want: int, until: float) -> bytes:
    got = bytearray()
    sock.settimeout(0.0)
    while len(got) < want:
        if not world.run_until(lambda: bool(sock.rx) or sock.eof, until):
            break
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            continue
        if not chunk:
            break
        got += chunk
    return bytes(got)


def _run_stream(seed: int, *, latency: bool, loss: float) -> tuple[bytes, bytes, World]:
    world = World(seed)
    if latency:
        world.net.latency = lambda _s, _n: world.random.uniform(0.001, 0.050)
    world.net.loss = loss
    _a, _b, client, accepted = _pair(world)
    msgs = _payloads(seed, 200)   # about 200 KB: less than a connection holds, so no send waits
    for m in msgs:
        client.sendall(m)   # one message each
    sent = b"".join(msgs)
    return sent, _read_all(world, accepted, len(sent), world.now + 60), world


def test_a_stream_keeps_every_byte_in_order_under_random_latency_and_loss_and_time_moves():
    began = 1000.0
    sent, got, world = _run_stream(3, latency=True, loss=0.3)
    assert got == sent
    assert world.net.stats["lost"] > 0 and world.now > began
    # the control: without latency or loss the bytes arrive at once, and no time passes
    sent, got, world = _run_stream(3, latency=False, loss=0.0)
    assert got == sent and world.now == began and world.net.stats["lost"] == 0


def test_the_same_seed_gives_the_same_trace_over_a_shaped_network_and_another_seed_another():
    def trace(seed: int) -> str:
        return _run_stream(seed, latency=True, loss=0.3)[2].trace_hash()
    assert trace(5) == trace(5)
    assert trace(5) != trace(6)


def test_messages_reorder_across_connections_never_within_one():
    world = World(1)
    a, b = SimRuntime(world, "a"), SimRuntime(world, "b")
    server = b.create_server(("127.0.0.1", 0), 8)
    slow, fast = (a.create_connection(server.getsockname(), 5.0) for _ in range(2))
    world.net.latency = lambda sock, _n: 0.5 if sock is slow else 0.1
    slow_end, fast_end = server.accept()[0], server.accept()[0]
    slow.sendall(b"first")
    slow.sendall(b"second")
    fast.sendall(b"third")
    arrivals = []
    assert world.run_until(lambda: bool(fast_end.rx), world.now + 1)
    arrivals.append(("fast", world.now, bytes(fast_end.rx)))
    assert slow_end.rx == b""   # sent earlier, on the slower connection: overtaken
    assert world.run_until(lambda: len(slow_end.rx) == len(b"firstsecond"), world.now + 1)
    arrivals.append(("slow", world.now, bytes(slow_end.rx)))
    assert arrivals == [("fast", pytest.approx(1000.1), b"third"), ("slow", pytest.approx(1000.5), b"firstsecond")]


def test_a_duplicated_message_is_dropped_by_the_stream():
    world = World(2)
    world.net.dup = 1.0
    world.net.latency = lambda _s, _n: 0.001
    _a, _b, client, accepted = _pair(world)
    msgs = _payloads(2, 20)
    for m in msgs:
        client.sendall(m)
    assert _read_all(world, accepted, sum(map(len, msgs)), world.now + 5) == b"".join(msgs)
    assert world.net.stats["dup_dropped"] >= len(msgs)
    assert not world.run_until(lambda: bool(accepted.rx), world.now + 5)   # no copy shows up later


def test_a_cut_connection_is_silent_for_good_and_nothing_is_closed():
    world = World(4)
    _a, _b, client, accepted = _pair(world)
    client.sendall(b"before")
    assert _read_all(world, accepted, 6, world.now + 1) == b"before"
    world.net.cut(client)
    client.sendall(b"lost")
    accepted.sendall(b"lost too")
    assert not world.run_until(lambda: bool(accepted.rx) or bool(client.rx) or accepted.eof, world.now + 30)
    assert not client.closed and not accepted.closed


def test_a_partition_holds_messages_and_times_connects_out_and_the_heal_delivers_them_in_order():
    world = World(7)
    a, b, client, accepted = _pair(world)
    server = b.create_server(("127.0.0.1", 0), 8)
    world.net.partition(["a"], ["b"])
    msgs = _payloads(7, 10)
    for m in msgs:
        client.sendall(m)
    assert not world.run_until(lambda: bool(accepted.rx), world.now + 10)
    began = world.now
    with pytest.raises(socket.timeout):
        a.create_connection(server.getsockname(), 2.5)
    assert world.now - began == pytest.approx(2.5, abs=1e-9)   # the connect's own timeout, exactly
    healed = world.now
    world.net.heal()
    assert _read_all(world, accepted, sum(map(len, msgs)), world.now + 5) == b"".join(msgs)
    assert world.now == pytest.approx(healed + world.net.rto)
    a.create_connection(server.getsockname(), 2.5)   # the control: connects again after the heal


def test_a_stalled_process_reads_nothing_and_its_peer_backs_up_until_it_reads_again():
    world = World(8)
    _a, _b, client, accepted = _pair(world)
    world.net.stall("b")
    client.setblocking(False)
    data = _payloads(8, 1)[0] * 400
    sent = 0
    with pytest.raises(BlockingIOError) as full:
        while True:
            sent += client.send(data[sent % len(data):] or data)
    assert full.value.errno == errno.EAGAIN and sent == accepted.capacity
    assert accepted.sim_ready() & 1 == 0   # not readable for its loop while stalled
    world.net.unstall("b")
    assert accepted.sim_ready() & 1


def test_a_frozen_process_runs_nothing_until_thawed_and_then_everything_it_missed():
    world = World(9)
    a = SimRuntime(world, "a")
    ran = []
    a.call_later(1.0, ran.append, "timer")
    a.call_soon(ran.append, "soon")
    world.freeze(a)
    world.run(5.0)
    assert ran == [] and world.now == 1005.0
    world.thaw(a)
    world.settle()
    assert ran == ["soon", "timer"] and world.now == 1005.0   # late, as after SIGCONT, in their order


def test_a_crash_ends_the_process_its_peer_reads_what_was_on_the_wire_then_eof():
    world = World(10)
    world.net.latency = lambda _s, _n: 0.2
    a, b, client, accepted = _pair(world)
    stop = a.event()
    steps = []

    def worker() -> None:
        try:
            steps.append("waiting")
            stop.wait()
            steps.append("woken")   # never: the process died
        finally:
            steps.append("finally")

    a.start_worker("w", worker)
    a.call_later(3.0, steps.append, "timer")   # never: the process died
    world.settle()
    client.sendall(b"last words")
    a.crash()
    assert steps == ["waiting", "finally"] and world.fibers_of(a) == [] and client.closed
    assert _read_all(world, accepted, 100, world.now + 10) == b"last words" and accepted.eof
    world.run(5.0)
    assert steps == ["waiting", "finally"]
    accepted.close()
    b.close()
    world.settle()
    assert world.leftovers() == {"fibers": 0, "timers": 0, "watched": 0, "sockets": 1, "parked": 0}   # b's listener
