"""Hostile clients against the tcp data port (issue 14, items 1 and 5): the port serves a data
connection only to a peer that presents the capability its owner granted to a live link, and only
the regions announced to that link.

Real processes: an owner ``p`` (prompt, cluster 1), a second owner ``q`` (prompt, cluster 3) and a
decoder ``d`` (cluster 2) linked to them over loopback.  The attacker is this test process, on the
same host, speaking the data wire by hand (``_capability_peers.RawStream``).  Every case checks
the owner's memory (seeded tensors with seeded canary guards around each, as S5 of
test_security.py does), that no payload byte came back, and that the owner's threads, descriptors
and data connections return to their baseline.  A control per case shows the same raw client
*does* read and write with a live credential, so a refusal is the capability's doing.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _capability_peers as CP  # noqa: E402

from llmdd.testing._harness import Cluster  # noqa: E402

from conftest import ENV, PROMPT, R  # noqa: E402

pytestmark = pytest.mark.timeout(120)

OWNER2, DECODER = 3, 2
NT, NB, BS = 2, 4, 1024
SIZE = NB * BS
GUARD = 4096
#: the OPEN refusal: status 1 and no MAC; nothing else may come on the stream
OPEN_REFUSED = CP.OPEN_RSP.pack(1, bytes(32))


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(env=ENV)
    p, q, d = c.spawn("cap_p", "cap_q", "cap_d")
    yield c, p, q, d
    c.close()


def _owner(p, cluster_id: int = PROMPT, seed: int = 1) -> dict:
    port = p.call(R.setup, "PROMPT", cluster_id, listen=True)
    canary = p.call(R.register_guarded, "src", NT, NB, BS, seed=seed, guard_bytes=GUARD, key=(cluster_id, 0))
    assert not p.call(CP.describe_has_capability), "an engine's tcp description must not open its data port"
    return {"port": port, "data_port": p.call(CP.data_port), "rid": p.call(R.region_of, "src")[0],
            "canary": canary, "want": R.pattern(cluster_id, seed, NT, SIZE)}


def _decoder(d, *owners: dict) -> None:
    d.call(R.setup, "DECODER", DECODER)
    d.call(R.register_blocks, "dst", NT, NB, BS)
    for cluster_id, info in owners:
        res = d.call(R.link, [(cluster_id, info["port"])])
        assert res["status"] == "LLM_SUCCESS", res


def _no_canary(extra: bytes, canary: bytes) -> bool:
    return all(canary[i:i + 8] not in extra for i in range(0, len(canary) - 8, 8))


def _payload(seed: int, n: int) -> bytes:
    return np.random.default_rng([14, seed]).integers(0, 256, n, dtype=np.uint8).tobytes()


def _refused_open(port: int, cred: dict, what: str) -> None:
    """``cred`` does not open a data connection: OPEN refused, stream closed, nothing else sent."""
    s = CP.RawStream(port)
    try:
        res = s.open(cred)
        assert not res["opened"], f"{what}: the owner accepted the capability"
        assert res["status"] == 1 and not res["server_proved"], (what, res)
        assert res["extra"] == b"" and res["closed"], (what, res)
        # a request sent anyway on the refused stream gets nothing back
        after = s.request([(0, 0, 16)] * 3)
        assert after["status"] is None and after["extra"] == b"", (what, after)
    finally:
        s.close()


def _attacks(port: int, rid: int, cred: dict, what: str, seed: int) -> None:
    """Open with ``cred`` (must be refused) and, on streams that skip OPEN, read and write."""
    _refused_open(port, cred, what)
    # a client that sends a request straight after HELLO: its bytes are taken for an OPEN and refused
    ops = [(rid, 0, 64), (rid, 64, 64), (rid, SIZE - 64, 64)]
    for kind, payload in ((CP.READ, b""), (CP.WRITE, _payload(seed, 192))):
        res = CP.unopened_request(port, ops, kind, payload)
        assert res["status"] is None and res["closed"], (what, kind, res)
        assert res["extra"] == OPEN_REFUSED[:len(res["extra"])], (what, kind, res)


def _read_ok(port: int, cred: dict, rid: int, want: np.ndarray, canary: bytes) -> None:
    """Control: a live credential opens, the owner proves itself, and reads return exactly the bytes."""
    s = CP.RawStream(port)
    try:
        res = s.open(cred)
        assert res["opened"] and res["server_proved"], res
        ops = [(rid, 0, 64), (rid, SIZE - 64, 64)]
        got = s.request(ops)
        assert got["status"] == CP.ST_OK, got
        assert got["extra"] == want[0, :64].tobytes() + want[0, SIZE - 64:].tobytes()
        assert _no_canary(got["extra"], canary)
    finally:
        s.close()


def _back_to_baseline(p, baseline: dict) -> dict:
    now = p.call(CP.settle_usage, baseline)
    assert now["threads"] <= baseline["threads"], (baseline, now)
    assert now["fds"] <= baseline["fds"], (baseline, now)
    assert now["open_connections"] <= baseline["open_connections"] and now["pending"] == 0, (baseline, now)
    return now


def test_unlinked_and_forged_clients_read_and_write_nothing(cluster):
    c, p, q, d = cluster
    info = _owner(p)
    before = p.call(R.guarded_digest, "src")
    assert before["guards_intact"]
    base = p.call(CP.owner_usage)
    assert base["grants"] == 0
    rng = np.random.default_rng(1401)
    forged = [CP.forged_credential(rng) for _ in range(3)]
    # a real-looking handle (of a capability nobody was granted) with its own key
    cap = rng.bytes(32)
    forged.append({"handle": CP.handle_of(cap), "key": cap})
    for i, cred in enumerate(forged):
        _attacks(info["data_port"], info["rid"], cred, f"forged {i}", seed=i)
    assert p.call(R.guarded_digest, "src") == before, "an unlinked client changed the owner's memory"
    now = _back_to_baseline(p, base)
    assert now["requests"] == base["requests"] and now["bytes_served"] == base["bytes_served"], (base, now)
    assert now["capability_refused"] - base["capability_refused"] >= len(forged) * 3, (base, now)
    # control: a linked decoder's credential reads, through the very same raw client
    _decoder(d, (PROMPT, info))
    cred = d.call(CP.credential, PROMPT)
    assert cred["port"] == info["data_port"]
    _read_ok(info["data_port"], cred, info["rid"], info["want"], info["canary"])
    # and the same credential with one bit of its key flipped is refused (the MAC is checked)
    bad = dict(cred, key=bytes([cred["key"][0] ^ 1]) + cred["key"][1:])
    _refused_open(info["data_port"], bad, "flipped key")
    # the engine's own pull works (the decoder's channel holds the credential)
    assert d.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [0, 3], [0, 3])[0] == "LLM_SUCCESS"
    got = d.call(R.snapshot, "dst").reshape(NT, NB, BS)
    assert (got[:, [0, 3]] == info["want"].reshape(NT, NB, BS)[:, [0, 3]]).all()


def test_capability_dies_with_unlink_even_on_an_open_stream(cluster):
    c, p, q, d = cluster
    info = _owner(p, seed=2)
    _decoder(d, (PROMPT, info))
    cred = d.call(CP.credential, PROMPT)
    base = p.call(CP.owner_usage)
    # a stream opened while the link is live, and a write through it (control: writes do land)
    s = CP.RawStream(info["data_port"])
    try:
        assert s.open(cred)["opened"]
        data = _payload(20, 64)
        w = s.request([(info["rid"], 128, 64)], CP.WRITE, data)
        assert w["status"] == CP.ST_OK and w["extra"] == CP.RSP.pack(b"LDRS", CP.ST_OK, 0, 0, 0), w
        assert d.call(R.unlink, [(PROMPT, info["port"])])["status"] == "LLM_SUCCESS"
        assert p.call(CP.wait_grants, 0) == 0, "the owner kept the unlinked peer's grant"
        after_unlink = p.call(R.guarded_digest, "src")
        # the stream opened before the unlink is dead: a read and a write on it move nothing
        r = s.request([(info["rid"], 0, 64)] * 3)
        assert r["status"] is None and r["extra"] == b"", r
    finally:
        s.close()
    _attacks(info["data_port"], info["rid"], cred, "stale after unlink", seed=21)
    assert p.call(R.guarded_digest, "src") == after_unlink, "a revoked capability changed the owner's memory"
    # the write made while linked is there (the control really wrote)
    snap = p.call(R.snapshot, "src")
    assert snap[0, 128:192].tobytes() == data
    _back_to_baseline(p, base)


def test_capability_of_a_restarted_peer_is_refused(cluster):
    c, p, q, d = cluster
    info = _owner(p, seed=3)
    _decoder(d, (PROMPT, info))
    old = d.call(CP.credential, PROMPT)
    before = p.call(R.guarded_digest, "src")
    d.kill()
    # the owner sees the control connection go and revokes the grant
    assert p.call(CP.wait_grants, 0) == 0, "the dead peer's grant outlived it"
    d2 = c.spawn(f"cap_d_{os.getpid()}_restarted")[0]
    try:
        _decoder(d2, (PROMPT, info))   # the restarted peer: a new incarnation, a new link
        new = d2.call(CP.credential, PROMPT)
        assert new["handle"] != old["handle"] and new["key"] != old["key"]
        base = p.call(CP.owner_usage)
        _attacks(info["data_port"], info["rid"], old, "old incarnation", seed=31)
        assert p.call(R.guarded_digest, "src") == before
        _read_ok(info["data_port"], new, info["rid"], info["want"], info["canary"])   # control
        _back_to_baseline(p, base)
    finally:
        d2.kill()


def test_another_links_capability_is_refused(cluster):
    c, p, q, d = cluster
    info_p = _owner(p, PROMPT, seed=4)
    info_q = _owner(q, OWNER2, seed=5)
    d = c.spawn(f"cap_d_{os.getpid()}_second")[0] if not d.is_alive() else d
    _decoder(d, (PROMPT, info_p), (OWNER2, info_q))
    cred_p = d.call(CP.credential, PROMPT)
    cred_q = d.call(CP.credential, OWNER2)
    # the owner's own credential for the reverse direction (its channel to the decoder's data port)
    reverse = p.call(CP.credential, DECODER)
    before_p, before_q = p.call(R.guarded_digest, "src"), q.call(R.guarded_digest, "src")
    base_p, base_q = p.call(CP.owner_usage), q.call(CP.owner_usage)
    _attacks(info_q["data_port"], info_q["rid"], cred_p, "p's link at q", seed=41)
    _attacks(info_p["data_port"], info_p["rid"], cred_q, "q's link at p", seed=42)
    _attacks(info_p["data_port"], info_p["rid"], reverse, "the reverse direction's grant at p", seed=43)
    assert p.call(R.guarded_digest, "src") == before_p and q.call(R.guarded_digest, "src") == before_q
    _back_to_baseline(p, base_p)
    _back_to_baseline(q, base_q)
    # controls: each credential opens exactly its own owner's port
    _read_ok(info_p["data_port"], cred_p, info_p["rid"], info_p["want"], info_p["canary"])
    _read_ok(info_q["data_port"], cred_q, info_q["rid"], info_q["want"], info_q["canary"])


def test_capabilities_never_appear_in_logs_statistics_or_reprs(cluster):
    c, p, q, d = cluster
    d = c.spawn(f"cap_d_{os.getpid()}_logs")[0] if not d.is_alive() else d
    port = p.call(R.setup, "PROMPT", PROMPT, listen=True, log=True)
    p.call(R.register_blocks, "src", NT, NB, BS, seed=6, key=(PROMPT, 0))
    d.call(R.setup, "DECODER", DECODER, log=True)
    d.call(R.register_blocks, "dst", NT, NB, BS)
    assert d.call(R.link, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
    assert d.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [0], [0])[0] == "LLM_SUCCESS"
    mine = p.call(CP.own_capability, DECODER)    # the owner's grant to the decoder
    theirs = d.call(CP.own_capability, PROMPT)   # the decoder's grant to the owner
    caps = [mine["capability"], theirs["capability"]]
    assert len(set(caps)) == 2 and all(len(x) == 32 for x in caps)
    # refusals are logged too: a forged open, then an unlink
    _refused_open(p.call(CP.data_port), CP.forged_credential(np.random.default_rng(1405)), "forged")
    assert d.call(R.unlink, [(PROMPT, port)])["status"] == "LLM_SUCCESS"
    text = "\n".join(p.call(R.logs) + d.call(R.logs)) + mine["shown"] + theirs["shown"]
    assert "llmdd.transport.tcp.open_refused" in text, "the control: the refusal was logged"
    for cap in caps:
        for form in (cap.hex(), repr(cap), cap.hex()[:16], CP.handle_of(cap).hex()):
            assert form not in text, "a capability (or its handle) was logged or shown"
