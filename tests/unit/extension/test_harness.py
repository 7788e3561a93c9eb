"""Tests of the multi-process test harness: peers, checkpoints, loopback proxy, leak snapshots."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import threading
import time
import uuid

import pytest

from llmdd._base.status import LLMException, LLMStatusCode
from llmdd.testing._harness import (
    CheckpointError,
    PeerCallError,
    PeerExitedError,
    RemoteTraceback,
    checkpoint,
    checkpoint_hits,
    free_port,
    peers,
    spawn_peer,
)
from llmdd.testing._leaks import ResourceLeakError, ResourceSnapshot, peer_snapshot
from llmdd.testing._proxy import LoopbackProxy

pytestmark = pytest.mark.timeout(30)

# /dev/shm is host-wide: other processes' segments come and go, so only ours are looked at
OTHERS_SHM = r"shm:(?!llmdd-test-)"


@dataclasses.dataclass(frozen=True)
class _Box:
    """A class defined in the test module: must travel both ways, whatever pytest's import mode."""

    value: int

# ---------------------------------------------------------------- peer functions (module level)


def _put(state, key, value):
    state[key] = value
    return len(state)


def _get(state, key):
    return state[key]


def _pid(state):
    return os.getpid()


def _getenv(state, key):
    return os.environ.get(key)


def _boom(state, text):
    raise ValueError(text)


def _llm_fail(state):
    raise LLMException("link refused", status_code=LLMStatusCode.LLM_LINK_FAILED)


def _sleep(state, seconds):
    time.sleep(seconds)
    return "slept"


def _unpicklable_result(state):
    return threading.Lock()


def _staged(state):
    checkpoint("before")
    state["reached"] = "mid"
    checkpoint("mid")
    return "done"


def _ticks(state, n):
    for _ in range(n):
        checkpoint("tick")
    return n


def _serve_echo(state):
    """Listen on 127.0.0.1:0 in the child, echo one connection in a thread; return the address."""
    srv = socket.create_server(("127.0.0.1", 0))
    state["server"] = srv

    def run():
        conn, _ = srv.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()


def _leak_socket(state):
    state["leak"] = socket.socket()
    return state["leak"].fileno()


def _close_socket(state):
    state.pop("leak").close()


# ---------------------------------------------------------------- peers


def test_calls_share_state_in_a_separate_process():
    with peers("prompt") as (prompt,):
        assert prompt.call(_put, "engine", {"id": 7}, timeout=5) == 2  # peer_name + engine
        assert prompt.call(_get, "engine", timeout=5) == {"id": 7}
        prompt.call(_put, "box", _Box(3), timeout=5)
        assert prompt.call(_get, "box", timeout=5) == _Box(3)
        assert prompt.call(_get, "peer_name", timeout=5) == "prompt"
        assert prompt.call(_pid, timeout=5) == prompt.pid != os.getpid()
        futures = [prompt.call_async(_put, f"k{i}", i) for i in range(5)]
        assert [f.result(5) for f in futures] == [4, 5, 6, 7, 8]
    assert prompt.exitcode == 0


def test_exception_is_reraised_with_the_child_traceback():
    with peers("p") as (p,):
        with pytest.raises(ValueError, match="bad block index") as info:
            p.call(_boom, "bad block index", timeout=5)
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "_boom" in cause.tb_text and "raise ValueError(text)" in cause.tb_text
        assert "_boom" in info.value.remote_traceback

        with pytest.raises(LLMException) as info:
            p.call(_llm_fail, timeout=5)
        assert info.value.status_code is LLMStatusCode.LLM_LINK_FAILED
        assert "_llm_fail" in info.value.__cause__.tb_text

        with pytest.raises(PeerCallError, match="not picklable"):
            p.call(_unpicklable_result, timeout=5)
        with pytest.raises((pickle.PicklingError, AttributeError)):
            p.call_async(lambda state: 1)  # refused in the parent, before sending
        assert p.call(_pid, timeout=5) == p.pid  # still serving


def test_call_deadline_then_kill_fails_pending_calls():
    with peers("slow") as (slow,):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="_sleep"):
            slow.call(_sleep, 30, timeout=0.3)
        assert time.monotonic() - t0 < 2
        pending = slow.call_async(_pid)  # queued behind the sleep
        slow.kill()
        assert slow.exitcode == -signal.SIGKILL
        with pytest.raises(PeerExitedError) as info:
            pending.result(5)
        assert info.value.exitcode == -signal.SIGKILL
        with pytest.raises(PeerExitedError):
            slow.call(_pid, timeout=5)


