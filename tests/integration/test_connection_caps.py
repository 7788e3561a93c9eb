"""Hardening of the listeners (issue 13): pending-connection caps, listeners that survive accept and
worker failures, a listener that cannot continue is recorded, idle data connections are cut.

The server engine lives in the test process (its threads and descriptors are counted, its accept
and worker start are patched); the legitimate client is a real child process linking over
loopback and comparing bytes it pulled.  Floods come from the test process, from several
loopback source addresses (127.0.0.x: all of 127/8 is local on Linux).
"""

from __future__ import annotations

import errno
import multiprocessing.resource_tracker
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest

from llmdd import LLMStatusCode
from llmdd._runtime.ioloop import Pool
from llmdd.plugin import hookimpl
from llmdd_tcp import endpoint_fields
from llmdd.testing._harness import peers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}

pytestmark = pytest.mark.timeout(120)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return threading.active_count()


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class EngineEvents:
    def __init__(self) -> None:
        self.events = []

    @hookimpl
    def llmdd_engine_transition(self, event) -> None:
        self.events.append(event)


@pytest.fixture
def server():
    """An in-process server engine with the patterned cache of ``_peers.start`` (cluster id 1)."""
    # the first spawned peer of a process starts multiprocessing's resource tracker, whose pipe stays
    # open for the process's life: start it now, so that a test run alone has the same fd baseline
    multiprocessing.resource_tracker.ensure_running()
    state: dict = {}
    made = []

    def make(extra=None, seed=11):
        rec = EngineEvents()
        from llmdd import LLMDataDist, LLMRole

        dd = LLMDataDist(LLMRole.PROMPT, 1)
        dd.add_plugin(rec, name="engine-events")
        made.append(dd)
        # P.start builds its own engine: reuse its option and cache conventions here
        dd.init(P.options(f"{HOST}:0", extra))
        data = P.pattern(1, seed)
        bufs = [np.ascontiguousarray(data[i]) for i in range(2)]
        from llmdd import BlocksCacheKey, CacheDesc, DataType

        desc = CacheDesc(2, [P.NUM_BLOCKS, P.BLOCK_ELEMS], DataType.DT_FLOAT)
        cache = dd.cache_manager.register_blocks_cache(desc, [b.ctypes.data for b in bufs], BlocksCacheKey(1, 0))
        state.update(dd=dd, bufs=bufs, cache=cache, rec=rec, seed=seed)
        lm = dd._core.link_manager
        return dd, lm, lm.listen_address[1], rec

    yield make
    for dd in made:
        dd.finalize()


def _good_link(d, port: int, timeout_ms: int = 5000, seed: int = 11) -> float:
    """``d`` links to the server, pulls two blocks and compares them; returns the link's seconds."""
    started = time.monotonic()
    result = d.call(P.link, [(1, HOST, port)], timeout_ms, timeout=timeout_ms / 1000 + 30)
    took = time.monotonic() - started
    assert result == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), result
    assert d.call(P.pull, 1, [0, 3], [1, 2])[0] == "LLM_SUCCESS"
    got = d.call(P.blocks)
    want = P.pattern(1, seed)
    np.testing.assert_array_equal(got[:, 1], want[:, 0])
    np.testing.assert_array_equal(got[:, 2], want[:, 3])
    assert d.call(P.unlink, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    return took


def _flood(port: int, n: int, addresses: int) -> list:
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((f"127.0.0.{2 + i % addresses}", 0))
        s.settimeout(10.0)
        s.connect((HOST, port))
        socks.append(s)
    return socks


def test_flood_of_600_idle_connections_then_a_link_succeeds_in_time(server):
    dd, lm, port, _ = server()
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False)
        _good_link(d, port)   # warm: the pool threads this engine uses exist
        fds0 = _fds()
        # the loop's pool starts workers on demand (at most its size) and ends them after a second
        # idle, so how many live at any moment depends on how the work happened to queue: the bound
        # that holds whatever the number of connections is the threads outside the pool plus its size
        pool = lm.loop.pool
        threads0 = _threads() - pool.threads() + pool.size
        flood = _flood(port, 600, 75)   # 8 per source address, 600 in all
        try:
            _wait(lambda: lm.io_statistics()["listeners"][0]["accepted"] >= 1 + 600, 30.0, "600 accepts")
            io = lm.io_statistics()
            assert io["pending"] <= 64, io
            assert _threads() <= threads0, "threads grew with idle connections"
            took = _good_link(d, port, timeout_ms=5000)
            assert took < 5.0, took
            # the flood is still there: what the server holds stays within its caps
            assert lm.io_statistics()["pending"] <= 64
            assert _threads() <= threads0
        finally:
            for s in flood:
                s.close()
        _wait(lambda: lm.io_statistics()["pending"] == 0, 15.0, "pending connections to drain")
        _wait(lambda: _fds() <= fds0, 15.0, f"descriptors back to {fds0} (now {_fds()})")
        assert _threads() <= threads0


