"""tcp transport: the one-call small-transfer path (``TcpChannel.prepare``, issue 21) and the owner's
few-ops path, against an owner in another process (``_quick_owner``) over loopback.

Bytes are seeded random and compared on the other side; declines must leave everything as it was; a
transfer the path started and that failed raises the transport's error; the owner's few-ops path
decides and answers exactly as its numpy path does (a seeded property test over raw requests)."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import socket
import struct
import sys
import threading
import time

import attrs
import numpy as np
import pytest

from llmdd.lowlevel import Cancelled, MemRegion, PeerGone, Refused, TransportTimeout, make_ops
from llmdd_tcp import NATIVE_REASON, TcpTransport, data_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _quick_owner import PRIVATE, owner_main, pattern  # noqa: E402  (spawned children import it by name)

pytestmark = pytest.mark.timeout(90)
BS, NB = 4096, 32
SIZE = BS * NB
SEED = 20261202
NATIVE = data_path()["native"]


class Owner:
    """The owner child: its descriptors, commands, and its end."""

    def __init__(self, options: dict | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(child, SIZE, SEED, options), daemon=True)
        self.proc.start()
        assert self.conn.poll(30), "owner did not start"
        self.desc, self.descs = self.conn.recv()

    def ask(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(30), f"owner did not answer {cmd}"
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


#: (client, owner) data paths: the C hot path (llmdd_tcp._tcpfast) or the pure-Python one, and the
#: mixed pairs (each side speaks the same wire whichever path it runs)
MODES = ["c-c", "py-py", "c-py", "py-c"]
OFF = {"llmdd.tcp.native": "off"}


def _options(mode: str, side: int) -> dict:
    if mode.split("-")[side] == "c":
        return {"llmdd.tcp.native": "on"} if NATIVE else {}
    return dict(OFF)


def c_path_required() -> bool:
    """CI (LLMDD_REQUIRE_NATIVE=1) requires the C path unless this run switched it off."""
    return (os.environ.get("LLMDD_REQUIRE_NATIVE") == "1"
            and os.environ.get("LLMDD_TCP_NATIVE", "").strip().lower() not in ("0", "off", "no", "false")
            and os.environ.get("LLMDD_TCP_BUILD_NATIVE") != "0")


@pytest.fixture(params=MODES)
def mode(request):
    if "c" in request.param.split("-") and not NATIVE:
        if c_path_required():
            pytest.fail(f"the tcp C hot path is required here and not active: {NATIVE_REASON}")
        pytest.skip(f"the tcp C hot path is not active: {NATIVE_REASON}")
    return request.param


@pytest.fixture
def owner(mode):
    o = Owner(_options(mode, 1))
    yield o
    o.close()


@pytest.fixture
def client(owner, mode):
    ep = TcpTransport(_options(mode, 0)).open_endpoint()
    rng = np.random.default_rng(SEED + 1)
    local = {1: np.zeros(SIZE, np.uint8), 2: np.zeros(SIZE, np.uint8),
             3: rng.integers(0, 256, SIZE, dtype=np.uint8), 4: rng.integers(0, 256, SIZE, dtype=np.uint8)}
    for rid, buf in local.items():
        ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    ch = ep.connect(owner.desc, timeout=10)
    for rid, d in owner.descs.items():
        ch.add_remote_region(rid, SIZE, d)
    yield ep, ch, local
    ch.close()
    ep.close()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (``kill`` returns before a thread
    running on another core has stopped: a spinning owner could still answer a request sent at once)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass   # a thread that ended
        if states and all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        os.sched_yield()


def _blocks(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(NB, BS)


def test_quick_pull_and_push_move_the_right_bytes_between_processes(owner, client):
    ep, ch, local = client
    pull = ch.prepare([(1, 5), (2, 8)], BS, NB, NB, False, timeout_s=10)
    push = ch.prepare([(3, 6), (4, 9)], BS, NB, NB, True, timeout_s=10)
    assert pull is not None and push is not None
    base = owner.ask("stats")
    src, dst = [3, 4, 5, 10, 20], [0, 1, 2, 7, 31]   # runs (3,0,3) (10,7,1) (20,31,1): 3 rows a pair
    assert pull(src, dst) == len(src) * BS * 2
    after = owner.ask("stats")   # (a request is counted before its answer's last byte leaves)
    assert after["ops_served"] - base["ops_served"] == 6, "consecutive blocks were not merged into runs"
    for lrid, rrid in ((1, 5), (2, 8)):
        want = _blocks(pattern(rrid, SIZE, SEED))
        got = _blocks(local[lrid])
        assert np.array_equal(got[dst], want[src])
        untouched = sorted(set(range(NB)) - set(dst))
        assert not got[untouched].any()                        # the control: nothing else landed
        assert not np.array_equal(got[dst], want[[s + 1 for s in src]])   # and the mapping is the one asked
    # single blocks, many calls on one pooled stream
    rng = np.random.default_rng(SEED + 2)
    for s, d in zip(rng.integers(0, NB, 20).tolist(), rng.integers(0, NB, 20).tolist()):
        assert pull([s], [d]) == 2 * BS
        assert np.array_equal(_blocks(local[1])[d], _blocks(pattern(5, SIZE, SEED))[s])
    psrc, pdst = [0, 1, 9, 2], [4, 5, 30, 6]
    assert push(psrc, pdst) == len(psrc) * BS * 2
    for lrid, rrid in ((3, 6), (4, 9)):
        sink = _blocks(np.frombuffer(owner.ask("snapshot", rrid), np.uint8))
        assert np.array_equal(sink[pdst], _blocks(local[lrid])[psrc])
        assert not sink[sorted(set(range(NB)) - set(pdst))].any()
    st = ch.statistics()
    assert st["quick_batches"] == 22 and st["failed"] == 0
    assert st["bytes_written"] == len(psrc) * BS * 2 and st["idle_streams"] >= 1
    assert st["streams_opened"] == 1, "the quick path did not reuse the pooled stream"


def test_quick_declines_do_nothing(owner, client):
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    assert pull is not None
    before = (ch.statistics()["quick_batches"], owner.ask("stats")["requests"])
    for src, dst in (([NB], [0]), ([0], [NB]), ([-1], [0]), ([0, 1], [2, 2]), ([True], [0]), ([0], [False]),
                     ([np.int64(1)], [0]), ([1], [2, 3]), ([], []), (np.array([1]), [0]), ((1,), range(1)),
                     (list(range(17)), list(range(17))), (["1"], [0])):
        assert pull(src, dst) < 0, (src, dst)
    assert (ch.statistics()["quick_batches"], owner.ask("stats")["requests"]) == before
    assert not local[1].any()
    # a table change after the plan: the plan declines (stale) until replanned
    ch.add_remote_region(5, SIZE, owner.descs[5])
    assert pull([1], [1]) < 0 and not local[1].any()
    again = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    assert again is not None and again([1], [1]) == BS
    buf = np.zeros(BS, np.uint8)
    ep.register(MemRegion(region_id=77, addr=buf.ctypes.data, size=BS, remote_accessible=False, placement=0))
    assert again([2], [2]) < 0 and not _blocks(local[1])[2].any()   # a local table change: stale too
    # no plan for what the path cannot take
    assert ch.prepare([(1, 55)], BS, NB, NB, False, timeout_s=10) is None       # unknown remote region
    assert ch.prepare([(1, PRIVATE)], BS, NB, NB, False, timeout_s=10) is None  # not remote-accessible
    assert ch.prepare([(99, 5)], BS, NB, NB, False, timeout_s=10) is None       # unknown local region
    assert ch.prepare([(77, 5)], BS, NB, NB, False, timeout_s=10) is None       # local region too small
    assert ch.prepare([(1, 5)], BS, NB + 1, NB, False, timeout_s=10) is None    # remote too small
    assert ch.prepare([(1, 5)], 0, NB, NB, False, timeout_s=10) is None
    assert ch.prepare([(1, 5)] * 9, BS, NB, NB, False, timeout_s=10) is None
    ch.close()
    assert again([3], [3]) < 0 and not _blocks(local[1])[3].any()   # a closed channel: declined


def test_quick_pull_after_the_owner_was_killed_raises_peer_gone(owner, client):
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    assert pull([1], [1]) == BS   # the control: it worked, and left a pooled stream
    owner.kill()
    with pytest.raises(PeerGone):
        pull([2], [2])
    assert not _blocks(local[1])[2].any()
    assert ch.statistics()["failed"] == 1


def test_quick_transfers_the_owner_refuses_raise_refused_and_move_nothing(owner, client):
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    push = ch.prepare([(3, 6)], BS, NB, NB, True, timeout_s=10)
    wide = ch.prepare([(3, 6), (4, 9)], BS, NB, NB, True, timeout_s=10)   # 2 x 16 blocks: 128 KiB a call
    assert pull([4], [4]) == BS and push([4], [4]) == BS   # the control
    assert owner.ask("deregister", 5) and owner.ask("deregister", 6)
    with pytest.raises(Refused, match="region 5 is not registered"):
        pull([5], [5])
    with pytest.raises(Refused, match="region 6 is not registered"):
        push([5], [5])
    with pytest.raises(Refused, match="region 6 is not registered"):   # its payload dropped by the owner
        wide(list(range(16)), list(range(16, 32)))
    assert not _blocks(local[1])[5].any()
    assert not _blocks(np.frombuffer(owner.ask("snapshot", 9), np.uint8))[16:].any()
    assert owner.ask("stats")["refused"] == 3
    st = ch.statistics()
    assert st["streams_opened"] == 1 and st["idle_streams"] == 1, "a refusal left the stream out of step"


def test_an_answer_leaves_after_the_owner_let_go_of_the_request(owner, client):
    """The owner releases a request (its pins, its place among the streams a deregistration shuts down)
    and counts it before the answer's last byte leaves: the client holding an answer finds it counted at
    once, and a deregistration of the regions it used, asked for right after, leaves the stream the
    client keeps alone (issue 21's CI flake: the owner still listed the finished request and shut the
    pooled stream down).  Reads of one block (answered from one copy), of two 64 KiB runs (few ops, more
    than one copy: the last 4 KiB leave from a copy) and of 24 scattered blocks (the numpy path), and
    writes; every byte compared."""
    ep, ch, local = client
    pull = ch.prepare([(1, 5), (2, 5)], BS, NB, NB, False, timeout_s=10)
    push = ch.prepare([(3, 6)], BS, NB, NB, True, timeout_s=10)
    want = _blocks(pattern(5, SIZE, SEED))
    rng = np.random.default_rng(SEED + 7)
    scattered = sorted(rng.choice(NB, 12, replace=False).tolist())
    shapes = [([7], [3]), (list(range(16)), list(range(16, 32))), (scattered, scattered[::-1])]
    requests = owner.ask("stats")["requests"]
    for src, dst in shapes:
        for buf in (local[1], local[2]):
            buf[:] = 0
        assert pull(src, dst) == 2 * len(src) * BS
        requests += 1
        assert owner.ask("stats")["requests"] == requests, (src, "the answer came before the owner counted it")
        for lrid in (1, 2):
            got = _blocks(local[lrid])
            assert np.array_equal(got[dst], want[src]), (lrid, src)
            assert not got[sorted(set(range(NB)) - set(dst))].any()
    pblocks = sorted(rng.choice(NB, 10, replace=False).tolist())
    assert push(pblocks, pblocks) == len(pblocks) * BS
    requests += 1
    assert owner.ask("stats")["requests"] == requests
    sink = _blocks(np.frombuffer(owner.ask("snapshot", 6), np.uint8))
    assert np.array_equal(sink[pblocks], _blocks(local[3])[pblocks]) and local[3].any()
    assert owner.ask("deregister", 5) and owner.ask("deregister", 6)   # right after the answers
    again = ch.prepare([(1, 8)], BS, NB, NB, False, timeout_s=10)
    assert again([0, 1], [0, 1]) == 2 * BS
    assert np.array_equal(_blocks(local[1])[:2], _blocks(pattern(8, SIZE, SEED))[:2])
    st = ch.statistics()
    assert st["streams_opened"] == 1 and st["failed"] == 0, st


def test_quick_deadline_against_an_owner_that_never_answers_raises_timeout(owner, client):
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=0.3)
    push = ch.prepare([(3, 6)], BS, NB, NB, True, timeout_s=0.3)
    with socket.socket() as silent:   # accepts, never answers: a pooled stream to it
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        for fn in (pull, push):
            with ch._lock:
                stale, ch._idle = ch._idle, [socket.create_connection(silent.getsockname())]
            for s in stale:
                s.close()
            conn, _ = silent.accept()
            with conn:
                with pytest.raises(TransportTimeout):
                    fn([6], [6])
    assert not _blocks(local[1])[6].any()
    assert ch.statistics()["failed"] == 2


class _StoppedClock:
    """Wraps a quick plan: ``time.monotonic`` stands still while one of its calls runs.  Whether a call's
    arming is remembered is decided on that clock (armed once, within a quarter of the 2 ms slack of the
    call's start, :meth:`QuickCall.keep_armed`): on the real clock a busy machine that preempts the call
    for half a millisecond makes it forget, rightly, and the test failed (issue 41).  Stopped, the call
    arms "at its start" and no syscall of it starts "late", so what is remembered follows the plan's
    rules only.  The real waits stay bounded: the socket timeouts armed are the plan's timeout less the
    slack (measured from a clock that has not moved), which is what ends a call to a stopped owner."""

    def __init__(self, monkeypatch, plan) -> None:
        self._mp, self._plan = monkeypatch, plan

    def __call__(self, src, dst):
        now = time.monotonic()
        with self._mp.context() as m:
            m.setattr(time, "monotonic", lambda: now)
            return self._plan(src, dst)

    def __getattr__(self, name):
        return getattr(self._plan, name)


def test_quick_calls_reuse_their_stream_timeouts_and_the_deadline_still_holds(owner, client, mode, monkeypatch):
    if mode.startswith("c"):
        pytest.skip("the C client path sets no socket timeouts (its waits are ppoll()s bounded by the deadline): "
                    "test_quick_deadline_holds_against_a_stopped_owner covers its deadline")
    ep, ch, local = client
    pull = _StoppedClock(monkeypatch, ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=0.5))
    push = _StoppedClock(monkeypatch, ch.prepare([(3, 6)], BS, NB, NB, True, timeout_s=0.5))
    want = _blocks(pattern(5, SIZE, SEED))
    assert pull([3], [4]) == BS and pull.armed_sock is not None   # armed once, remembered
    sock, epoch = pull.armed_sock, ch._arm_epoch
    assert pull([7], [8]) == BS                                    # the same stream: no arming at all
    assert (pull.armed_sock, ch._arm_epoch) == (sock, epoch)
    assert np.array_equal(_blocks(local[1])[[4, 8]], want[[3, 7]])
    assert push([1], [2]) == BS                                    # another plan arms the stream for itself
    assert push.armed_sock is sock and ch._arm_epoch == epoch + 1
    assert pull([9], [10]) == BS and ch._arm_epoch == epoch + 2    # ... so this plan arms it again
    # the ops path takes (and arms) pooled streams: a plan's remembered arming no longer counts
    c = ch.read(make_ops(1, 11 * BS, 5, 11 * BS, BS), deadline=time.monotonic() + 10)
    assert c.wait(10) and c.error is None
    assert ch._arm_epoch > epoch + 2
    assert pull([11], [12]) == BS and pull.armed_epoch == ch._arm_epoch
    assert np.array_equal(_blocks(local[1])[[10, 11, 12]], want[[9, 11, 11]])
    # the deadline holds on a stream whose timeouts were remembered: the owner stops answering
    assert pull.armed_sock is not None
    _stop(owner.proc.pid)
    try:
        with pytest.raises(TransportTimeout):
            pull([13], [14])
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)
    assert not _blocks(local[1])[14].any()


# ---------------------------------------------------------------------------- the owner's two paths

REQ = struct.Struct("<4sBBHIQ")
_OP = struct.Struct("<IQQ")
RSP = struct.Struct("<4sBBHI")


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        try:
            chunk = s.recv(n - len(out))
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk
    return out


F_PAD, F_EAGER = 1, 2


def _exchange(s: socket.socket, kind: int, flags: int, ops: list, total: int, payload: bytes) -> tuple:
    """One raw request; (status or None when the stream ended, message, payload bytes read, or for a
    write its last answer header)."""
    req = REQ.pack(b"LDRQ", kind, flags, 0, len(ops), total) + b"".join(_OP.pack(*op) for op in ops)
    if kind == 2 and flags & F_PAD:
        req += bytes(-len(req) % 16)
    eager = kind == 2 and flags & F_EAGER
    s.sendall(req + payload if eager else req)
    head = _recv(s, RSP.size)
    if len(head) < RSP.size:
        return (None, "", b"")
    _, status, _, _, n = RSP.unpack(head)
    msg = _recv(s, n)
    if status != 0:
        return (status, msg, b"")
    if kind == 1:
        return (status, msg, _recv(s, total))
    if eager:
        return (status, msg, b"")
    s.sendall(payload)
    tail = _recv(s, RSP.size)
    if len(tail) == RSP.size:
        tail += _recv(s, RSP.unpack(tail)[4])
    return (status, msg, tail)


def test_few_ops_path_decides_and_answers_as_the_numpy_path():
    """Owners with the same regions and grant, one serving at most 8 ops in plain Python, one every
    request with numpy, and (where it is active) one serving small requests in C (llmdd_tcp._tcpfast)
    and handing it the others: 400 seeded random requests (regions registered, private, unknown and
    outside the grant; offsets and lengths inside, at and past the bounds, and huge; totals right and
    wrong; reads and writes, padded or not, writes eager or not) get the same answers, bytes and sinks."""
    t = TcpTransport(OFF)
    few, wide = t.open_endpoint(), t.open_endpoint()
    wide._few_ops = 0
    owners = [few, wide]
    if NATIVE:
        owners.append(TcpTransport({"llmdd.tcp.native": "on"}).open_endpoint())
    elif c_path_required():
        pytest.fail(f"the tcp C hot path is required here and not active: {NATIVE_REASON}")
    client = t.open_endpoint()
    rng = np.random.default_rng(SEED + 5)
    size = 4096
    src = {rid: rng.integers(0, 256, size, dtype=np.uint8) for rid in (10, 11, 12)}
    sinks = {ep: {rid: np.zeros(size, np.uint8) for rid in (20, 21)} for ep in owners}
    cap = secrets.token_bytes(32)
    socks = {}
    try:
        for ep in owners:
            ep.serve_links_only()
            for rid, buf in src.items():
                ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=size, remote_accessible=rid != 12,
                                      placement=0))
            for rid, buf in sinks[ep].items():
                ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=size, remote_accessible=True,
                                      placement=0))
            ep.grant(1, cap, [10, 12, 20, 21])   # 11: remote-accessible but not granted
        chans = {ep: client.connect(attrs.evolve(ep.describe(), capability=cap), timeout=5) for ep in owners}

        def stream(ep):
            s = socks.get(ep)
            if s is None:
                s = socks[ep] = chans[ep].open_stream(time.monotonic() + 5)
                s.settimeout(5)
            return s

        def value(hi: int) -> int:
            r = rng.random()
            if r < 0.6:
                return int(rng.integers(0, hi + 1))
            return [hi, hi + 1, size, size + 1, 2**63, 2**64 - 1][int(rng.integers(0, 6))]

        decisions = set()
        for i in range(400):
            kind = int(rng.choice([1, 2]))
            count = int(rng.integers(0, 9))
            ops = []
            for _ in range(count):
                rid = int(rng.choice([10, 20, 21, 11, 12, 99] if kind == 1 else [20, 21, 20, 10, 11, 12, 99]))
                off = value(size)
                ops.append((rid, off, value(max(0, size - off) if off <= size else 16)))
            total = sum(n for _, _, n in ops) % 2**64
            if rng.random() < 0.1:
                total = (total + int(rng.integers(1, 100))) % 2**64
            flags = int(rng.integers(0, 2 if kind == 1 else 4))
            payload = rng.integers(0, 256, total, dtype=np.uint8).tobytes() if total <= 4 * size else b""
            if kind == 2 and not payload and total:
                total, ops = 0, []   # a write whose payload the test could not send: an empty one instead
            answers = {}
            for ep in owners:
                answers[ep] = _exchange(stream(ep), kind, flags, ops, total, payload)
                status, _, tail = answers[ep]
                if status is None or (status == 0 and kind == 2 and not flags & F_EAGER and not tail):
                    socks.pop(ep).close()   # the owner ended the stream: a fresh one for the next request
            for ep in owners[1:]:
                assert answers[few] == answers[ep], (i, kind, flags, ops, total, owners.index(ep))
                for rid in (20, 21):
                    assert np.array_equal(sinks[few][rid], sinks[ep][rid]), (i, ops, owners.index(ep))
            decisions.add((kind, flags & F_EAGER, answers[few][0]))
        # both kinds (writes eager or not) were accepted, refused and ended (a wrong total) at least once
        want = {(1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1), (2, F_EAGER, 0), (2, F_EAGER, 1), (1, 0, None)}
        assert want <= decisions, decisions
        assert sinks[few][20].any() and sinks[few][21].any()
        # (refusals and served requests are both counted before the answer's last byte leaves)
        stats = [ep.statistics() for ep in owners]
        assert stats[0]["refused"] > 0 and all(st["refused"] == stats[0]["refused"] for st in stats), stats
        # every owner served the same requests; the C one served some of them in C (its own counters)
        assert all(st["requests"] == stats[0]["requests"] for st in stats), stats
        if NATIVE:
            assert owners[2]._fast.counters()[2] > 0
    finally:
        for s in socks.values():
            s.close()
        client.close()
        for ep in owners:
            ep.close()


def test_quick_pull_in_flight_is_cancelled_by_deregistration_and_lands_nothing_after(owner, client):
    """The local region is pinned while a quick call waits for its answer: deregister fails the call
    (Cancelled) and returns only after it ended; bytes the peer sends afterwards land nowhere."""
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=30)
    local[1][:] = 0x5A
    box: dict = {}
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        with ch._lock:
            stale, ch._idle = ch._idle, [socket.create_connection(silent.getsockname())]
        for s in stale:
            s.close()
        conn, _ = silent.accept()
        with conn:
            conn.settimeout(10)
            caller = threading.Thread(target=lambda: box.update(err=_raised(pull, [7], [7])))
            caller.start()
            assert len(_recv(conn, 40)) == 40   # the request came: the call holds its pin now
            ep.deregister(1)
            caller.join(10)
            assert not caller.is_alive()
            assert isinstance(box["err"], Cancelled), box
            try:   # the answer comes too late: nothing of it may land
                conn.sendall(RSP.pack(b"LDRS", 0, 0, 0, 4) + bytes(4) + bytes(range(256)) * (BS // 256))
            except OSError:
                pass
    assert (local[1] == 0x5A).all()


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


# ---------------------------------------------------------------------------- the C path (llmdd_tcp._tcpfast)

def test_each_side_takes_the_path_it_was_given(owner, client, mode):
    """The C path is used exactly where it was asked for (a silent fall back fails here): the client's
    plans and their calls (``quick_native``), the owner's serving (``requests_native``)."""
    ep, ch, local = client
    c_client, c_owner = (side == "c" for side in mode.split("-"))
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    push = ch.prepare([(3, 6)], BS, NB, NB, True, timeout_s=10)
    assert pull.native is c_client and push.native is c_client
    assert ep.statistics()["native"] is c_client
    base = owner.ask("stats")
    assert base["native"] is c_owner
    for i in range(5):
        assert pull([i], [i]) == BS and push([i], [i]) == BS
    assert np.array_equal(_blocks(local[1])[:5], _blocks(pattern(5, SIZE, SEED))[:5])
    assert np.array_equal(_blocks(np.frombuffer(owner.ask("snapshot", 6), np.uint8))[:5], _blocks(local[3])[:5])
    st = ch.statistics()
    assert st["quick_batches"] == 10 and st["quick_native"] == (10 if c_client else 0)
    after = owner.ask("stats")
    assert after["requests"] == base["requests"] + 10
    assert after["requests_native"] - base["requests_native"] == (10 if c_owner else 0)


def test_quick_deadline_holds_against_a_stopped_owner(owner, client, mode):
    """The owner stops (SIGSTOP, every thread stopped) on a stream the client reuses: a pull and a push
    fail with TransportTimeout by their deadline; once the owner runs again nothing of the stale
    answers lands (the failed calls closed their streams), and the channel works."""
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=0.4)
    push = ch.prepare([(3, 6)], BS, NB, NB, True, timeout_s=0.4)
    assert pull([2], [2]) == BS and push([2], [2]) == BS   # pooled streams, served
    before = np.frombuffer(owner.ask("snapshot", 6), np.uint8).copy()
    _stop(owner.proc.pid)
    try:
        for fn in (pull, push):
            t0 = time.monotonic()
            with pytest.raises(TransportTimeout):
                fn([13], [14])
            took = time.monotonic() - t0
            assert 0.4 <= took < 0.4 + 1.0, took
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)
    ok = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    assert ok([20], [20]) == BS   # the owner runs again (and served what was sent to it before this)
    assert not _blocks(local[1])[14].any()
    assert np.array_equal(_blocks(local[1])[20], _blocks(pattern(5, SIZE, SEED))[20])
    after = np.frombuffer(owner.ask("snapshot", 6), np.uint8)
    # the push's eager payload may have reached the owner before it stopped: then it landed whole
    moved = not np.array_equal(_blocks(after)[14], _blocks(before)[14])
    if moved:
        assert np.array_equal(_blocks(after)[14], _blocks(local[3])[13])
    assert np.array_equal(np.delete(_blocks(after), 14, 0), np.delete(_blocks(before), 14, 0))
    assert ch.statistics()["failed"] == 2


