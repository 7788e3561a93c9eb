"""TLS settings of links (issue 14, item 2): TLS without a CA is refused at init unless
``llmdd.tls_insecure`` says so, a client checks the server certificate's name when a name is
given (``llmdd.tls_server_name``), and the tcp transport's data connections use TLS under the same
settings.  Real processes over loopback; certificates from trustme or the openssl CLI
(``_tls_certs``: with neither the tests fail under CI and skip elsewhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
import threading
import time

import numpy as np
import pytest

from llmdd import LLMException, LLMStatusCode
from llmdd.testing._harness import peers
from llmdd_tcp import endpoint_fields

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402
from _tls_certs import make_certs  # noqa: E402

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}
NAME = "llmdd-node.test"
TCP = {"llmdd.transport": "tcp"}   # same host: without it the link would take the shm transport

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    files = make_certs(tmp_path_factory.mktemp("tls_settings"))
    return {"llmdd.tls_cert": files["node.pem"], "llmdd.tls_key": files["node.key"], "ca": files["ca.pem"],
            "files": files}


def _cert_only(certs) -> dict:
    return {"llmdd.tls_cert": certs["llmdd.tls_cert"], "llmdd.tls_key": certs["llmdd.tls_key"]}


def _mutual(certs, **more) -> dict:
    return dict(_cert_only(certs), **{"llmdd.tls_ca": certs["ca"]}, **more)


# --------------------------------------------------------------------------- child side


def data_streams(state: dict, peer_cluster_id: int) -> list:
    """(is TLS, name checked) of each idle data stream of this engine's link to ``peer_cluster_id``."""
    import ssl

    ch = state["dd"]._core.link_manager.get(peer_cluster_id).channel
    with ch._lock:
        socks = list(ch._idle)
    return [(isinstance(s, ssl.SSLSocket) and s.version() in ("TLSv1.2", "TLSv1.3"),
             getattr(s, "server_hostname", None)) for s in socks]


def data_port_view(state: dict, peer_cluster_id: int) -> dict:
    """What a thief of the link to ``peer_cluster_id`` would need: the owner's tcp description, the
    capability granted to that link, and the first bytes of each region it may read."""
    lm = state["dd"]._core.link_manager
    ep = lm.endpoint("tcp")
    link = lm.get(peer_cluster_id)
    regions = {rid: (r.region.size, ctypes.string_at(r.region.addr, min(4096, r.region.size)))
               for rid, r in ep._regs.items() if r.region.remote_accessible}
    return {"desc": ep.describe(), "capability": bytes(link.capability), "regions": regions}


def data_usage(state: dict) -> dict:
    ep = state["dd"]._core.link_manager.endpoint("tcp")
    st = ep.statistics()
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "open_connections": st["open_connections"], "pending": st["pending_connections"],
            "tls_failures": st["tls_failures"], "requests": st["requests"], "bytes_served": st["bytes_served"],
            "tls": st["tls"]}


# --------------------------------------------------------------------------- test side


def _pull_ok(client, remote_id: int, seed: int) -> None:
    assert client.call(P.pull, remote_id, [1], [0])[0] == "LLM_SUCCESS"
    np.testing.assert_array_equal(client.call(P.blocks)[:, 0], P.pattern(remote_id, seed)[:, 1])


