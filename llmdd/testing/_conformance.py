"""Conformance suite for transports (the trio ``check_two_way_stream`` idea).

``make_pair()`` returns two fresh endpoints ``(a, b)`` of the transport under test, in this
process. Every check opens its own pair and closes it. Use it from pytest either in one go::

    def test_conformance():
        check_transport(make_pair)

or one test per check::

    @pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check):
        check(make_pair)

``stall``, when given, is ``stall(endpoint) -> context manager``: while inside, that endpoint
keeps its connections open but serves no byte (a hung peer). Without it the stalled-peer check
only covers deadlines that are already past.

``transport`` is a picklable ``() -> Transport`` (a module-level function, or
``functools.partial(MyTransport, options)``).  The checks that need it open endpoints themselves:
``check_authentication`` (endpoints opened with a shared ``secret``; when the transport class says
``authenticates = True``, endpoints with different secrets, or one without, must not move a byte) and
``check_two_processes`` (the peer endpoint lives in a child process started with ``spawn``, so the
transport's module must be importable there).  ``check_transport`` and :func:`run_check` pass each
check what it takes::

    @pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check):
        run_check(check, make_pair, transport=functools.partial(MyTransport, {}))

Memory is plain numpy host memory (``Placement.HOST``); a check that fails raises
``AssertionError`` with what it saw.
"""

from __future__ import annotations

import inspect
import pickle
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Union

import attrs
import numpy as np

from llmdd._seam.abc import MAX_PAYLOAD_BYTES, Channel, EndpointDescriptor, RegionDescriptor

from llmdd._seam.errors import PeerGone, Refused, TransportTimeout

from llmdd._seam.ops import OP_DTYPE, make_ops
from llmdd._base.enums import Placement
from llmdd._base.status import TransportError
from llmdd.testing._conformance_kit import (_SENTINEL, _TIMEOUT, MakePair, MakeTransport, Stall, _disjoint_ops,
                                            _expect_copied, _learn, _ok, _pair, _refused, _run, _Side, _submit)
from llmdd.testing._conformance_prepared import check_prepared

__all__ = ["check_transport", "run_check", "CONFORMANCE_CHECKS", "MakePair", "Stall", "MakeTransport"]

# --------------------------------------------------------------------------- checks


def check_describe_and_connect(make_pair: MakePair) -> None:
    """describe() and register() return frozen descriptors (the transport's name, a version, an opaque
    payload of at most MAX_PAYLOAD_BYTES) that survive pickling (they cross processes); both directions
    connect; a descriptor of another transport or of a newer version is refused with Refused, at
    connect and at add_remote_region; statistics are dicts."""
    with _pair(make_pair) as (a, b, ch):
        for side in (a, b):
            d = side.ep.describe()
            assert type(d) is EndpointDescriptor, f"describe() returned {type(d).__name__}"
            assert d.transport and isinstance(d.payload, bytes) and len(d.payload) <= MAX_PAYLOAD_BYTES
            assert pickle.loads(pickle.dumps(d)) == d
        b.region(10, 4096)
        rd = b.descs[10]
        assert type(rd) is RegionDescriptor and rd.transport == b.ep.describe().transport
        assert pickle.loads(pickle.dumps(rd)) == rd
        peer = b.ep.describe()
        _refused(lambda: a.ep.connect(attrs.evolve(peer, transport=peer.transport + "-other"), timeout=_TIMEOUT),
                 "connect with another transport's descriptor")
        _refused(lambda: a.ep.connect(attrs.evolve(peer, version=peer.version + 1), timeout=_TIMEOUT),
                 "connect with a descriptor of a newer version")
        _refused(lambda: ch.add_remote_region(10, 4096, attrs.evolve(rd, transport=rd.transport + "-other")),
                 "add_remote_region with another transport's descriptor")
        _refused(lambda: ch.add_remote_region(10, 4096, attrs.evolve(rd, version=rd.version + 1)),
                 "add_remote_region with a descriptor of a newer version")
        _learn(ch, b, 10)   # control: the descriptor as it was returned is accepted
        back = b.ep.connect(a.ep.describe(), timeout=_TIMEOUT)
        assert isinstance(ch.statistics(), dict) and isinstance(back.statistics(), dict)
        assert isinstance(a.ep.statistics(), dict)
        back.close()