def test_a_flood_from_one_address_is_capped_at_8_and_refused_at_once(server):
    dd, lm, port, _ = server()
    flood = _flood(port, 40, 1)   # all from 127.0.0.2
    try:
        _wait(lambda: lm.io_statistics()["listeners"][0]["accepted"] >= 40, 20.0, "40 accepts")
        io = lm.io_statistics()
        assert io["pending"] == 8, io
        assert io["refused_per_address"] == 32, io
        # the 32 refused ones got the one busy frame and the end of the stream, nothing else
        refused = 0
        for s in flood:
            s.settimeout(0.2)
            try:
                data = s.recv(4096)
            except socket.timeout:
                continue   # one of the 8 held: the server waits for its Hello
            refused += 1
            assert data.startswith(b"LD") or data == b"", data
        assert refused == 32
    finally:
        for s in flood:
            s.close()


def test_handshake_deadline_cuts_idle_pending_connections(server):
    dd, lm, port, _ = server({"llmdd.handshake_timeout_ms": "500"})
    fds0 = _fds()
    flood = _flood(port, 16, 2)
    try:
        _wait(lambda: lm.io_statistics()["listeners"][0]["accepted"] >= 16, 20.0, "16 accepts")
        started = time.monotonic()
        for s in flood:
            s.settimeout(5.0)
            assert s.recv(4096) == b""   # the server closed it: the deadline always applies
        assert time.monotonic() - started < 3.0
        _wait(lambda: lm.io_statistics()["pending"] == 0, 5.0, "pending to drain")
    finally:
        for s in flood:
            s.close()
    _wait(lambda: _fds() <= fds0, 10.0, "descriptors back to baseline")


def test_worker_start_failing_refuses_links_then_they_succeed(server, monkeypatch):
    dd, lm, port, _ = server()
    real = Pool._start_worker
    failing = {"on": True, "count": 0}

    def start_worker(self):
        if failing["on"]:
            failing["count"] += 1
            raise RuntimeError("can't start new thread")
        return real(self)

    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False)
        fds0, threads0 = _fds(), _threads()
        monkeypatch.setattr(Pool, "_start_worker", start_worker)
        for _ in range(3):
            started = time.monotonic()
            result = d.call(P.link, [(1, HOST, port)], 3000)
            assert result == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED]), result
            assert time.monotonic() - started < 3.0 + 1.0
        assert failing["count"] >= 3
        assert lm.io_statistics()["listeners"][0]["state"] == "listening"
        failing["on"] = False
        _good_link(d, port)
        assert lm.io_statistics()["listeners"][0]["state"] == "listening"
        # the refused attempts left nothing behind; the pools' workers end after a second without work
        _wait(lambda: _threads() <= threads0, 10.0, f"threads back to {threads0} (now {_threads()})")
        _wait(lambda: _fds() <= fds0, 10.0, f"descriptors back to {fds0} (now {_fds()})")


class _FlakyAccept:
    """Stands in for the listening socket: ``accept`` fails with ``errors`` first, then works."""

    def __init__(self, sock, errors) -> None:
        self._sock = sock
        self.errors = list(errors)

    def accept(self):
        if self.errors:
            raise self.errors.pop(0)
        return self._sock.accept()

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_accept_failures_refuse_one_attempt_and_the_listener_goes_on(server):
    dd, lm, port, rec = server()
    listener = lm.listeners.control
    listener.sock = _FlakyAccept(listener.sock, [OSError(errno.EMFILE, "Too many open files")] * 5
                                 + [OSError(errno.ECONNABORTED, "aborted"), MemoryError()])
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False)
        _good_link(d, port)
        stats = lm.io_statistics()["listeners"][0]
        assert stats["state"] == "listening" and stats["accept_errors"] == 7, stats
        assert not [e for e in rec.events if e.trigger == "listener_failed"]