def test_stalled_peer_misses_its_deadline_and_answers_after_resume():
    with peers("p") as (p,):
        p.stall()
        assert p.stalled
        with pytest.raises(TimeoutError):
            p.call(_pid, timeout=0.3)
        p.resume()
        assert not p.stalled
        assert p.call(_pid, timeout=5) == p.pid


def test_checkpoint_kill_stall_and_raise():
    with peers("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.arm("mid", "kill")
        with pytest.raises(PeerExitedError):
            a.call(_staged, timeout=5)
        assert a.exitcode == -signal.SIGKILL
        assert a.fired == [("mid", "kill")]

        b.arm("mid", "stall")
        fut = b.call_async(_staged)
        assert b.wait_fired("mid", timeout=5) == "stall"  # returns once the child is stopped
        assert b.stalled
        with pytest.raises(TimeoutError):
            fut.result(0.3)
        b.resume()
        assert fut.result(5) == "done"

        b.arm("tick", "raise", nth=3)
        with pytest.raises(CheckpointError, match="tick"):
            b.call(_ticks, 5, timeout=5)
        assert b.call(checkpoint_hits, timeout=5) == {"before": 1, "mid": 1, "tick": 3}
        assert b.call(_ticks, 5, timeout=5) == 5  # fired once, now disarmed
        assert b.fired == [("mid", "stall"), ("tick", "raise")]

        b.arm("tick", "raise")
        b.disarm("tick")
        assert b.call(_ticks, 1, timeout=5) == 1
        with pytest.raises(ValueError):
            b.arm("tick", "explode")  # type: ignore[arg-type]


def test_checkpoint_is_a_noop_outside_a_peer():
    checkpoint("anything")  # nothing armed in the parent, nothing happens


def test_env_is_set_before_the_child_imports_anything():
    key = f"LLMDD_HARNESS_TEST_{uuid.uuid4().hex[:8]}"
    with spawn_peer("e", env={key: "yes", "ASCEND_GLOBAL_LOG_LEVEL": "0"}) as e:
        assert e.call(_getenv, key, timeout=5) == "yes"
    assert key not in os.environ
    assert e.exitcode == 0


def test_peers_reaps_every_child_when_the_test_fails():
    with pytest.raises(RuntimeError, match="test failed"):
        with peers("x", "y", close_timeout=0.5) as cluster:
            handles = list(cluster)
            cluster["x"].stall()
            cluster["y"].call_async(_sleep, 30)
            raise RuntimeError("test failed")
    for h in handles:
        assert h.exitcode is not None
        with pytest.raises(ProcessLookupError):
            os.kill(h.pid, 0)


def test_peer_returns_its_listening_address():
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        pass  # free_port gives a bindable 127.0.0.1 port
    with peers("server") as (server,):
        host, port = server.call(_serve_echo, timeout=5)
        assert host == "127.0.0.1"
        with socket.create_connection((host, port), timeout=5) as c:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"


def test_harness_itself_leaves_no_threads_or_fds():
    before = ResourceSnapshot.take()
    with peers("p") as (p,):
        p.call(_pid, timeout=5)
    before.assert_no_leaks(grace_s=2, ignore=[OTHERS_SHM])


# ---------------------------------------------------------------- proxy


@pytest.fixture
def echo_server():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()
    conns = []

    def serve(conn):
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def accept_loop():
        workers = []
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            conns.append(conn)
            t = threading.Thread(target=serve, args=(conn,), daemon=True)
            t.start()
            workers.append(t)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in workers:
            t.join(5)

    t = threading.Thread(target=accept_loop, name="echo-server", daemon=True)
    t.start()
    yield srv.getsockname()
    stop.set()
    t.join(5)
    srv.close()


def _recv_exactly(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(buf)
        buf += chunk
    return buf


def test_proxy_forwards_both_ways_and_counts_bytes(echo_server):
    before = ResourceSnapshot.take()
    with LoopbackProxy(*echo_server) as proxy:
        assert proxy.host == "127.0.0.1"
        payload = os.urandom(300_000)
        with socket.create_connection(proxy.address, timeout=5) as c:
            c.sendall(payload)
            assert _recv_exactly(c, len(payload)) == payload
            assert proxy.active == 1
    # counters are final once close() joined the I/O thread
    assert proxy.bytes_client_to_target == proxy.bytes_target_to_client == len(payload)
    assert proxy.accepted == 1
    before.assert_no_leaks(grace_s=2, ignore=[OTHERS_SHM])  # proxy thread joined, every socket closed


def test_proxy_partition_holds_the_connection_silently_until_heal(echo_server):
    with LoopbackProxy(*echo_server) as proxy, socket.create_connection(proxy.address, timeout=5) as c:
        c.sendall(b"a")
        assert c.recv(1) == b"a"
        proxy.partition()
        c.sendall(b"held")
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):  # no data, and no FIN (recv would return b"")
            c.recv(16)
        with socket.create_connection(proxy.address, timeout=5) as late:  # accepted, but held too
            late.sendall(b"z")
            late.settimeout(0.2)
            with pytest.raises(TimeoutError):
                late.recv(1)
            proxy.heal()
            late.settimeout(5)
            assert late.recv(1) == b"z"
        c.settimeout(5)
        assert _recv_exactly(c, 4) == b"held"


def test_proxy_reset_all_gives_connection_reset(echo_server):
    with LoopbackProxy(*echo_server) as proxy, socket.create_connection(proxy.address, timeout=5) as c:
        c.sendall(b"x")
        assert c.recv(1) == b"x"
        proxy.reset_all()
        with pytest.raises(ConnectionResetError):
            c.recv(1)
        assert proxy.active == 0


def test_proxy_delay_and_drop_after(echo_server):
    with LoopbackProxy(*echo_server) as proxy, socket.create_connection(proxy.address, timeout=5) as c:
        proxy.delay(0.2)
        t0 = time.monotonic()
        c.sendall(b"slow")
        assert _recv_exactly(c, 4) == b"slow"
        assert time.monotonic() - t0 >= 0.35  # delayed in both directions
        proxy.delay(0)
        proxy.drop_after(3)
        c.sendall(b"abcdef")
        assert _recv_exactly(c, 3) == b"abc"
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):
            c.recv(16)
        assert proxy.bytes_dropped == 3


