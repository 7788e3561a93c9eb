"""Security checks of reliability.md 3.6 not covered by tests/integration/test_link_security.py:
S5 (forged out-of-bounds requests on the tcp data endpoint), S6 (non-remote-accessible memory is
never served), S7 (deregistered / guessed region ids refused), S9 (no unsafe deserialization in
network code), S11 (the shared secret never appears in logs or exception messages)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import pathlib
import re
import socket
import struct

import pytest

from llmdd import LLMException, LLMStatusCode
from llmdd.testing._harness import Cluster

from conftest import ENV, NT, PROMPT, R

pytestmark = pytest.mark.timeout(90)

ROOT = pathlib.Path(__file__).resolve().parents[2]
HELLO = struct.Struct("<4sHBx16s16s")
REQ = struct.Struct("<4sBBHIQ")
RSP = struct.Struct("<4sBBHI")
OP = struct.Struct("<IQQ")
OPEN = struct.Struct("<16s16s32s")         # v2: client nonce, grant handle, client mac
OPEN_RSP = struct.Struct("<B32s")          # v2: status, server mac
#: the tcp data server's kinds and statuses (plugins/llmdd-transport-tcp, module docstring: the wire)
READ, WRITE = 1, 2
ST_OK, ST_REFUSED = 0, 1
NB, BS = 4, 1024
GUARD = 4096          # unregistered canary bytes right before and right after every registered tensor
#: how long a raw client waits for bytes after the answer: nothing may follow a refusal (a
#: measurement window, not synchronisation)
AFTER_ANSWER_S = 0.3


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


def _raw(port: int, ops: list, kind: int = READ, total: int | None = None, grant: dict | None = None) -> dict:
    """One forged request on the tcp data endpoint.  Returns ``{"closed": True, "extra": b""}`` when
    the server closed the connection without a response header (a corrupt stream), else
    ``{"closed": False, "status", "msg", "extra"}`` where ``extra`` is every byte that followed the
    response within ``AFTER_ANSWER_S`` (the payload of an OK read).  A server that neither answers
    nor closes within 3 s fails the caller with ``socket.timeout``.  ``grant``: the handle and key
    of a linked peer's data grant (``R.tcp_data_grant``), presented when the server speaks v2."""
    with socket.create_connection(("127.0.0.1", port), timeout=3.0) as s:
        magic, version, _auth, endpoint_id, nonce_s = HELLO.unpack(_recv_exact(s, HELLO.size))
        assert magic == b"LDTH"
        if version >= 2:      # the owner serves linked peers only: open the stream with the link's grant
            assert grant is not None, "llmdd-tcp v2 serves linked peers only: pass the client's grant"
            nonce_c = os.urandom(16)
            s.sendall(OPEN.pack(nonce_c, grant["handle"], _mac(grant["key"], b"c", endpoint_id, nonce_s, nonce_c)))
            st, mac_s = OPEN_RSP.unpack(_recv_exact(s, OPEN_RSP.size))
            assert st == 0 and mac_s == _mac(grant["key"], b"s", endpoint_id, nonce_c, nonce_s), "grant refused"
        if total is None:
            total = sum(length for _, _, length in ops) % (1 << 64)
        s.sendall(REQ.pack(b"LDRQ", kind, 0, 0, len(ops), total) + b"".join(OP.pack(*op) for op in ops))
        hdr = _recv_exact(s, RSP.size)
        if not hdr:
            return {"closed": True, "extra": b""}
        assert len(hdr) == RSP.size, f"a partial response header: {hdr!r}"
        magic, status, _, _, mlen = RSP.unpack(hdr)
        assert magic == b"LDRS", hdr
        msg = _recv_exact(s, mlen) if mlen else b""
        s.settimeout(AFTER_ANSWER_S)
        extra = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                extra += chunk
        except OSError:     # the window ended (socket.timeout): nothing more came
            pass
        return {"closed": False, "status": status, "msg": msg.decode("utf-8", "replace"), "extra": extra}


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _assert_refused(res: dict, reason: str, what: object) -> None:
    """The server answered ST_REFUSED with a message naming ``reason`` and sent no payload byte."""
    assert not res["closed"], f"{what}: the server closed without answering (expected a refusal)"
    assert res["status"] == ST_REFUSED, (what, res)
    assert reason in res["msg"], (what, res["msg"])
    assert res["extra"] == b"", (what, len(res["extra"]))


