"""link_clusters / unlink_clusters / switch_role across real processes, in the official samples' shapes.

Every engine lives in its own child process (one engine per process), spawned by
``llmdd.testing._harness``; the functions the children run are in ``_peers.py``.  Every wait is
bounded (harness call deadlines, polling with deadlines).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
import pytest

from llmdd import LLMStatusCode
from llmdd.testing._harness import Cluster, free_port, peers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402  (children load it from its file: see the harness)

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}  # a secret in the developer's environment must not leak into these tests

pytestmark = pytest.mark.timeout(60)


def ip_port_to_int(ip: str, port: int) -> int:
    """The xpyd sample's cluster id: ``(ipv4 as big-endian int << 16) | port``."""
    return (int.from_bytes(socket.inet_aton(ip), "big") << 16) | port


def assert_codes(result, overall, each):
    status, codes = result
    assert isinstance(status, S) and isinstance(codes, list), result
    assert status is overall, result
    assert codes == list(each), result


# --------------------------------------------------------------------------- pull_blocks_xpyd


def test_pull_blocks_xpyd_several_prompts_in_one_call():
    ports = [free_port() for _ in range(3)]
    ids = [ip_port_to_int(HOST, p) for p in ports]
    d_id = ip_port_to_int(HOST, free_port())
    with peers("p0", "p1", "p2", "d", env=ENV) as c:
        prompts = [c["p0"], c["p1"], c["p2"]]
        d = c["d"]
        for i, (h, port, cid) in enumerate(zip(prompts, ports, ids)):
            assert h.call(P.start, "PROMPT", cid, f"{HOST}:{port}", seed=10 + i) == port
        d.call(P.start, "DECODER", d_id, key=False)
        targets = [(cid, HOST, port) for cid, port in zip(ids, ports)]

        # a pull before any link: typed status, no hang
        assert d.call(P.pull, ids[0], [0, 1], [0, 2])[0] == "LLM_NOT_YET_LINK"

        assert_codes(d.call(P.link, targets, 5000), S.LLM_SUCCESS, [S.LLM_SUCCESS] * 3)
        # the three links were made in parallel: far less than 3 sequential handshakes would need
        assert d.call(P.last_link_s) < 3.0
        # linking again: every cluster answers LLM_ALREADY_LINK
        assert_codes(d.call(P.link, targets, 5000), S.LLM_ALREADY_LINK, [S.LLM_ALREADY_LINK] * 3)
        for h in prompts:
            assert h.call(P.link_states) == {d_id: "linked"}

        for cid, seed in zip(ids, (10, 11, 12)):
            assert d.call(P.pull, cid, [0, 1], [0, 2])[0] == "LLM_SUCCESS"
            got = d.call(P.blocks)
            want = P.pattern(cid, seed)
            np.testing.assert_array_equal(got[:, 0], want[:, 0])
            np.testing.assert_array_equal(got[:, 2], want[:, 1])

        # the sample's non-force unlink of the whole list (the remote ips are in the infos)
        assert_codes(d.call(P.unlink, targets, False, 5000), S.LLM_SUCCESS, [S.LLM_SUCCESS] * 3)
        assert d.call(P.link_states) == {}
        for h in prompts:  # the server side was told: its link is gone, not FAILED
            assert h.call(P.wait_link_state, d_id, (None,), 3.0)[0] is None
        assert d.call(P.pull, ids[1], [0], [0])[0] == "LLM_NOT_YET_LINK"
        d.call(P.finalize)


# --------------------------------------------------------------------------- both directions