def test_owner_deregistering_a_region_it_serves_ends_with_a_refusal(owner, client):
    """A client pulls a region in a loop on a stream the owner is serving (in C, the owner's worker
    keeps it between requests) while the owner deregisters the region: the deregistration returns,
    calls already answered moved the right bytes, and from then on the owner refuses the region
    ("not registered") without serving a byte of it."""
    ep, ch, local = client
    pull = ch.prepare([(1, 5)], BS, NB, NB, False, timeout_s=10)
    want = _blocks(pattern(5, SIZE, SEED))
    state = {"n": 0, "gone": 0, "err": None}
    started = threading.Event()

    def loop():
        i = 0
        while True:
            blk = i % NB
            try:
                pull([blk], [blk])
            except PeerGone:
                state["gone"] += 1   # the owner shut the stream it was serving the region on
                continue
            except Exception as exc:  # noqa: BLE001 - inspected below
                state["err"] = exc
                return
            assert np.array_equal(_blocks(local[1])[blk], want[blk])
            state["n"] += 1
            i += 1
            if state["n"] == 20:
                started.set()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    assert started.wait(20), state
    owner.ask("deregister", 5)   # returns once drained
    t.join(20)
    assert not t.is_alive()
    err = state["err"]
    assert isinstance(err, Refused) and "not registered" in str(err), err
    local[1][:] = 0
    with pytest.raises(Refused):
        pull([0], [0])
    assert not local[1].any()