def _assert_closed(res: dict, what: object) -> None:
    """A corrupt stream: the server closed the connection with no response and no payload byte."""
    assert res["closed"], (what, res)
    assert res["extra"] == b"", what


def _setup_owner(p, *, remote_accessible: bool = False) -> dict:
    port = p.call(R.setup, "PROMPT", PROMPT, listen=True, remote_accessible=remote_accessible)
    canary = p.call(R.register_guarded, "src", NT, NB, BS, seed=1, guard_bytes=GUARD,
                    key=None if remote_accessible else (PROMPT, 0),
                    remote_accessible=True if remote_accessible else None)
    ep = p.call(R.tcp_data_endpoint)
    return {"port": port, "data_port": ep["port"], "regions": ep["regions"], "src": p.call(R.region_of, "src"),
            "canary": canary}


def _linked_raw(d, info: dict, **setup_kw):
    """Set up and link the decoder ``d`` to the owner; a raw request function that presents d's
    data grant (what a hostile linked peer holds)."""
    d.call(R.setup, "DECODER", 2, **setup_kw)
    d.call(R.register_blocks, "dst", NT, NB, BS)
    assert d.call(R.link, [(PROMPT, info["port"])])["status"] == "LLM_SUCCESS"
    return functools.partial(_raw, info["data_port"], grant=d.call(R.tcp_data_grant, PROMPT))


def _no_canary(extra: bytes, canary: bytes) -> bool:
    """No 8-byte window of the canary (the guards before/after every tensor) is in ``extra``."""
    return all(canary[i:i + 8] not in extra for i in range(0, len(canary) - 8, 8))


def test_s5_forged_out_of_bounds_requests_are_refused_and_leak_no_canary(pd):
    p, d = pd
    info = _setup_owner(p)
    raw = _linked_raw(d, info)      # the forger is a linked peer: it holds its link's data grant
    rid = info["src"][0]
    size = NB * BS
    want = R.pattern(PROMPT, 1, NT, size)
    before = p.call(R.guarded_digest, "src")
    assert before["guards_intact"]
    oob, unknown = "out of bounds", "not registered"
    forged = [
        ([(rid, 0, size + 1)], oob),                  # one byte past the region: the guard after it
        ([(rid, size, 1)], oob),                      # starts at the end
        ([(rid, size - 8, 16)], oob),                 # straddles the end
        ([(rid, 2**64 - 1, 2)], oob),                 # offset overflow
        ([(rid, 2**64 - 16, 32)], oob),               # wraps to 16 bytes before the region: the guard before it
        ([(rid, 1, 2**64 - 1)], oob),                 # length overflow
        ([(rid, 0, 16), (rid, size - 8, 64)], oob),   # a valid op followed by an invalid one: all refused
        ([(rid + 1000, 0, 16)], unknown),             # a guessed region id
        ([(2**32 - 1, 0, 16)], unknown),
    ]
    for ops, reason in forged:
        res = raw(ops)
        _assert_refused(res, reason, ops)
    # a write outside the region is refused before a byte is read: region and guards unchanged
    for ops in ([(rid, size - 4, 8)], [(rid, 2**64 - 8, 16)]):
        _assert_refused(raw(ops, kind=WRITE), oob, ops)
    # the announced total must match the ops (no over-read / over-write): a corrupt stream, closed
    for kind in (READ, WRITE):
        for total in (1 << 40, 8, 0):
            _assert_closed(raw([(rid, 0, 16)], kind=kind, total=total), (kind, total))
    assert p.call(R.guarded_digest, "src") == before, "a refused request changed the owner's memory"
    # the owner is alive and the linked client still pulls correct bytes
    assert d.call(R.transfer, "pull_blocks", ("blocks", PROMPT, 0), "dst", [0, 3], [0, 3])[0] == "LLM_SUCCESS"
    got = d.call(R.snapshot, "dst").reshape(NT, NB, BS)
    assert (got[:, [0, 3]] == want.reshape(NT, NB, BS)[:, [0, 3]]).all()
    assert (got[:, [1, 2]] == R.POISON).all()
    # in-bounds raw reads return exactly the region's bytes (both ends), never the guards around it
    for ops in ([(rid, size - 64, 64)], [(rid, 0, 64)], [(rid, 0, size)], [(rid, 0, 16), (rid, size - 16, 16)]):
        res = raw(ops)
        assert not res["closed"] and res["status"] == ST_OK, (ops, res)
        assert res["extra"] == b"".join(want[0, off:off + ln].tobytes() for _, off, ln in ops), ops
        assert _no_canary(res["extra"], info["canary"]), ops
    # control: the canary check would see an over-read (the guard really is right after the region)
    assert not _no_canary(want[0, size - 64:].tobytes() + info["canary"][:64], info["canary"])


