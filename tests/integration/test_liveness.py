"""Liveness across real processes: killed, stalled and partitioned peers, restarts, and exit without finalize.

Every engine runs with ``llmdd.keepalive_interval_ms=200`` and ``llmdd.peer_timeout_ms=1000``: a
silent peer must be declared lost within ``peer timeout + keepalive interval`` (the keepalive thread
checks once per interval) plus a little scheduling slack.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from llmdd import LLMStatusCode
from llmdd.testing._harness import Cluster, peers
from llmdd.testing._proxy import LoopbackProxy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402  (children load it from its file: see the harness)

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}
KEEPALIVE_MS, PEER_TIMEOUT_MS = 200, 1000
FAST = {"llmdd.keepalive_interval_ms": str(KEEPALIVE_MS), "llmdd.peer_timeout_ms": str(PEER_TIMEOUT_MS)}
#: a silent peer is declared lost by then (timeout + one keepalive period + slack for a loaded 2-core box)
SILENT_BOUND_S = (PEER_TIMEOUT_MS + KEEPALIVE_MS) / 1000.0 + 0.8
#: a peer whose sockets the kernel closed (SIGKILL) is seen at once, through the control connection
KILLED_BOUND_S = 1.0
FAIL_FAST_S = 0.5

pytestmark = pytest.mark.timeout(60)


def _failed_event(events: list) -> dict:
    failed = [e for e in events if e["dest"] == "failed"]
    assert failed, events
    return failed[-1]


def _pull_bytes_ok(d, remote_id: int, seed: int) -> None:
    status, _ = d.call(P.pull, remote_id, [1, 2], [0, 3])
    assert status == "LLM_SUCCESS"
    got, want = d.call(P.blocks), P.pattern(remote_id, seed)
    np.testing.assert_array_equal(got[:, 0], want[:, 1])
    np.testing.assert_array_equal(got[:, 3], want[:, 2])


# --------------------------------------------------------------------------- killed peer


def test_sigkilled_peer_is_detected_with_an_event_and_calls_fail_fast():
    with peers("p", "d", "stable", env=ENV) as c:
        p, d, stable = c["p"], c["d"], c["stable"]
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=FAST)
        stable_port = stable.call(P.start, "PROMPT", 3, f"{HOST}:0", seed=3, extra=FAST)
        d.call(P.start, "DECODER", 2, extra=FAST)
        assert d.call(P.link, [(1, HOST, port), (3, HOST, stable_port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS] * 2)
        _pull_bytes_ok(d, 1, 1)

        killed_at = time.monotonic()
        p.kill()
        state, waited = d.call(P.wait_link_state, 1, ("failed",), 4.0)
        assert state == "failed", state
        assert waited <= KILLED_BOUND_S, waited
        ev = _failed_event(d.call(P.events))
        assert ev["error"] and ev["peer"] == 1 and ev["trigger"] == "peer_lost", ev
        assert ev["at"] - killed_at <= KILLED_BOUND_S  # CLOCK_MONOTONIC is system-wide on Linux

        # typed, fast failures until unlinked
        for _ in range(3):
            status, took = d.call(P.pull, 1, [0], [0])
            assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S, (status, took)
        status, took = d.call(P.push, 1, [0], [0])
        assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S
        # the stable pair is untouched
        assert d.call(P.link_states)[3] == "linked"
        _pull_bytes_ok(d, 3, 3)
        # a non-force unlink of a failed link cannot notify the peer, and still tears it down here
        status, codes = d.call(P.unlink, [(1, HOST, port)], False, 2000)
        assert codes[0] in (S.LLM_NOTIFY_PROMPT_UNLINK_FAILED, S.LLM_SUCCESS), codes
        assert 1 not in d.call(P.link_states)
        assert d.call(P.pull, 1, [0], [0])[0] == "LLM_NOT_YET_LINK"


# --------------------------------------------------------------------------- restart on the same port


def test_relink_after_peer_restart_uses_the_new_incarnation():
    with Cluster(env=ENV) as c:
        p, d = c.spawn("p", "d")
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=FAST)
        d.call(P.start, "DECODER", 2, extra=FAST)
        assert d.call(P.link, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_bytes_ok(d, 1, 1)

        p.kill()
        assert d.call(P.wait_link_state, 1, ("failed",), 4.0)[0] == "failed"
        status, took = d.call(P.pull, 1, [1], [0])
        assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S

        # same port, same cluster id, different memory contents (and addresses: another process)
        (p2,) = c.spawn("p2")
        assert p2.call(P.start, "PROMPT", 1, f"{HOST}:{port}", seed=2, extra=FAST) == port
        # the FAILED link stays failed: nothing is silently re-pointed at the new incarnation
        time.sleep(0.3)
        status, took = d.call(P.pull, 1, [1], [0])
        assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S
        assert p2.call(P.link_states) == {}

        assert d.call(P.unlink, [1], True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.link, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        d.call(P.fill, 0.0)
        _pull_bytes_ok(d, 1, 2)            # the NEW bytes
        assert not np.array_equal(P.pattern(1, 1), P.pattern(1, 2))
        assert p2.call(P.link_states) == {2: "linked"}


# --------------------------------------------------------------------------- silent peers


def test_partitioned_link_goes_failed_on_both_sides_within_the_bound():
    with peers("p", "d", env=ENV) as (p, d):
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=FAST)
        d.call(P.start, "DECODER", 2, extra=FAST)
        with LoopbackProxy(HOST, port) as proxy:
            assert d.call(P.link, [(1, HOST, proxy.port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            _pull_bytes_ok(d, 1, 1)
            time.sleep(0.5)  # keepalives flow through the proxy: nobody fails while it forwards
            assert d.call(P.link_states) == {1: "linked"} and p.call(P.link_states) == {2: "linked"}

            partitioned_at = time.monotonic()
            proxy.partition()      # silence: no data, no FIN, no RST
            assert d.call(P.wait_link_state, 1, ("failed",), 5.0)[0] == "failed"
            assert p.call(P.wait_link_state, 2, ("failed",), 5.0)[0] == "failed"
            for h, peer in ((d, 1), (p, 2)):
                ev = _failed_event(h.call(P.events))
                assert ev["error"] and ev["peer"] == peer
                took = ev["at"] - partitioned_at
                assert PEER_TIMEOUT_MS / 1000.0 - 0.3 <= took <= SILENT_BOUND_S, took

            # typed and fast, on both sides, also after the network heals
            for healed in (False, True):
                if healed:
                    proxy.heal()
                    time.sleep(0.5)
                status, took = d.call(P.pull, 1, [0], [0])
                assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S, (status, took)
                status, took = p.call(P.pull, 2, [0], [0])
                assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S, (status, took)

            # unlink + relink (through the healed proxy) recovers
            assert d.call(P.unlink, [1], True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert p.call(P.unlink, [2], True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            assert d.call(P.link, [(1, HOST, proxy.port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            d.call(P.fill, 0.0)
            _pull_bytes_ok(d, 1, 1)


def test_stalled_peer_is_declared_lost_and_the_link_recovers_after_relink():
    with peers("p", "d", env=ENV) as (p, d):
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=FAST)
        d.call(P.start, "DECODER", 2, extra=FAST)
        assert d.call(P.link, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        stalled_at = time.monotonic()
        p.stall()  # SIGSTOP: sockets stay open, nothing answers
        try:
            state, _ = d.call(P.wait_link_state, 1, ("failed",), 5.0)
            assert state == "failed"
            ev = _failed_event(d.call(P.events))
            assert ev["at"] - stalled_at <= SILENT_BOUND_S
            status, took = d.call(P.pull, 1, [0], [0])
            assert status == "LLM_LINK_FAILED" and took < FAIL_FAST_S
        finally:
            p.resume()
        # the resumed peer notices too (its last message from D is old) or sees D's side as alive;
        # both sides force unlink, as the contract asks after a failure, and link again
        assert d.call(P.unlink, [1], True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert p.call(P.unlink, [2], True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.link, [(1, HOST, port)]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_bytes_ok(d, 1, 1)


# --------------------------------------------------------------------------- exit without finalize


_CLIENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    import _peers as P
    state = {{}}
    P.start(state, "DECODER", 2, extra={fast!r})
    print("LINK", P.link(state, [(1, "127.0.0.1", {port})])[0].name, flush=True)
    print("PULL", P.pull(state, 1, [0], [0])[0], flush=True)
    print("MAIN_DONE", flush=True)
""")


def test_process_that_never_finalizes_exits_promptly_and_its_peer_sees_the_link_go():
    with peers("p", env=ENV) as c:
        p = c["p"]
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=FAST)
        env = {k: v for k, v in os.environ.items() if k != "LLMDD_AUTH_SECRET"}
        script = _CLIENT.format(here=os.path.dirname(os.path.abspath(__file__)), fast=FAST, port=port)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        lines = []
        main_done_at = None
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line.strip())
                if line.startswith("MAIN_DONE"):
                    main_done_at = time.monotonic()
                    break
            assert main_done_at is not None, (lines, proc.stderr.read() if proc.poll() is not None else "")
            rc = proc.wait(timeout=5)
            exit_s = time.monotonic() - main_done_at
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        assert lines[:2] == ["LINK LLM_SUCCESS", "PULL LLM_SUCCESS"], lines
        assert rc == 0, proc.stderr.read()
        assert exit_s <= 2.0, exit_s
        state, waited = p.call(P.wait_link_state, 2, (None, "failed"), 3.0)
        assert state in (None, "failed")
        assert waited <= 1.5