def test_a_listener_that_cannot_continue_is_logged_once_recorded_and_links_fail_typed(server, caplog):
    from llmdd._tools.doctor import check_engine

    dd, lm, port, rec = server()
    listener = lm.listeners.control
    listener.sock = _FlakyAccept(listener.sock, [OSError(errno.EBADF, "Bad file descriptor")])
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False)
        with caplog.at_level("ERROR", logger="llmdd"):
            result = d.call(P.link, [(1, HOST, port)], 3000)
            assert result[0] is S.LLM_LINK_FAILED, result
            _wait(lambda: [e for e in rec.events if e.trigger == "listener_failed"], 5.0, "the engine event")
            # a second attempt after the listener died: refused at once, typed
            started = time.monotonic()
            assert d.call(P.link, [(1, HOST, port)], 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
            assert time.monotonic() - started < 3.0
        failed = [r for r in caplog.records if "listener_failed" in r.getMessage()]
        assert len(failed) == 1, [r.getMessage() for r in caplog.records]
        (event,) = [e for e in rec.events if e.trigger == "listener_failed"]
        assert event.info["listener"] == "control" and "Bad file descriptor" in str(event.error)
        stats = lm.io_statistics()["listeners"]
        assert any(s["state"] == "failed" for s in stats), stats
        checks = check_engine(dd)
        assert any(c.name == "listener" and c.status == "fail" and "cannot continue" in c.message
                   for c in checks), checks
        # the engine listens again on request (switch_role with a listen address)
        dd.switch_role(dd._role, {"llm.listenIpInfo": f"{HOST}:0"})
        new_port = lm.listen_address[1]
        _good_link(d, new_port)


def test_idle_tcp_data_connections_are_cut_by_their_deadline(server):
    extra = {"llmdd.transport": "tcp", "llmdd.tcp.pending_timeout_ms": "800"}
    dd, lm, port, _ = server(extra)
    ep = lm.endpoint("tcp")
    data_port = endpoint_fields(ep.describe()).port
    fds0 = _fds()
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False, extra=extra)
        threads0 = _threads()
        idle = _flood(data_port, 200, 25)   # 8 per address
        try:
            _wait(lambda: ep.statistics()["connections"] + ep.statistics()["refused_connections"] >= 200, 20.0,
                  "200 data connections")
            assert ep.statistics()["pending_connections"] <= 64
            assert _threads() <= threads0 + 1   # the endpoint's pool may start one worker, no more
            started = time.monotonic()
            for s in idle:
                s.settimeout(5.0)
                got = b""
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                assert len(got) in (0, 40), got   # a HELLO (held ones) or nothing (refused at once)
            assert time.monotonic() - started < 4.0
            assert ep.statistics()["pending_expired"] >= 1
        finally:
            for s in idle:
                s.close()
        # a real link still moves bytes after the flood (its own data stream proves itself, so the
        # deadline never cuts it; were it cut while idle, the channel reconnects)
        result = d.call(P.link, [(1, HOST, port)], 5000)
        assert result == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), result
        assert d.call(P.pull, 1, [0, 3], [1, 2])[0] == "LLM_SUCCESS"
        got = d.call(P.blocks)
        want = P.pattern(1, 11)
        np.testing.assert_array_equal(got[:, 1], want[:, 0])
        np.testing.assert_array_equal(got[:, 2], want[:, 3])
        assert d.call(P.unlink, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # the pools' workers end after a second without work: the count comes back to the baseline
        _wait(lambda: _threads() <= threads0 + 1, 10.0, f"threads back to {threads0} (now {_threads()})")
    _wait(lambda: ep.statistics()["open_connections"] == 0, 10.0, "data connections to close")
    _wait(lambda: _fds() <= fds0, 10.0, f"descriptors back to {fds0} (now {_fds()})")


def test_a_full_tcp_data_port_still_takes_a_links_stream(server):
    """64 idle data connections from 8 addresses fill every pending slot of the data port (and would
    hold them 10 s at a time): a link's own data stream, from another address, takes the place of the
    busiest address's oldest instead of being refused, so the link and its pulls still work."""
    extra = {"llmdd.transport": "tcp"}
    dd, lm, port, _ = server(extra)
    ep = lm.endpoint("tcp")
    data_port = endpoint_fields(ep.describe()).port
    fds0 = _fds()
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False, extra=extra)
        threads0 = _threads()
        idle = _flood(data_port, 64, 8)   # 127.0.0.2-9, 8 each: every slot taken
        try:
            _wait(lambda: ep.statistics()["connections"] >= 64, 20.0, "64 data connections")
            assert ep.statistics()["pending_connections"] == 64
            _good_link(d, port)   # its data stream comes from 127.0.0.1
            stats = ep.statistics()
            assert stats["evicted"] >= 1 and stats["pending_connections"] <= 64, stats
        finally:
            for s in idle:
                s.close()
        _wait(lambda: _threads() <= threads0 + 1, 10.0, f"threads back to {threads0} (now {_threads()})")
    _wait(lambda: ep.statistics()["open_connections"] == 0, 10.0, "data connections to close")
    _wait(lambda: _fds() <= fds0, 10.0, f"descriptors back to {fds0} (now {_fds()})")