def test_pull_both_directions_exist_link_and_unlink_notifies_server():
    with peers("p", "d", env=ENV) as (p, d):
        port = p.call(P.start, "PROMPT", 101, f"{HOST}:0", seed=1)
        d.call(P.start, "DECODER", 202, seed=2)
        target = [(101, HOST, port)]
        assert d.call(P.pull, 101, [0], [0])[0] == "LLM_NOT_YET_LINK"
        assert p.call(P.pull, 202, [0], [0])[0] == "LLM_NOT_YET_LINK"
        assert_codes(d.call(P.link, target), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert p.call(P.wait_link_state, 202, ("linked",), 3.0)[0] == "linked"

        # the client pulls from the server ...
        assert d.call(P.pull, 101, [0, 3], [1, 2])[0] == "LLM_SUCCESS"
        got = d.call(P.blocks)
        want_p = P.pattern(101, 1)
        np.testing.assert_array_equal(got[:, 1], want_p[:, 0])
        np.testing.assert_array_equal(got[:, 2], want_p[:, 3])
        # ... and the server pulls from the client (block 0 of the client is still its own pattern)
        assert p.call(P.pull, 202, [0], [3])[0] == "LLM_SUCCESS"
        np.testing.assert_array_equal(p.call(P.blocks)[:, 3], P.pattern(202, 2)[:, 0])

        # switch_role is refused on both sides while the link exists
        assert p.call(P.switch_role, "DECODER") == "LLM_EXIST_LINK"
        assert d.call(P.switch_role, "PROMPT", f"{HOST}:0") == "LLM_EXIST_LINK"

        # non-force unlink from the client notifies the server: its link is gone
        assert_codes(d.call(P.unlink, target, False), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        state, _ = p.call(P.wait_link_state, 202, (None,), 3.0)
        assert state is None
        assert p.call(P.pull, 202, [0], [0])[0] == "LLM_NOT_YET_LINK"
        triggers = [e["trigger"] for e in p.call(P.events)]
        assert "peer_unlinked" in triggers and not any(e["dest"] == "failed" for e in p.call(P.events))
        # a second non-force unlink of what is no longer linked
        assert_codes(d.call(P.unlink, target, False), S.LLM_NOT_YET_LINK, [S.LLM_NOT_YET_LINK])
        # and switch_role is allowed again
        assert p.call(P.switch_role, "PROMPT", f"{HOST}:{port}") is None


# --------------------------------------------------------------------------- push_blocks sample


def test_push_blocks_sample_both_listen_force_unlink_both_sides():
    with peers("p", "d", env=ENV) as (p, d):
        p_port = p.call(P.start, "PROMPT", 0, f"{HOST}:0", seed=3)
        d_port = d.call(P.start, "DECODER", 1, f"{HOST}:0", seed=4)
        assert p_port and d_port
        assert_codes(d.call(P.link, [(0, HOST, p_port, d_port)]), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.push, 0, [0, 1], [0, 2])[0] == "LLM_SUCCESS"
        got = p.call(P.blocks)
        want = P.pattern(1, 4)
        np.testing.assert_array_equal(got[:, 0], want[:, 0])
        np.testing.assert_array_equal(got[:, 2], want[:, 1])
        np.testing.assert_array_equal(got[:, 1], P.pattern(0, 3)[:, 1])  # untouched

        # force unlink on D (only remote_cluster_id, no ips): only D's side goes away
        assert_codes(d.call(P.unlink, [0], True), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.link_states) == {}
        assert d.call(P.push, 0, [0], [0])[0] == "LLM_NOT_YET_LINK"
        # P sees the peer go: its link FAILED (not silently gone), transfers on it fail typed
        state, _ = p.call(P.wait_link_state, 1, ("failed",), 3.0)
        assert state == "failed"
        assert p.call(P.pull, 1, [0], [0])[0] == "LLM_LINK_FAILED"
        # then P's own force unlink succeeds, and a repeated one too
        assert_codes(p.call(P.unlink, [1], True), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert p.call(P.link_states) == {}
        assert_codes(p.call(P.unlink, [1], True), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        # a fresh link works after both force unlinks
        assert_codes(d.call(P.link, [(0, HOST, p_port)]), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.push, 0, [3], [3])[0] == "LLM_SUCCESS"
        np.testing.assert_array_equal(p.call(P.blocks)[:, 3], want[:, 3])


# --------------------------------------------------------------------------- P.push_cache sample


def test_push_cache_sample_non_force_unlink_with_remote_ip():
    with peers("p", "d", env=ENV) as (p, d):
        p_port = p.call(P.start, "PROMPT", 0, f"{HOST}:0", register=False)
        d.call(P.start, "DECODER", 1, f"{HOST}:0", register=False)
        assert p.call(P.register_plain, 0) == 1       # the sample relies on the first cache id being 1
        assert d.call(P.register_plain, 7) == 1
        target = [(0, HOST, p_port)]
        assert_codes(d.call(P.link, target), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.push_cache, 0) == "LLM_SUCCESS"
        np.testing.assert_array_equal(p.call(P.plain_bytes), P.plain_pattern(7))
        assert_codes(d.call(P.unlink, target, False), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert p.call(P.wait_link_state, 1, (None,), 3.0)[0] is None
        assert d.call(P.link_states) == {}


# --------------------------------------------------------------------------- switch_role sample


def test_switch_role_sample():
    with peers("p", "d", env=ENV) as (p, d):
        p_port = p.call(P.start, "PROMPT", 11, f"{HOST}:0", seed=5)
        d.call(P.start, "DECODER", 22, seed=6)
        assert d.call(P.listen_port) is None
        assert_codes(d.call(P.link, [(11, HOST, p_port)]), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert d.call(P.pull, 11, [0, 1], [0, 2])[0] == "LLM_SUCCESS"
        np.testing.assert_array_equal(d.call(P.blocks)[:, 2], P.pattern(11, 5)[:, 1])
        assert_codes(d.call(P.unlink, [(11, HOST, p_port)], False), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert p.call(P.wait_link_state, 22, (None,), 3.0)[0] is None

        # P becomes a decoder: it stops listening
        assert p.call(P.switch_role, "DECODER") is None
        assert p.call(P.listen_port) is None
        with pytest.raises(OSError):
            socket.create_connection((HOST, p_port), timeout=1.0).close()
        # D becomes a prompt with the options of LLMConfig(listen_ip_info=...).generate_options()
        d_port = free_port()
        assert d.call(P.switch_role, "PROMPT", f"{HOST}:{d_port}") is None
        assert d.call(P.listen_port) == d_port
        # P links to D; D pushes with layer ranges and tensor_num_per_layer=1
        assert_codes(p.call(P.link, [(22, HOST, d_port)]), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        p.call(P.fill, 0.0)
        status, _ = d.call(P.push, 11, [0, 1], [0, 2], src_layer_range=range(0, 2),
                           dst_layer_range=range(0, 2), tensor_num_per_layer=1)
        assert status == "LLM_SUCCESS"
        got, d_now = p.call(P.blocks), d.call(P.blocks)
        np.testing.assert_array_equal(got[:, 0], d_now[:, 0])
        np.testing.assert_array_equal(got[:, 2], d_now[:, 1])
        assert not got[:, 1].any() and not got[:, 3].any()
        # a layer subset: only layer 1 of block 3
        status, _ = d.call(P.push, 11, [3], [3], src_layer_range=range(1, 2), dst_layer_range=range(1, 2),
                           tensor_num_per_layer=1)
        assert status == "LLM_SUCCESS"
        got = p.call(P.blocks)
        np.testing.assert_array_equal(got[1, 3], d_now[1, 3])
        assert not got[0, 3].any()
        # switch_role refused while linked, on both sides
        assert p.call(P.switch_role, "PROMPT", f"{HOST}:0") == "LLM_EXIST_LINK"
        assert d.call(P.switch_role, "DECODER") == "LLM_EXIST_LINK"
        # force unlink both
        assert_codes(p.call(P.unlink, [22], True), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert_codes(d.call(P.unlink, [11], True), S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert p.call(P.link_states) == {} and d.call(P.wait_link_state, 11, (None,), 3.0)[0] is None


# --------------------------------------------------------------------------- many decoders


N_DECODERS = 64


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_64_decoders_link_to_one_prompt_at_once():
    """One engine per process: 64 decoder processes link to one prompt server at the same moment."""
    with Cluster(env=ENV, close_timeout=20.0) as c:
        (p,) = c.spawn("p")
        # the server gives each handshake max(5 s, peer timeout): 64 at once on a loaded 2-core box need more
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra={"llmdd.peer_timeout_ms": "30000"})
        names = [f"d{i}" for i in range(N_DECODERS)]
        t0 = time.monotonic()
        decoders = c.spawn(*names)   # each while it lives: startup is CPU-bound imports
        spawn_s = time.monotonic() - t0
        for i, d in enumerate(decoders):
            d.call_async(P.start, "DECODER", 1000 + i, seed=i)
        for d in decoders:  # engines are ready (futures of start are awaited by the next call, in order)
            d.call(P.link_states, timeout=60.0)
        rss_before = p.call(P.rss)
        t0 = time.monotonic()
        futures = [d.call_async(P.link, [(1, HOST, port)], 30000) for d in decoders]
        results = [f.result(90.0) for f in futures]
        link_wall_s = time.monotonic() - t0
        failed = [(i, r) for i, r in enumerate(results) if r != (S.LLM_SUCCESS, [S.LLM_SUCCESS])]
        assert not failed, failed
        per_link_s = sorted(d.call(P.last_link_s) for d in decoders)
        states = p.call(P.link_states)
        assert len(states) == N_DECODERS and set(states.values()) == {"linked"}
        rss_after = p.call(P.rss)   # reported, not asserted (22.5-link in llmdd bench is the measured bound)
        # every decoder can pull
        want = P.pattern(1, 1)
        for d in decoders[:: max(1, N_DECODERS // 8)]:
            assert d.call(P.pull, 1, [2], [0])[0] == "LLM_SUCCESS"
            np.testing.assert_array_equal(d.call(P.blocks)[:, 0], want[:, 2])
        rss_per_link = (rss_after - rss_before) / N_DECODERS
        report = (f"64-link: spawn {spawn_s:.1f} s, link wall {link_wall_s:.2f} s, per-call median "
                  f"{per_link_s[len(per_link_s) // 2]:.3f} s max {per_link_s[-1]:.3f} s, server RSS "
                  f"{rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB ({rss_per_link / 1024:.0f} KiB/link)")
        print(report)
        out = os.environ.get("LLMDD_LINK_REPORT")
        if out:
            with open(out, "a") as fh:
                fh.write(report + "\n")
        futures = [d.call_async(P.unlink, [(1, HOST, port)], False, 30000) for d in decoders]
        unlinked = [f.result(60.0) for f in futures]
        assert all(r == (S.LLM_SUCCESS, [S.LLM_SUCCESS]) for r in unlinked), unlinked
        deadline = time.monotonic() + 10
        while p.call(P.link_states) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.call(P.link_states) == {}