def check_read_write_random(make_pair: MakePair) -> None:
    """Random-content read and write batches land byte for byte."""
    with _pair(make_pair) as (a, b, ch):
        size = 4 << 20
        a.region(1, size, fill=0)
        a.region(2, size)
        b.region(10, size)
        b.region(11, size, fill=0)
        for rid in (10, 11):
            _learn(ch, b, rid)
        ops = _disjoint_ops(a.rng, 200, 16384, 1, 10, size, size, vary=True)
        _ok(ch.read, ops)
        _expect_copied(ops, a.bufs, b.bufs, read=True)
        ops = _disjoint_ops(a.rng, 200, 16384, 2, 11, size, size, vary=True)
        _ok(ch.write, ops)
        _expect_copied(ops, b.bufs, a.bufs, read=False)
        # an empty batch completes
        _ok(ch.read, np.empty(0, dtype=OP_DTYPE))


def check_large_batch(make_pair: MakePair) -> None:
    """A batch of tens of MiB (multi-stream territory) both ways."""
    with _pair(make_pair) as (a, b, ch):
        size = 32 << 20
        a.region(1, size, fill=0)
        b.region(10, size)
        _learn(ch, b, 10)
        ops = _disjoint_ops(a.rng, 512, 65536, 1, 10, size, size)
        _ok(ch.read, ops)
        _expect_copied(ops, a.bufs, b.bufs, read=True)
        a.bufs[1][:] = a.rng.integers(0, 256, size, dtype=np.uint8)
        _ok(ch.write, ops)
        _expect_copied(ops, b.bufs, a.bufs, read=False)


def check_many_small_ops(make_pair: MakePair) -> None:
    """Tens of thousands of tiny ops in one batch, random placement, both ways."""
    with _pair(make_pair) as (a, b, ch):
        size = 2 << 20
        a.region(1, size, fill=0)
        b.region(10, size)
        _learn(ch, b, 10)
        ops = _disjoint_ops(a.rng, 20000, 64, 1, 10, size, size, vary=True)
        _ok(ch.read, ops)
        _expect_copied(ops, a.bufs, b.bufs, read=True)
        a.bufs[1][:] = a.rng.integers(0, 256, size, dtype=np.uint8)
        _ok(ch.write, ops)
        _expect_copied(ops, b.bufs, a.bufs, read=False)


