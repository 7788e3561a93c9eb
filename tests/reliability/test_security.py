"""Security checks of reliability.md 3.6 not covered by tests/integration/test_link_security.py:
S5 (forged out-of-bounds requests on the tcp data endpoint), S6 (non-remote-accessible memory is
never served), S7 (deregistered / guessed region ids refused), S9 (no unsafe deserialization in
network code), S11 (the shared secret never appears in logs or exception messages)."""

from __future__ import annotations

import pathlib
import re
import socket
import struct

import pytest

from llmdd.testing._harness import Cluster

from conftest import ENV, NT, PROMPT, R

pytestmark = pytest.mark.timeout(90)

ROOT = pathlib.Path(__file__).resolve().parents[2]
HELLO = struct.Struct("<4sHBx16s16s")
REQ = struct.Struct("<4sBBHIQ")
RSP = struct.Struct("<4sBBHI")
OP = struct.Struct("<IQQ")
READ, WRITE = 1, 2
CANARY = b"\xde\xad\xbe\xef" * 8
NB, BS = 4, 1024


@pytest.fixture(scope="module")
def pd():
    c = Cluster(env=ENV)
    p, d = c.spawn("sec_p", "sec_d")
    yield p, d
    c.close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _raw_read(port: int, ops: list, kind: int = READ, total: int | None = None) -> tuple:
    """One forged request on the tcp data endpoint; returns (status or None, message, extra bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3.0) as s:
        hello = _recv_exact(s, HELLO.size)
        assert hello[:4] == b"LDTH"
        if total is None:
            total = sum(length for _, _, length in ops) % (1 << 64)
        s.sendall(REQ.pack(b"LDRQ", kind, 0, 0, len(ops), total) + b"".join(OP.pack(*op) for op in ops))
        hdr = _recv_exact(s, RSP.size)
        if len(hdr) < RSP.size:
            return None, b"", b""
        _, status, _, _, mlen = RSP.unpack(hdr)
        msg = _recv_exact(s, mlen) if mlen else b""
        s.settimeout(0.3)
        extra = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                extra += chunk
        except OSError:
            pass
        return status, msg, extra


def _setup_owner(p, *, remote_accessible: bool = False) -> dict:
    port = p.call(R.setup, "PROMPT", PROMPT, listen=True, remote_accessible=remote_accessible)
    p.call(R.register_blocks, "src", NT, NB, BS, seed=1, key=None if remote_accessible else (PROMPT, 0),
           remote_accessible=True if remote_accessible else None)
    p.call(R.register_blocks, "after", NT, NB, BS, seed=2)       # memory right after: canaries
    for t in range(NT):
        p.call(R.write_canary, "after", t, 0, CANARY)
    ep = p.call(R.tcp_data_endpoint)
    return {"port": port, "data_port": ep["port"], "regions": ep["regions"], "src": p.call(R.region_of, "src")}


def test_s5_forged_out_of_bounds_requests_are_refused_and_leak_no_canary(pd):
    p, d = pd
    info = _setup_owner(p)
    rid = info["src"][0]
    size = NB * BS
    forged = [
        [(rid, 0, size + 1)],                  # one byte past the region
        [(rid, size, 1)],                      # starts at the end
        [(rid, 2**64 - 1, 2)],                 # offset overflow
        [(rid, 1, 2**64 - 1)],                 # length overflow
        [(rid, 0, 16), (rid, size - 8, 64)],   # a valid op followed by an invalid one: all refused
        [(rid + 1000, 0, 16)],                 # a guessed region id
        [(2**32 - 1, 0, 16)],
    ]
    for ops in forged:
        status, msg, extra = _raw_read(info["data_port"], ops)
        assert status != 0, (ops, status)
        assert CANARY[:8] not in extra, ops
    # a write outside the region is refused before a byte is read
    status, _, _ = _raw_read(info["data_port"], [(rid, size - 4, 8)], kind=WRITE)
    assert status != 0
    # the announced total must match the ops (no over-read / over-write)
    status, _, _ = _raw_read(info["data_port"], [(rid, 0, 16)], total=1 << 40)
    assert status != 0
    # the owner is alive and a good client still links and pulls correct bytes
    d.call(R.setup, "DECODER", 2)
    d.call(R.register_blocks, "dst", NT, NB, BS)
    assert d.call(R.link, [(PROMPT, info["port"])])["status"] == "LLM_SUCCESS"
    assert d.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [0, 3], [0, 3])[0] == "LLM_SUCCESS"
    got = d.call(R.snapshot, "dst").reshape(NT, NB, BS)
    want = R.pattern(PROMPT, 1, NT, NB * BS).reshape(NT, NB, BS)
    assert (got[:, [0, 3]] == want[:, [0, 3]]).all()
    # an in-bounds raw read returns exactly the region's bytes, never the canary behind it
    status, _, extra = _raw_read(info["data_port"], [(rid, size - 64, 64)])
    assert status == 0 and CANARY[:8] not in extra


def test_s6_non_remote_accessible_cache_is_never_served(pd):
    p, d = pd
    info = _setup_owner(p, remote_accessible=True)
    hidden_id = p.call(R.register_blocks, "hidden", NT, NB, BS, seed=9, remote_accessible=False)
    hidden_regions = p.call(R.region_of, "hidden")
    d.call(R.setup, "DECODER", 2, remote_accessible=True)
    d.call(R.register_blocks, "dst", NT, NB, BS)
    assert d.call(R.link, [(PROMPT, info["port"])])["status"] == "LLM_SUCCESS"
    # an id key addresses a cache as a whole (src_blocks empty, contract); the hidden cache answers
    # exactly like an id that was never registered, so its existence is not revealed
    for cache_id in (hidden_id, hidden_id + 1000):
        status = d.call(R.transfer, "pull_blocks", ("id", PROMPT, cache_id, 0), "dst", [], [0])[0]
        assert status == "LLM_KV_CACHE_NOT_EXIST", (cache_id, status)
    assert d.call(R.poison_kept, "dst")
    for rid in hidden_regions:
        status, _, extra = _raw_read(info["data_port"], [(rid, 0, 16)])
        assert status != 0 and not extra


def test_s7_deregistered_region_ids_are_refused(pd):
    p, d = pd
    info = _setup_owner(p)
    rid = info["src"][0]
    assert _raw_read(info["data_port"], [(rid, 0, 16)])[0] == 0
    assert p.call(R.unregister, "src") == "LLM_SUCCESS"
    status, _, extra = _raw_read(info["data_port"], [(rid, 0, 16)])
    assert status != 0 and not extra
    # re-registering the same memory gives a new region id; the old one stays refused
    p.call(R.register_blocks, "src2", NT, NB, BS, seed=1)
    new = p.call(R.region_of, "src2")
    assert rid not in new
    assert _raw_read(info["data_port"], [(rid, 0, 16)])[0] != 0


NETWORK_CODE = [ROOT / "llmdd", *sorted((ROOT / "plugins").glob("*/src"))]
UNSAFE = re.compile(r"\b(pickle\.loads?|marshal\.loads?|cPickle|recv_pyobj|yaml\.load\(|(?<![\w.])eval\(|(?<![\w.])exec\()")


def test_s9_no_unsafe_deserialization_in_network_code():
    offenders = []
    for base in NETWORK_CODE:
        for path in base.rglob("*.py"):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("llmdd", "testing"):   # the test harness's own parent/child pipe
                continue
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if UNSAFE.search(code):
                    offenders.append(f"{rel}:{no}: {line.strip()}")
    assert not offenders, "unsafe deserialization in network code:\n" + "\n".join(offenders)


SECRET = "s3cr3t-never-logged-0xC0FFEE"


@pytest.mark.parametrize("d_secret", [None, "another-secret-xyz"], ids=["client_without", "client_wrong"])
def test_s11_secret_never_in_logs_or_exception_messages(pd, d_secret):
    p, d = pd
    port = p.call(R.setup, "PROMPT", PROMPT, listen=True, log=True, extra={"llmdd.auth_secret": SECRET})
    extra = {"llmdd.auth_secret": d_secret} if d_secret else {}
    d.call(R.setup, "DECODER", 2, log=True, extra=extra)
    res = d.call(R.link, [(PROMPT, port)], 2000)
    assert res["status"] == "LLM_LINK_FAILED" or res["each"] == ["LLM_LINK_FAILED"], res
    text = "\n".join(p.call(R.logs) + d.call(R.logs)) + repr(res)
    assert SECRET not in text
    if d_secret:
        assert d_secret not in text
    # a bad secret type in options: the error message does not echo the value
    try:
        d.call(R.setup, "DECODER", 2, extra={"llmdd.auth_secret": SECRET, "llmdd.handshake_timeout_ms": "-1"})
    except Exception as exc:  # noqa: BLE001 - any refusal is fine, its text is what matters
        assert SECRET not in str(exc) and SECRET not in getattr(exc, "remote_traceback", "")