def test_s6_non_remote_accessible_cache_is_never_served(pd):
    p, d = pd
    info = _setup_owner(p, remote_accessible=True)
    hidden_id = p.call(R.register_blocks, "hidden", NT, NB, BS, seed=9, remote_accessible=False)
    hidden_regions = p.call(R.region_of, "hidden")
    raw = _linked_raw(d, info, remote_accessible=True)
    # an id key addresses a cache as a whole (src_blocks empty, contract); the hidden cache answers
    # exactly like an id that was never registered, so its existence is not revealed
    for cache_id in (hidden_id, hidden_id + 1000):
        status = d.call(R.transfer, "pull_blocks", ("id", PROMPT, cache_id, 0), "dst", [], [0])[0]
        assert status == "LLM_KV_CACHE_NOT_EXIST", (cache_id, status)
    assert d.call(R.poison_kept, "dst")
    for rid in hidden_regions:
        _assert_refused(raw([(rid, 0, 16)]), "not remote-accessible", rid)


def test_s7_deregistered_region_ids_are_refused(pd):
    p, d = pd
    info = _setup_owner(p)
    raw = _linked_raw(d, info)
    rid = info["src"][0]
    ok = raw([(rid, 0, 16)])
    assert not ok["closed"] and ok["status"] == ST_OK, ok
    assert ok["extra"] == R.pattern(PROMPT, 1, NT, NB * BS)[0, :16].tobytes()
    assert p.call(R.unregister, "src") == "LLM_SUCCESS"
    _assert_refused(raw([(rid, 0, 16)]), "not registered", rid)
    # re-registering the same memory gives a new region id; the old one stays refused
    p.call(R.register_blocks, "src2", NT, NB, BS, seed=1)
    new = p.call(R.region_of, "src2")
    assert rid not in new
    _assert_refused(raw([(rid, 0, 16)]), "not registered", rid)


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
    assert (res["status"], res["each"]) == ("LLM_LINK_FAILED", ["LLM_LINK_FAILED"]), res
    text = "\n".join(p.call(R.logs) + d.call(R.logs)) + repr(res)
    assert SECRET not in text
    if d_secret:
        assert d_secret not in text
    # options refused next to the secret: init fails with the contract's error, and neither the
    # message nor the child's traceback echoes the secret
    with pytest.raises(LLMException) as refused:
        d.call(R.setup, "DECODER", 2, extra={"llmdd.auth_secret": SECRET, "llmdd.handshake_timeout_ms": "-1"})
    assert refused.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, refused.value
    assert "llmdd.handshake_timeout_ms" in str(refused.value), str(refused.value)
    assert SECRET not in str(refused.value)
    assert SECRET not in getattr(refused.value, "remote_traceback", "") and SECRET not in repr(refused.value)