def test_proxy_to_a_closed_port_resets_the_client():
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        with LoopbackProxy(*closed.getsockname()) as proxy:
            # the refusal surfaces as a reset (at connect when it is that fast), never as EOF
            with pytest.raises(ConnectionResetError), socket.create_connection(proxy.address, timeout=5) as c:
                c.recv(1)


# ---------------------------------------------------------------- leaks


def test_snapshot_detects_leaked_thread_fd_and_shm_then_passes_when_cleaned():
    before = ResourceSnapshot.take()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10,), name="leaky-worker")
    thread.start()
    sock = socket.socket()
    shm_name = f"llmdd-test-{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm/{shm_name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    try:
        t0 = time.monotonic()
        with pytest.raises(ResourceLeakError) as info:
            before.assert_no_leaks(grace_s=0.3, ignore=[OTHERS_SHM])
        assert 0.3 <= time.monotonic() - t0 < 2
        report = info.value.report
        assert [name for _, name in report.threads] == ["leaky-worker"]
        assert [fd for fd, _ in report.fds] == [sock.fileno()]
        assert report.fds[0][1].startswith("socket:")
        assert report.shm == (shm_name,)  # only ours: the others are ignored
        text = str(info.value)
        assert "'leaky-worker'" in text and f"fd {sock.fileno()} -> socket:" in text and shm_name in text
        before.assert_no_leaks(grace_s=0, ignore=["thread:leaky", "fd:socket:", f"shm:{shm_name}", OTHERS_SHM])
    finally:
        sock.close()
        os.unlink(f"/dev/shm/{shm_name}")
        threading.Timer(0.1, release.set).start()  # finishes during the grace period
    before.assert_no_leaks(grace_s=3, ignore=[OTHERS_SHM])
    thread.join(5)


def test_snapshot_inside_a_peer():
    with peers("p") as (p,):
        before = p.call(peer_snapshot, timeout=5)
        assert before.pid == p.pid
        fd = p.call(_leak_socket, timeout=5)
        with pytest.raises(ResourceLeakError, match=f"fd {fd} -> socket:"):
            before.assert_no_leaks(lambda: p.call(peer_snapshot, timeout=5), grace_s=0.2, ignore=[OTHERS_SHM])
        foreign = p.call(peer_snapshot, timeout=5)
        t0 = time.monotonic()
        with pytest.raises(ResourceLeakError):  # a snapshot of another process is compared once
            before.assert_no_leaks(foreign, grace_s=5, ignore=[OTHERS_SHM])
        assert time.monotonic() - t0 < 1
        p.call(_close_socket, timeout=5)
        before.assert_no_leaks(lambda: p.call(peer_snapshot, timeout=5), grace_s=2, ignore=[OTHERS_SHM])
        with pytest.raises(ValueError, match="different processes"):
            before.diff(ResourceSnapshot.take())