class _BrokenListeningSocket(socket.socket):
    """A listening socket whose ``accept`` fails as on a descriptor closed under it."""

    __slots__ = ()

    def accept(self):
        raise OSError(errno.EBADF, "Bad file descriptor")


def test_a_tcp_data_port_that_cannot_continue_is_recorded_and_the_next_link_gets_a_fresh_one(server, caplog):
    from llmdd._tools.doctor import check_engine

    extra = {"llmdd.transport": "tcp"}
    dd, lm, port, rec = server(extra)
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False, extra=extra)
        assert d.call(P.link, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        ep = lm.endpoint("tcp")
        old_port = endpoint_fields(ep.describe()).port
        ep._lsock.__class__ = _BrokenListeningSocket   # its next accept fails; closing it still works
        with caplog.at_level("ERROR", logger="llmdd"):
            socket.create_connection((HOST, old_port), timeout=5.0).close()
            _wait(lambda: [e for e in rec.events if e.trigger == "listener_failed"], 5.0, "the engine event")
            _wait(lambda: lm.links() and all(lk.state.value == "failed" for lk in lm.links()), 5.0,
                  "the tcp link to fail")
        failed = [r for r in caplog.records if "listener_failed" in r.getMessage()]
        assert len(failed) == 1, [r.getMessage() for r in caplog.records]
        (event,) = [e for e in rec.events if e.trigger == "listener_failed"]
        assert event.info["listener"] == "tcp-data" and "Bad file descriptor" in str(event.error)
        (link,) = lm.links()
        assert link.failure_status is S.LLM_LINK_FAILED
        checks = check_engine(dd)
        assert any(c.name == "listener" and c.status == "fail" and "tcp-data" in c.message for c in checks), checks
        # the peer learns at once (its control connection was closed) and links again: a fresh data port
        state, _ = d.call(P.wait_link_state, 1, ("failed", None), 5.0)
        assert state in ("failed", None), state
        d.call(P.unlink, [(1, HOST, port)])
        _good_link(d, port)
        assert endpoint_fields(lm.endpoint("tcp").describe()).port != old_port


def test_an_io_loop_that_cannot_continue_fails_links_typed_and_is_reported(server):
    from llmdd._tools.doctor import check_engine

    dd, lm, port, rec = server()
    with peers("d", env=ENV) as (d,):
        d.call(P.start, "DECODER", 2, key=False)
        assert d.call(P.link, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.pull, 1, [0], [0])[0] == "LLM_SUCCESS"
        # the selector breaks under the loop (as if its descriptor were closed by a bug elsewhere)
        lm.loop._sel.close()
        lm.loop.call_soon(lambda: None)   # wake it: its next select fails
        _wait(lambda: lm.io_statistics()["io_error"], 5.0, "the loop to report its end")
        # the dying loop's thread records the error first, then fails the listener, then every link:
        # wait for the last of those before looking at any of them
        _wait(lambda: [e for e in rec.events if e.trigger == "listener_failed"], 5.0, "listener_failed")
        _wait(lambda: all(lk.state.value == "failed" for lk in lm.links()), 5.0, "every link to fail")
        (event,) = [e for e in rec.events if e.trigger == "listener_failed"]
        assert event.info["listener"] == "control"
        # the peer learns at once: its control connection was shut down
        state, _ = d.call(P.wait_link_state, 1, ("failed", None), 5.0)
        assert state in ("failed", None), state
        assert d.call(P.pull, 1, [0], [0])[0] != "LLM_SUCCESS"
        # this engine refuses new links with a typed status instead of hanging
        status, codes = dd.link_clusters([P._cluster(2, HOST, port)], 2000)
        assert status is S.LLM_LINK_FAILED and codes == [S.LLM_LINK_FAILED]
        checks = check_engine(dd)
        assert any(c.name == "engine" and c.status == "fail" and "I/O loop stopped" in c.message for c in checks)