def test_tls_without_a_ca_is_refused_at_init_unless_insecure_is_explicit(certs):
    with peers("p", "d", env=ENV) as c:
        for extra in (_cert_only(certs), dict(_cert_only(certs), **{"llmdd.tls_insecure": "0"})):
            with pytest.raises(LLMException) as refused:
                c["p"].call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=extra)
            assert refused.value.status_code == S.LLM_PARAM_INVALID, refused.value
            assert "llmdd.tls_insecure" in str(refused.value) and "llmdd.tls_ca" in str(refused.value)
        # a name to check needs a CA to check it with
        with pytest.raises(LLMException) as refused:
            c["d"].call(P.start, "DECODER", 2, extra=dict(_cert_only(certs), **{"llmdd.tls_insecure": "1",
                                                                              "llmdd.tls_server_name": NAME}))
        assert refused.value.status_code == S.LLM_PARAM_INVALID
        # the explicit opt-out: both sides come up and a link works (encrypted, unverified)
        insecure = dict(_cert_only(certs), **{"llmdd.tls_insecure": "1"})
        port = c["p"].call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=insecure)
        c["d"].call(P.start, "DECODER", 2, extra=insecure)
        assert c["d"].call(P.link, [(1, HOST, port)], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_ok(c["d"], 1, 1)


def test_client_checks_the_server_certificate_name_when_one_is_given(certs):
    with peers("p", "right", "wrong", "ip", env=ENV) as c:
        c["right"].call(P.capture_logs)
        port = c["p"].call(P.start, "PROMPT", 1, f"{HOST}:0", seed=3, extra=_mutual(certs))
        target = [(1, HOST, port)]
        c["wrong"].call(P.start, "DECODER", 3, extra=_mutual(certs, **{"llmdd.tls_server_name": "other.test"}))
        assert c["wrong"].call(P.link, target, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert c["p"].call(P.link_states) == {}
        c["right"].call(P.start, "DECODER", 2, extra=_mutual(certs, **{"llmdd.tls_server_name": NAME, **TCP}))
        assert c["right"].call(P.link, target, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_ok(c["right"], 1, 3)
        # the data connection the pull used is TLS too, and checked the same name
        assert c["right"].call(data_streams, 1) == [(True, NAME)]
        # the certificate's IP address entry is a name too
        c["ip"].call(P.start, "DECODER", 4, extra=_mutual(certs, **{"llmdd.tls_server_name": HOST}))
        assert c["ip"].call(P.link, target, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


def _settled(p, base: dict, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        now = p.call(data_usage)
        if (now["threads"] <= base["threads"] and now["fds"] <= base["fds"] and now["pending"] == 0
                and now["open_connections"] <= base["open_connections"]) or time.monotonic() >= deadline:
            return now
        time.sleep(0.05)


def _stolen_read(opts: dict, view: dict) -> tuple:
    """Open the owner's data port from this process with ``view``'s capability under ``opts``; read
    the head of every region.  Returns ``(error or None, {region: bytes})``."""
    import attrs

    from llmdd.abc import RegionDescriptor
    from llmdd.lowlevel import MemRegion, encode_payload, make_ops
    from llmdd_tcp import VERSION, RegionFields, TcpTransport, endpoint_fields

    ep = TcpTransport(opts).open_endpoint()
    buf = np.zeros(4096, np.uint8)
    try:
        ep.register(MemRegion(region_id=1, addr=buf.ctypes.data, size=buf.size, remote_accessible=False,
                              placement=0))
        try:
            ch = ep.connect(attrs.evolve(view["desc"], capability=view["capability"]), timeout=5)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            return exc, {}
        got = {}
        for rid, (size, head) in view["regions"].items():
            forged = RegionFields(endpoint_id=endpoint_fields(view["desc"]).endpoint_id, region_id=rid, size=size,
                                  remote_accessible=True)   # what the thief would write for the region
            ch.add_remote_region(rid, size, RegionDescriptor(transport="tcp", version=VERSION,
                                                              payload=encode_payload(forged)))
            c = ch.read(make_ops(1, 0, rid, 0, len(head)), deadline=time.monotonic() + 5)
            assert c.wait(10)
            if c.error is not None:
                return c.error, got
            got[rid] = buf[:len(head)].tobytes()
        ch.close()
        return None, got
    finally:
        ep.close()


def test_tls_covers_the_tcp_data_connections(certs):
    """With TLS configured, the data port speaks TLS only: a plaintext client gets no byte of the
    protocol, and even a thief holding a live link's capability opens nothing without a certificate
    the owner's CA signed; with one, the same capability reads exactly the owner's bytes."""
    files = certs["files"]
    with peers("p", "d", env=ENV) as c:
        p, d = c["p"], c["d"]
        port = p.call(P.start, "PROMPT", 1, f"{HOST}:0", seed=5, extra=_mutual(certs))
        d.call(P.start, "DECODER", 2, extra=_mutual(certs, **TCP))
        assert d.call(P.link, [(1, HOST, port)], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_ok(d, 1, 5)
        assert d.call(data_streams, 1) == [(True, None)]      # an IP target and no name: the CA is checked
        view = p.call(data_port_view, 2)
        assert endpoint_fields(view["desc"]).tls is True and view["regions"]
        base = p.call(data_usage)
        assert base["tls"] is True

        # a plaintext client, raw: what a v2 client sends first, and random bytes
        rng = np.random.default_rng(1405)
        for payload in (bytes(64), rng.integers(0, 256, 512, dtype=np.uint8).tobytes()):
            got = b""
            with socket.create_connection((HOST, endpoint_fields(view["desc"]).port), timeout=5) as s:
                s.sendall(payload)
                s.settimeout(5)
                with contextlib.suppress(ConnectionResetError):
                    while chunk := s.recv(4096):
                        got += chunk
            assert b"LDTH" not in got and (got == b"" or got[:1] == b"\x15"), got[:16]

        # the stolen capability: through a plaintext tcp endpoint, a certificate of another CA, and
        # no certificate at all: every one refused, typed
        thieves = {"plaintext": {},
                   "other CA": {"llmdd.tls_cert": files["rogue_node.pem"], "llmdd.tls_key": files["rogue_node.key"],
                                "llmdd.tls_ca": files["rogue.pem"]},
                   "no certificate": {"llmdd.tls_ca": files["ca.pem"]}}
        for what, opts in thieves.items():
            err, got = _stolen_read(opts, view)
            assert err is not None and not got, (what, err)
            assert getattr(err, "status_code", None) == S.LLM_LINK_FAILED, (what, err)
            assert "TLS" in str(err), (what, err)
        now = _settled(p, base)
        assert now["requests"] == base["requests"] and now["bytes_served"] == base["bytes_served"], (base, now)
        assert now["tls_failures"] - base["tls_failures"] >= 4, (base, now)   # 2 raw + 2 thieves with TLS
        assert now["threads"] <= base["threads"] and now["fds"] <= base["fds"], (base, now)
        assert now["open_connections"] <= base["open_connections"] and now["pending"] == 0, (base, now)

        # the control: the same capability with a certificate the owner's CA signed reads the bytes
        err, got = _stolen_read(_mutual(certs), view)
        assert err is None, err
        assert got == {rid: head for rid, (_, head) in view["regions"].items()}
        # the link itself is unharmed
        _pull_ok(d, 1, 5)