def check_coalescing(make_pair: MakePair) -> None:
    """Adjacent ops (runs on both sides, shuffled, plus duplicates of zero length) still land."""
    with _pair(make_pair) as (a, b, ch):
        size = 4 << 20
        a.region(1, size, fill=0)
        b.region(10, size)
        _learn(ch, b, 10)
        piece = 256
        n = size // piece // 2
        ops = make_ops(1, np.arange(n) * piece, 10, size // 2 + np.arange(n) * piece, piece)
        ops = np.concatenate([ops[a.rng.permutation(n)], make_ops(1, 0, 10, 0, 0)])
        _ok(ch.read, ops)
        assert np.array_equal(a.bufs[1][: size // 2], b.bufs[10][size // 2:])
        assert not a.bufs[1][size // 2:].any()


def _refusal_cases(a: _Side, b: _Side, ch: Channel) -> list[tuple[str, Callable[[], np.ndarray]]]:
    sz = len(b.bufs[10])
    return [
        ("remote out of bounds", lambda: make_ops(1, 0, 10, sz - 10, 20)),
        ("remote offset beyond region", lambda: make_ops(1, 0, 10, sz + 4096, 1)),
        ("local out of bounds", lambda: make_ops(1, len(a.bufs[1]) - 1, 10, 0, 2)),
        ("remote region unknown", lambda: make_ops(1, 0, 999, 0, 1)),
        ("local region unknown", lambda: make_ops(77, 0, 10, 0, 1)),
        ("remote not remote-accessible", lambda: make_ops(1, 0, 12, 0, 64)),
        ("remote size overstated to the channel", lambda: make_ops(1, 0, 13, len(b.bufs[13]), 64)),
        ("remote deregistered by its owner", lambda: make_ops(1, 0, 14, 0, 64)),
        ("one bad op among good ones", lambda: np.concatenate(
            [make_ops(1, np.arange(8) * 64, 10, np.arange(8) * 64, 64), make_ops(1, 0, 10, sz, 1)])),
    ]


def check_refusals(make_pair: MakePair) -> None:
    """Out-of-bounds, unregistered and non-remote-accessible ops are refused; nothing is written."""
    with _pair(make_pair) as (a, b, ch):
        a.region(1, 1 << 16, fill=_SENTINEL)
        b.region(10, 1 << 16, fill=_SENTINEL)
        b.region(12, 1 << 16, remote=False, fill=_SENTINEL)
        b.region(13, 1 << 12, fill=_SENTINEL)
        b.region(14, 1 << 12, fill=_SENTINEL)
        for rid in (10, 12, 14):
            _learn(ch, b, rid)
        _learn(ch, b, 13, size=1 << 20)  # the channel is told more than the owner granted
        b.ep.deregister(14)
        for name, build in _refusal_cases(a, b, ch):
            for fn, what in ((ch.read, "read"), (ch.write, "write")):
                if what == "write":
                    a.bufs[1][:] = 0x11  # distinguishable source
                err = _run(fn, build())
                assert isinstance(err, Refused), f"{what} with {name}: expected Refused, got {err!r}"
                if what == "read":
                    assert (a.bufs[1] == _SENTINEL).all(), f"{what} with {name} wrote into local memory"
                else:
                    a.bufs[1][:] = _SENTINEL
                for rid in (10, 12, 13, 14):
                    assert (b.bufs[rid] == _SENTINEL).all(), f"{what} with {name} wrote into peer region {rid}"
        # after refusals the channel still works
        ops = make_ops(1, 0, 10, 128, 256)
        b.bufs[10][128:384] = 7
        _ok(ch.read, ops)
        assert (a.bufs[1][:256] == 7).all()


def check_deadline(make_pair: MakePair, stall: Union[Stall, None] = None) -> None:
    """A past deadline fails with TransportTimeout; a stalled peer fails the batch by its
    deadline (small and large batches) and nothing is written afterwards."""
    with _pair(make_pair) as (a, b, ch):
        size = 16 << 20
        a.region(1, size, fill=_SENTINEL)
        b.region(10, size)
        _learn(ch, b, 10)
        ops = make_ops(1, 0, 10, 0, 4096)
        err = _run(lambda o, deadline: ch.read(o, deadline=deadline - 6.0), ops)   # a deadline 1 s ago
        assert isinstance(err, TransportTimeout), f"past deadline: expected TransportTimeout, got {err!r}"
        assert (a.bufs[1] == _SENTINEL).all()
        if stall is None:
            return
        for n in (4096, size):
            ops = make_ops(1, 0, 10, 0, n)
            with stall(b.ep):
                t0 = time.monotonic()
                deadline = t0 + 0.5
                c = _submit(ch.read, ops, deadline)
                got: Union[TransportError, str, None] = c.error if c.wait(10.0) else "not done"
                took = time.monotonic() - t0
                assert isinstance(got, TransportTimeout), f"stalled peer, {n} B: got {got!r}"
                assert took < 0.5 + 2.0, f"stalled peer: failed after {took:.2f}s for a 0.5s deadline"
                a.bufs[1][:] = _SENTINEL
            time.sleep(0.2)  # the peer resumes: whatever it sends now must land nowhere
            assert (a.bufs[1] == _SENTINEL).all(), "bytes landed after the batch reported its timeout"
        b.bufs[10][:64] = 9
        ch2 = a.ep.connect(b.ep.describe(), timeout=_TIMEOUT)
        _learn(ch2, b, 10)
        _ok(ch2.read, make_ops(1, 0, 10, 0, 64))
        assert (a.bufs[1][:64] == 9).all()
        ch2.close()


def check_peer_close(make_pair: MakePair) -> None:
    """Closing the peer endpoint fails later batches with PeerGone, well within the deadline."""
    with _pair(make_pair) as (a, b, ch):
        a.region(1, 1 << 20, fill=_SENTINEL)
        b.region(10, 1 << 20)
        _learn(ch, b, 10)
        _ok(ch.read, make_ops(1, 0, 10, 0, 1 << 20))
        a.bufs[1][:] = _SENTINEL
        b.ep.close()
        for ops in (make_ops(1, 0, 10, 0, 64), make_ops(1, 0, 10, 0, 1 << 20)):
            t0 = time.monotonic()
            err = _run(ch.read, ops, timeout=5.0)
            assert isinstance(err, PeerGone), f"peer closed: expected PeerGone, got {err!r}"
            assert time.monotonic() - t0 < 4.0, "PeerGone took nearly the whole deadline"
        assert (a.bufs[1] == _SENTINEL).all()
        try:
            ch2 = a.ep.connect(b.ep.describe(), timeout=2.0)
        except PeerGone:
            pass
        else:
            ch2.close()
            raise AssertionError("connect to a closed endpoint succeeded")


def check_double_close(make_pair: MakePair) -> None:
    """close() of channels and endpoints is idempotent; a batch on a closed channel fails through its
    completion (read() does not raise)."""
    with _pair(make_pair) as (a, b, ch):
        a.region(1, 4096, fill=0)
        b.region(10, 4096)
        _learn(ch, b, 10)
        ch.close()
        ch.close()
        err = _run(ch.read, make_ops(1, 0, 10, 0, 64))
        assert isinstance(err, TransportError), f"read on a closed channel: got {err!r}"
        assert not a.bufs[1].any()
        a.ep.close()
        a.ep.close()
        b.ep.close()
    # the _pair context closed them a third time without error


def check_cancel(make_pair: MakePair) -> None:
    """After cancel() returns no byte of the batch lands; cancel of a done batch is a no-op."""
    with _pair(make_pair) as (a, b, ch):
        size = 64 << 20
        a.region(1, size, fill=0)
        b.region(10, size)
        _learn(ch, b, 10)
        ops = _disjoint_ops(a.rng, size // 65536, 65536, 1, 10, size, size)
        c = ch.read(ops, deadline=time.monotonic() + _TIMEOUT)
        c.cancel()
        assert c.done()
        a.bufs[1][:] = _SENTINEL
        time.sleep(0.1)
        assert (a.bufs[1] == _SENTINEL).all(), "bytes landed after cancel() returned"
        assert c.error is None or isinstance(c.error, TransportError)
        c.cancel()
        _ok(ch.read, ops[:16])
        _expect_copied(ops[:16], a.bufs, b.bufs, read=True)


def check_deregister_during_traffic(make_pair: MakePair) -> None:
    """Deregistering a region while batches touch it drains them first, on both sides."""
    with _pair(make_pair) as (a, b, ch):
        size = 64 << 20
        a.region(1, size, fill=0)
        b.region(10, size)
        _learn(ch, b, 10)
        ops = _disjoint_ops(a.rng, size // 65536, 65536, 1, 10, size, size)
        # local destination deregistered during a read
        c = ch.read(ops, deadline=time.monotonic() + _TIMEOUT)
        time.sleep(0.005)
        a.ep.deregister(1)
        a.bufs[1][:] = _SENTINEL
        assert c.wait(_TIMEOUT)
        time.sleep(0.05)
        assert (a.bufs[1] == _SENTINEL).all(), "bytes landed in a deregistered local region"
        # remote destination deregistered by its owner during a write
        a.region(2, size)
        c = ch.write(make_ops(2, ops["local_offset"], 10, ops["remote_offset"], ops["length"]),
                     deadline=time.monotonic() + _TIMEOUT)
        time.sleep(0.005)
        b.ep.deregister(10)
        b.bufs[10][:] = _SENTINEL
        assert c.wait(_TIMEOUT)
        time.sleep(0.05)
        assert (b.bufs[10] == _SENTINEL).all(), "bytes landed in a region its owner deregistered"
        err = _run(ch.read, make_ops(2, 0, 10, 0, 64))
        assert isinstance(err, Refused), f"read of a deregistered region: expected Refused, got {err!r}"
        # deregistering twice, or an unknown id, is harmless
        a.ep.deregister(1)
        a.ep.deregister(12345)


def check_concurrent_batches(make_pair: MakePair) -> None:
    """Several threads drive batches on one channel at once."""
    with _pair(make_pair) as (a, b, ch):
        size = 8 << 20
        for i in range(4):
            a.region(1 + i, size, fill=0)
        b.region(10, size)
        _learn(ch, b, 10)
        errors: list = []

        def pull(i: int) -> None:
            ops = _disjoint_ops(np.random.default_rng(i), 64, 65536, 1 + i, 10, size, size)
            try:
                _ok(ch.read, ops)
                _expect_copied(ops, a.bufs, b.bufs, read=True)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        ts = [threading.Thread(target=pull, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(_TIMEOUT * 2)
        assert not errors, errors


def check_foreign_descriptor(make_pair: MakePair) -> None:
    """A region descriptor that a third endpoint returned is refused by a channel to another peer at
    ``add_remote_region`` (Refused), and no byte moves to or from either endpoint."""
    with _pair(make_pair) as (a, b, ch):
        c_ep, d_ep = make_pair()
        c, d = _Side(c_ep, 3), _Side(d_ep, 4)
        try:
            a.region(1, 1 << 16, fill=_SENTINEL)
            b.region(10, 1 << 16, fill=_SENTINEL)
            c.region(10, 1 << 16)              # the same region id, at another endpoint
            want = c.bufs[10].copy()
            _refused(lambda: ch.add_remote_region(10, 1 << 16, c.descs[10]),
                     "add_remote_region with a descriptor of a third endpoint")
            for fn in (ch.read, ch.write):   # the region stays unknown: batches naming it are refused
                err = _run(fn, make_ops(1, 0, 10, 0, 4096))
                assert isinstance(err, Refused), f"a batch naming a refused region: got {err!r}"
            assert (a.bufs[1] == _SENTINEL).all(), "bytes of the foreign endpoint landed locally"
            assert (b.bufs[10] == _SENTINEL).all(), "the peer's region changed"
            assert np.array_equal(c.bufs[10], want), "the foreign endpoint's region changed"
            # control: the peer's own descriptor of region 10 works on the same channel
            b.bufs[10][:64] = np.arange(64, dtype=np.uint8)
            _learn(ch, b, 10)
            _ok(ch.read, make_ops(1, 0, 10, 0, 64))
            assert np.array_equal(a.bufs[1][:64], np.arange(64, dtype=np.uint8))
        finally:
            c_ep.close()
            d_ep.close()


def check_authentication(make_pair: MakePair, transport: MakeTransport) -> None:
    """Endpoints opened with the same ``secret`` move data; when the transport class says
    ``authenticates = True``, a peer with another secret, or with none, moves no byte: its connect or
    its first batch fails with a typed error (Refused or PeerGone)."""
    t = transport()
    secret = np.random.default_rng(5).integers(0, 256, 32, dtype=np.uint8).tobytes()
    a = _Side(t.open_endpoint(host="127.0.0.1", secret=secret), 6)
    b = _Side(t.open_endpoint(host="127.0.0.1", secret=secret), 7)
    others = [t.open_endpoint(host="127.0.0.1", secret=secret[::-1]), t.open_endpoint(host="127.0.0.1")]
    ch = None
    try:
        a.region(1, 1 << 16, fill=_SENTINEL)
        b.region(10, 1 << 16)
        ch = a.ep.connect(b.ep.describe(), timeout=_TIMEOUT)
        _learn(ch, b, 10)
        _ok(ch.read, make_ops(1, 0, 10, 0, 1 << 16))
        _expect_copied(make_ops(1, 0, 10, 0, 1 << 16), a.bufs, b.bufs, read=True)
        if not getattr(type(t), "authenticates", False):
            return   # the trust boundary is elsewhere (same host, same user): the secret is accepted
        a.bufs[1][:] = _SENTINEL
        for other in others:
            o = _Side(other, 8)
            o.region(20, 1 << 16, fill=_SENTINEL)
            for src, dst, rid, lid in ((a, o, 20, 1), (o, a, 1, 20)):
                try:
                    ch2 = src.ep.connect(dst.ep.describe(), timeout=5.0)
                except TransportError as exc:
                    assert isinstance(exc, (Refused, PeerGone)), f"unauthenticated connect: got {exc!r}"
                    continue
                try:
                    _learn(ch2, dst, rid)
                    for fn in (ch2.read, ch2.write):
                        err = _run(fn, make_ops(lid, 0, rid, 0, 4096))
                        assert isinstance(err, (Refused, PeerGone)), \
                            f"a peer with another secret moved data (or failed untyped): {err!r}"
                finally:
                    ch2.close()
            assert (o.bufs[20] == _SENTINEL).all() and (a.bufs[1] == _SENTINEL).all(), \
                "bytes moved between endpoints with different secrets"
    finally:
        if ch is not None:
            ch.close()
        for ep in [a.ep, b.ep, *others]:
            ep.close()


def _peer_process(transport: MakeTransport, conn: Connection, seed: int, size: int) -> None:
    """The child of :func:`check_two_processes`: one endpoint, two regions, answers over ``conn``."""
    t = transport()
    ep = t.open_endpoint(host="127.0.0.1")
    try:
        side = _Side(ep, seed)
        side.region(10, size)               # random: the parent reads it
        side.region(11, size, fill=0)       # the parent writes it
        conn.send((ep.describe(), side.descs[10], side.descs[11]))
        while conn.poll(_TIMEOUT * 3):
            cmd, arg = conn.recv()
            if cmd == "digest":             # the bytes of a region, for the parent to compare
                conn.send(side.bufs[arg].tobytes())
            elif cmd == "deregister":
                ep.deregister(arg)
                conn.send(True)
            elif cmd == "exit":
                conn.send(True)
                return
    finally:
        ep.close()


def check_two_processes(make_pair: MakePair, transport: MakeTransport) -> None:
    """A peer endpoint in another process (opened there from ``transport()``; this side's endpoint
    comes from ``make_pair``): read and write land byte for byte, both ways; its owner's
    deregistration refuses later batches; its exit fails them with PeerGone."""
    size = 1 << 20
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_peer_process, args=(transport, theirs, 21, size), daemon=True)
    proc.start()
    ep, spare = make_pair()     # this side: an endpoint as make_pair builds them; the peer: transport()
    spare.close()
    ch = None
    try:
        assert mine.poll(_TIMEOUT * 2), "the peer process did not start its endpoint"
        desc, d10, d11 = mine.recv()
        a = _Side(ep, 22)
        a.region(1, size, fill=_SENTINEL)
        a.region(2, size)
        ch = ep.connect(desc, timeout=_TIMEOUT)
        ch.add_remote_region(10, size, d10)
        ch.add_remote_region(11, size, d11)

        def remote(cmd: str, arg: Any) -> Any:
            mine.send((cmd, arg))
            assert mine.poll(_TIMEOUT), f"the peer process did not answer {cmd}"
            return mine.recv()

        ops = _disjoint_ops(a.rng, 64, 8192, 1, 10, size, size, vary=True)
        _ok(ch.read, ops)
        theirs10 = np.frombuffer(remote("digest", 10), dtype=np.uint8)
        _expect_copied(ops, a.bufs, {10: theirs10}, read=True)
        assert (theirs10 != _SENTINEL).any()
        ops = _disjoint_ops(a.rng, 64, 8192, 2, 11, size, size, vary=True)
        _ok(ch.write, ops)
        theirs11 = np.frombuffer(remote("digest", 11), dtype=np.uint8)
        _expect_copied(ops, {11: theirs11}, a.bufs, read=False)
        assert remote("deregister", 11)
        a.bufs[1][:] = _SENTINEL
        err = _run(ch.read, make_ops(1, 0, 11, 0, 64))
        assert isinstance(err, Refused), f"read of a region its owner deregistered: got {err!r}"
        assert remote("exit", None)
        proc.join(_TIMEOUT)
        assert proc.exitcode == 0, f"peer process exit code {proc.exitcode}"
        err = _run(ch.read, make_ops(1, 0, 10, 0, 64))
        assert isinstance(err, PeerGone), f"read from an exited peer process: got {err!r}"
        assert (a.bufs[1] == _SENTINEL).all()
    finally:
        if ch is not None:
            ch.close()
        ep.close()
        if proc.is_alive():
            proc.kill()
        proc.join(_TIMEOUT)
        mine.close()


CONFORMANCE_CHECKS: list[Callable[..., None]] = [
    check_describe_and_connect,
    check_read_write_random,
    check_large_batch,
    check_many_small_ops,
    check_coalescing,
    check_refusals,
    check_deadline,
    check_peer_close,
    check_double_close,
    check_cancel,
    check_deregister_during_traffic,
    check_prepared,
    check_concurrent_batches,
    check_foreign_descriptor,
    check_authentication,
    check_two_processes,
]


def run_check(check: Callable[..., None], make_pair: MakePair, *, stall: Union[Stall, None] = None,
              transport: Union[MakeTransport, None] = None) -> None:
    """Run one check, passing it ``stall`` and ``transport`` when it takes them.  A check that needs
    ``transport`` fails with :class:`TypeError` without it (no check is skipped silently)."""
    params = inspect.signature(check).parameters
    kwargs: dict = {}
    if "stall" in params:
        kwargs["stall"] = stall
    if "transport" in params:
        if transport is None:
            raise TypeError(f"{check.__name__} needs transport=: a picklable () -> Transport")
        kwargs["transport"] = transport
    check(make_pair, **kwargs)


def check_transport(make_pair: MakePair, *, stall: Union[Stall, None] = None,
                    transport: Union[MakeTransport, None] = None) -> None:
    """Run every conformance check against ``make_pair`` (see the module docstring)."""
    for check in CONFORMANCE_CHECKS:
        run_check(check, make_pair, stall=stall, transport=transport)
