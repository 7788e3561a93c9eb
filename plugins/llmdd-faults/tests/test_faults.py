"""The faults plugin: plan semantics, the wrapper around tcp, conformance, engine integration."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd.lowlevel import Cancelled, Corrupt, MemRegion, PeerGone, Refused, TransportTimeout, make_ops
from llmdd.plugin import LinkInfo
from llmdd.testing import CONFORMANCE_CHECKS, run_check
from llmdd_faults import (Fault, FaultInjector, FaultPlan, FaultyTransport, env_plan, peer_scope,
                          plan_from_env, wrap)
from llmdd_faults._batch import _cut
import llmdd_tcp
from llmdd_tcp import TcpTransport, endpoint_fields

SENTINEL = 0xA5
SIZE = 1 << 16


# ============================================================================ the plan
def _calls(plan, op, n, peer=None):
    return [bool(plan.match(op, peer)) for _ in range(n)]


def test_nth_and_count():
    plan = FaultPlan([Fault("read", "drop", nth=2, count=2)])
    assert _calls(plan, "read", 5) == [False, True, True, False, False]
    assert [r.call for r in plan.fired] == [2, 3]
    assert _calls(plan, "write", 3) == [False] * 3  # other ops do not count


def test_count_none_fires_every_time_from_nth():
    plan = FaultPlan([Fault("write", "delay", nth=3, count=None, delay=0.1)])
    assert _calls(plan, "write", 6) == [False, False, True, True, True, True]


def test_peer_filter():
    plan = FaultPlan([Fault("read", "fail", peer=7, count=None), Fault("read", "delay", count=None)])
    assert [f.action for f in plan.match("read", 7)] == ["fail", "delay"]
    assert [f.action for f in plan.match("read", 8)] == ["delay"]
    assert [f.action for f in plan.match("read", None)] == ["delay"]
    # the nth counter of a peer-bound fault counts that peer's calls only
    plan = FaultPlan([Fault("read", "fail", peer=7, nth=2)])
    assert _calls(plan, "read", 3, peer=8) == [False] * 3
    assert _calls(plan, "read", 2, peer=7) == [False, True]


def test_probability_is_seeded():
    def run(seed):
        plan = FaultPlan([Fault("read", "fail", count=None, probability=0.3)], seed=seed)
        return _calls(plan, "read", 200)

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert 30 < sum(a) < 90
    assert not any(_calls(FaultPlan([Fault("read", "fail", count=None, probability=0.0)]), "read", 50))


def test_fired_records_and_reset():
    plan = FaultPlan([Fault("connect", "fail", name="c1"), Fault("read", "drop", nth=2)])
    t0, m0 = time.time(), time.monotonic()
    plan.match("connect", 3)
    plan.match("read", 3)
    plan.match("read", 3)
    fired = plan.fired
    assert [(r.op, r.index, r.peer, r.call, r.fault.label) for r in fired] == \
        [("connect", 0, 3, 1, "c1"), ("read", 1, 3, 2, "read:drop")]
    assert all(t0 <= r.at <= time.time() and m0 <= r.monotonic <= time.monotonic() for r in fired)
    assert plan.fired_count(action="drop") == 1
    json.dumps([r.to_dict() for r in fired])
    plan.reset()
    assert plan.fired == []
    assert _calls(plan, "read", 2) == [False, True]  # counters start over


def test_validation_and_json_round_trip():
    with pytest.raises(ValueError):
        Fault("connect", "corrupt")
    with pytest.raises(ValueError):
        Fault("read", "explode")
    with pytest.raises(ValueError):
        Fault("read", "drop", nth=0)
    with pytest.raises(ValueError):
        Fault("read", "fail", error="NoSuchError")
    with pytest.raises(ValueError):
        Fault("complete", "kill_peer", point="mid_transfer")
    plan = FaultPlan([Fault("read", "fail", nth=2, error=PeerGone, peer=4),
                      Fault("write", "truncate", nbytes=10, probability=0.5)], seed=9)
    again = FaultPlan.from_json(plan.to_json())
    assert again.faults == plan.faults and again.seed == 9
    assert FaultPlan.from_json('[{"op": "read", "action": "drop", "nth": 2}]').faults == \
        (Fault("read", "drop", nth=2),)
    with pytest.raises(ValueError):
        FaultPlan.from_json('[{"op": "read", "action": "drop", "nht": 2}]')


def test_plan_from_env(tmp_path):
    assert plan_from_env({}) is None
    path = tmp_path / "plan.json"
    path.write_text('{"seed": 3, "faults": [{"op": "read", "action": "drop"}]}')
    plan = plan_from_env({"LLMDD_FAULTS": f"@{path}", "LLMDD_FAULTS_LOG": str(tmp_path / "fired.jsonl")})
    assert plan.seed == 3 and plan.faults == (Fault("read", "drop"),)
    plan.match("read", 1)
    line = json.loads((tmp_path / "fired.jsonl").read_text().splitlines()[0])
    assert line["op"] == "read" and line["fault"] == {"op": "read", "action": "drop"} and line["pid"] == os.getpid()
    assert env_plan() is None  # not activated in this process


def test_cut():
    ops = make_ops(1, [0, 100, 300], 2, [1000, 2000, 3000], [100, 50, 10])
    head, tail = _cut(ops, 120)
    assert head["length"].tolist() == [100, 20] and head["local_offset"].tolist() == [0, 100]
    assert tail["length"].tolist() == [30, 10] and tail["remote_offset"].tolist() == [2020, 3000]
    assert tail["local_offset"].tolist() == [120, 300]


# ============================================================================ the wrapper around tcp
class Pair:
    def __init__(self, plan):
        self.plan = plan
        self.cls = wrap(TcpTransport, plan)
        t = self.cls({})
        self.a, self.b = t.open_endpoint(), t.open_endpoint()
        self.local = np.full(SIZE, SENTINEL, np.uint8)
        self.src = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
        self.remote_dst = np.full(SIZE, SENTINEL, np.uint8)
        self.a.register(self._region(1, self.local))
        d10 = self.b.register(self._region(10, self.src))
        d11 = self.b.register(self._region(11, self.remote_dst))
        self.ch = self.a.connect(self.b.describe(), timeout=5.0)
        self.ch.add_remote_region(10, SIZE, d10)
        self.ch.add_remote_region(11, SIZE, d11)

    @staticmethod
    def _region(rid, buf):
        return MemRegion(region_id=rid, addr=buf.ctypes.data, size=buf.nbytes, remote_accessible=True, placement=0)

    def read(self, n=SIZE, timeout=2.0):
        return self._go(self.ch.read, make_ops(1, 0, 10, 0, n), timeout)

    def write(self, n=SIZE, timeout=2.0):
        return self._go(self.ch.write, make_ops(1, 0, 11, 0, n), timeout)

    @staticmethod
    def _go(fn, ops, timeout):
        t0 = time.monotonic()
        c = fn(ops, deadline=t0 + timeout)
        assert c.wait(timeout + 5.0)
        return c.error, time.monotonic() - t0

    def untouched(self):
        time.sleep(0.05)  # whatever lands late would land now
        return bool((self.local == SENTINEL).all())

    def close(self):
        self.ch.close()
        self.a.close()
        self.b.close()


@contextlib.contextmanager
def pair(*faults, seed=0):
    p = Pair(FaultPlan(list(faults), seed=seed))
    try:
        yield p
    finally:
        p.plan.heal()
        p.close()


def test_wrapped_class_shape():
    cls = wrap(TcpTransport)
    assert issubclass(cls, FaultyTransport) and cls.name == "faults-tcp" and cls.inner_cls is TcpTransport
    assert cls.priority == TcpTransport.priority - 1 and cls.same_host_only is False
    assert cls.probe().available and cls.probe().name == "faults-tcp"
    shadow = wrap(cls, name="tcp")
    assert shadow.inner_cls is TcpTransport and shadow.name == "tcp"


def test_no_fault_passes_through():
    with pair(Fault("read", "drop", nth=5)) as p:
        err, _ = p.read()
        assert err is None and np.array_equal(p.local, p.src)


@pytest.mark.parametrize("op", ["read", "complete"])
def test_drop_times_out_by_the_deadline(op):
    with pair(Fault(op, "drop")) as p:
        err, took = p.read(timeout=0.3)
        assert isinstance(err, TransportTimeout), err
        assert 0.25 < took < 1.3
        if op == "read":
            assert p.untouched()  # the inner batch was never posted
        p.local[:] = SENTINEL
        assert p.read()[0] is None and np.array_equal(p.local, p.src)  # count=1: the next one passes
        assert [r.op for r in p.plan.fired] == [op]


def test_drop_then_cancel():
    with pair(Fault("read", "drop")) as p:
        c = p.ch.read(make_ops(1, 0, 10, 0, SIZE), deadline=time.monotonic() + 10)
        time.sleep(0.05)
        t0 = time.monotonic()
        c.cancel()
        assert c.done() and time.monotonic() - t0 < 0.5
        assert isinstance(c.error, Cancelled)
        assert p.untouched()


def test_write_drop_leaves_the_peer_untouched():
    with pair(Fault("write", "drop")) as p:
        err, _ = p.write(timeout=0.2)
        assert isinstance(err, TransportTimeout)
        time.sleep(0.05)
        assert (p.remote_dst == SENTINEL).all()


def test_delay():
    with pair(Fault("read", "delay", delay=0.2), Fault("read", "delay", delay=5.0, nth=2)) as p:
        err, took = p.read(timeout=2.0)
        assert err is None and took >= 0.2 and np.array_equal(p.local, p.src)
        p.local[:] = SENTINEL
        err, took = p.read(timeout=0.3)
        assert isinstance(err, TransportTimeout) and took < 1.3
        assert p.untouched()


@pytest.mark.parametrize("error", [PeerGone, Corrupt, TransportTimeout])
def test_fail(error):
    with pair(Fault("read", "fail", error=error)) as p:
        err, took = p.read()
        assert type(err) is error and took < 0.5
        assert p.untouched()


def test_complete_fail_flips_a_success():
    with pair(Fault("complete", "fail", error="PeerGone")) as p:
        err, _ = p.read()
        assert isinstance(err, PeerGone)


@pytest.mark.parametrize("error", [Corrupt, PeerGone])
def test_truncate(error):
    with pair(Fault("read", "truncate", nbytes=1000, error=error)) as p:
        err, _ = p.read()
        assert type(err) is error
        time.sleep(0.05)
        assert np.array_equal(p.local[:1000], p.src[:1000])
        assert (p.local[1000:] == SENTINEL).all()


def test_corrupt_read_flips_bytes_on_success():
    with pair(Fault("read", "corrupt", nbytes=3)) as p:
        err, _ = p.read()
        assert err is None
        diff = np.flatnonzero(p.local != p.src)
        assert len(diff) == 3
        assert ((p.local[diff] ^ 0xFF) == p.src[diff]).all()


def test_corrupt_write_flips_bytes_at_the_peer():
    with pair(Fault("write", "corrupt", nbytes=2)) as p:
        p.local[:] = p.src
        err, _ = p.write()
        assert err is None
        diff = np.flatnonzero(p.remote_dst != p.src)
        assert len(diff) == 2
        assert ((p.remote_dst[diff] ^ 0xFF) == p.src[diff]).all()


def test_corrupt_not_applied_on_failure():
    with pair(Fault("read", "corrupt", nbytes=5), Fault("complete", "fail")) as p:
        err, _ = p.read()
        assert isinstance(err, TransportTimeout)
        assert np.array_equal(p.local, p.src)  # moved, but not corrupted after the failure decision


def test_partition_until_heal():
    with pair(Fault("read", "partition")) as p:
        err, took = p.read(timeout=0.2)
        assert isinstance(err, TransportTimeout) and p.untouched()
        err, _ = p.read(timeout=0.2)  # later ops on the channel hang as well
        assert isinstance(err, TransportTimeout) and p.untouched()
        assert p.ch.statistics()["partitioned"]
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", p.read(timeout=5.0)))
        t.start()
        time.sleep(0.2)
        assert not result
        p.plan.heal()
        t.join(5)
        assert result["r"][0] is None and np.array_equal(p.local, p.src)
        assert len(p.plan.fired) == 1


class _OnFired:
    """Stands in for the plan's logger: runs ``action`` the instant a fault's record is published,
    which is when a test that waits on the fired record acts (heals, unlinks), before the wrapper
    has built, tracked or partitioned the batch the fault fired on."""

    def __init__(self, action):
        self.action = action

    def warning(self, event, **_kw):
        if event == "llmdd.faults.fired":
            self.action()

    def __getattr__(self, _name):
        return lambda *_a, **_k: None


def test_regression_heal_right_after_a_partition_fired_releases_its_batch(monkeypatch):
    """The batch's worker partitioned its channel at the heal generation it read when it got there:
    a heal that came after the fault was recorded but before the worker ran (a fault-matrix test
    waits for the record, then heals) left the batch held until its deadline (F8: LLM_TIMEOUT
    instead of the original bytes).  The generation is now read before the fault fires."""
    from llmdd_faults import _plan

    with pair(Fault("read", "partition", count=1)) as p:
        monkeypatch.setattr(_plan, "_log", _OnFired(p.plan.heal))
        err, _ = p.read(timeout=2.0)
        assert err is None and np.array_equal(p.local, p.src)
        assert not p.ch.statistics()["partitioned"]
        assert len(p.plan.fired) == 1


def test_regression_channel_closed_right_after_a_fault_fired_fails_its_batch_at_once(monkeypatch):
    """A channel closed after a fault was recorded but before the batch joined the channel's set did
    not fail that batch: it held its partition until its deadline (F19: a force unlink left the held
    pull to time out).  Now the batch fails with ``Cancelled`` before ``read`` returns, and nothing
    lands in local memory."""
    from llmdd_faults import _plan

    with pair(Fault("read", "partition", count=1)) as p:
        monkeypatch.setattr(_plan, "_log", _OnFired(p.ch.close))
        c = p.ch.read(make_ops(1, 0, 10, 0, SIZE), deadline=time.monotonic() + 5.0)
        assert c.done() and isinstance(c.error, Cancelled), c.error
        assert p.untouched()


def test_deregister_drains_a_faulty_batch():
    with pair(Fault("read", "delay", delay=0.3), Fault("read", "corrupt")) as p:
        c = p.ch.read(make_ops(1, 0, 10, 0, SIZE), deadline=time.monotonic() + 5)
        time.sleep(0.05)
        p.a.deregister(1)
        assert c.done() and isinstance(c.error, Cancelled)
        p.local[:] = SENTINEL
        time.sleep(0.4)
        assert p.untouched()


def test_connect_faults():
    plan = FaultPlan([Fault("connect", "fail", error=PeerGone), Fault("connect", "drop", nth=2)])
    t = wrap(TcpTransport, plan)({})
    a, b = t.open_endpoint(), t.open_endpoint()
    try:
        with pytest.raises(PeerGone):
            a.connect(b.describe(), timeout=2.0)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            a.connect(b.describe(), timeout=0.3)
        assert time.monotonic() - t0 < 1.0
        a.connect(b.describe(), timeout=2.0).close()
        assert [r.fault.action for r in plan.fired] == ["fail", "drop"]
    finally:
        a.close()
        b.close()


def test_peer_targeting_through_peer_scope():
    plan = FaultPlan([Fault("read", "fail", peer=7, count=None)])
    p = Pair(plan)
    try:
        assert p.read()[0] is None  # channel of unknown peer: the peer-bound fault does not apply
        with peer_scope(8):
            ch8 = p.a.connect(p.b.describe(), timeout=5.0)
        with peer_scope(7):
            ch7 = p.a.connect(p.b.describe(), timeout=5.0)
        for ch in (ch7, ch8):
            ch.add_remote_region(10, SIZE, p.b.register(Pair._region(20 + ch.peer, p.src)))
        ops = make_ops(1, 0, 10, 0, 64)
        assert ch8.read(ops, deadline=time.monotonic() + 2).wait(5)
        c7 = ch7.read(ops, deadline=time.monotonic() + 2)
        assert c7.wait(5) and isinstance(c7.error, TransportTimeout)
        assert [r.peer for r in plan.fired] == [7]
        ch7.close()
        ch8.close()
    finally:
        p.close()


def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid, stopped, timeout=3.0):
    """Signals arrive asynchronously: wait until the process is (or is no longer) stopped."""
    end = time.monotonic() + timeout
    while (_proc_state(pid) == "T") != stopped and time.monotonic() < end:
        time.sleep(0.01)
    return _proc_state(pid) == "T"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_and_stall_a_named_pid():
    victims = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        plan = FaultPlan([Fault("read", "stall_peer", pid=victims[0].pid, point="before_completion"),
                          Fault("read", "kill_peer", pid=victims[1].pid, point="mid_transfer", nth=2)])
        p = Pair(plan)
        try:
            assert p.read()[0] is None and np.array_equal(p.local, p.src)  # the in-process peer still serves
            assert _wait_state(victims[0].pid, stopped=True)
            assert p.read()[0] is None
            assert victims[1].wait(5) == -signal.SIGKILL
            plan.heal()
            assert not _wait_state(victims[0].pid, stopped=False)
        finally:
            p.close()
    finally:
        for v in victims:
            v.kill()
            v.wait()


# --------------------------------------------------------------------------- a peer in another process
# Children run this file as a script (``python test_faults.py ROLE ...``): pytest imports test
# modules under names a spawned interpreter cannot import, so nothing is pickled by reference.
def _child(*args, env=None):
    full = dict(os.environ)
    full.pop("LLMDD_FAULTS", None)
    full.update(env or {})
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=full)


def _receive(proc, timeout):
    """One pickled line from the child (trusted: it is this file)."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert box.get("line"), f"child {proc.args[2:]} did not report (exit {proc.poll()})"
    return pickle.loads(base64.b64decode(box["line"]))


def _report(value):
    sys.stdout.write(base64.b64encode(pickle.dumps(value)).decode() + "\n")
    sys.stdout.flush()


def _stop(proc):
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _tcp_peer_main():
    ep = TcpTransport({}).open_endpoint()
    buf = np.random.default_rng(3).integers(0, 256, 64 << 20, dtype=np.uint8)
    desc = ep.register(MemRegion(region_id=10, addr=buf.ctypes.data, size=buf.nbytes, remote_accessible=True,
                                 placement=0))
    _report((ep.describe(), desc))
    sys.stdin.readline()


# A killed peer resets the streams. llmdd-tcp maps that to PeerGone on its inline path but its
# multi-stream workers let the raw ConnectionResetError reach ThreadCompletion, which reports
# Corrupt("transport worker failed: ...") (a tcp bug, reported; not this plugin's), so both are accepted.
@pytest.mark.parametrize("action,expected", [("kill_peer", (PeerGone, Corrupt)), ("stall_peer", TransportTimeout)])
def test_kill_or_stall_the_described_peer_mid_transfer(action, expected):
    proc = _child("tcp-peer")
    plan = FaultPlan([Fault("read", action, point="mid_transfer")])
    ep = wrap(TcpTransport, plan)({}).open_endpoint()
    try:
        peer_desc, region_desc = _receive(proc, 30)
        assert endpoint_fields(peer_desc).pid == proc.pid
        size = 64 << 20
        local = np.full(size, SENTINEL, np.uint8)
        ep.register(MemRegion(region_id=1, addr=local.ctypes.data, size=size, remote_accessible=False,
                              placement=0))
        ch = ep.connect(peer_desc, timeout=5.0)
        ch.add_remote_region(10, size, region_desc)
        t0 = time.monotonic()
        c = ch.read(make_ops(1, np.arange(256) * (1 << 18), 10, np.arange(256) * (1 << 18), 1 << 18),
                    deadline=t0 + 1.0)
        assert c.wait(10)
        assert isinstance(c.error, expected), c.error
        assert time.monotonic() - t0 < 3.0
        assert plan.fired[0].fault.action == action
        local[:] = SENTINEL
        plan.heal()  # a stalled peer resumes: nothing of the failed batch may land now
        time.sleep(0.3)
        assert (local == SENTINEL).all()
        ch.close()
    finally:
        ep.close()
        plan.heal()
        proc.kill()
        proc.wait(10)


# ============================================================================ conformance (empty plan)
def _make_pair():
    t = wrap(TcpTransport, FaultPlan())({})
    return t.open_endpoint(host="127.0.0.1"), t.open_endpoint(host="127.0.0.1")


@contextlib.contextmanager
def _stall(endpoint):
    inner = endpoint.inner
    release = threading.Event()
    originals = {name: getattr(inner, name) for name in ("_serve_request", "_serve_native")}

    def stalling(original):   # the Python serving and the C path's (the request waits unread)
        def stalled(*args):
            release.wait()
            return original(*args)
        return stalled

    for name, original in originals.items():
        setattr(inner, name, stalling(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(inner, name, original)
        release.set()


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance_with_an_empty_plan(check):
    # the checks that open endpoints themselves (authentication, the peer in a second process) get the
    # plain inner transport: the wrapper's endpoints talk to it unchanged (its describe() is the inner one)
    run_check(check, _make_pair, stall=_stall, transport=functools.partial(TcpTransport, {}))


# ============================================================================ the plugin
def _hooks(*plugins):
    pm = make_plugin_manager(autoload=False, strict=True)
    for plugin in plugins:  # the injector first: trylast must still put it after tcp
        pm.register(plugin)
    return Hooks(pm)


def test_injector_forced_shadows_the_inner_names():
    inj = FaultInjector([Fault("read", "drop")])
    hooks = _hooks(inj, llmdd_tcp)
    registry = hooks.register_transports()
    cls = registry.get("tcp")
    assert issubclass(cls, FaultyTransport) and cls.inner_cls is TcpTransport and cls.plan is inj.plan
    assert "faults-tcp" not in registry and "shm" not in registry  # shm not loaded here: skipped
    info = LinkInfo(local_cluster_id=1, peer_cluster_id=2, same_host=True, peer_transports=("tcp",))
    assert hooks.select_transport(info, registry.candidates(["tcp"])) == "tcp"


def test_injector_unforced_selects_the_wrapped_transport_for_targeted_links():
    inj = FaultInjector([Fault("read", "drop", peer=2)], force=False)
    hooks = _hooks(inj, llmdd_tcp)
    registry = hooks.register_transports()
    assert registry.get("tcp") is TcpTransport and registry.get("faults-tcp").inner_cls is TcpTransport
    both = registry.candidates(["tcp", "faults-tcp"])
    for peer, want in ((2, "faults-tcp"), (3, "tcp")):
        info = LinkInfo(local_cluster_id=1, peer_cluster_id=peer, same_host=False,
                        peer_transports=("tcp", "faults-tcp"))
        assert hooks.select_transport(info, both) == want
    info = LinkInfo(local_cluster_id=1, peer_cluster_id=2, same_host=False, peer_transports=("tcp",))
    assert hooks.select_transport(info, registry.candidates(["tcp"])) == "tcp"  # peer lacks it


class _Task:
    def __init__(self, peer):
        self.id, self.info = 1, {"peer": peer, "kind": "pull_blocks"}


def test_task_faults_through_run_transfer():
    inj = FaultInjector([Fault("task", "delay", delay=0.2), Fault("task", "fail", nth=2, error=PeerGone)])
    hooks = _hooks(inj)
    ran = []
    t0 = time.monotonic()
    hooks.run_transfer(_Task(2), lambda: ran.append(1))
    assert ran == [1] and time.monotonic() - t0 >= 0.2
    with pytest.raises(PeerGone):
        hooks.run_transfer(_Task(2), lambda: ran.append(2))
    assert ran == [1]
    assert [r.fault.action for r in inj.fired] == ["delay", "fail"]


# ============================================================================ two engines, two processes
PROMPT, DECODER = 101, 202
SHAPE = [8, 4096]  # 8 blocks of 4 KiB per tensor


def _config(listen):
    from llmdd import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 1000
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def _blocks_cache(dd, seed, key):
    from llmdd import CacheDesc, DataType, Placement

    arrays = [np.random.default_rng(seed + i).integers(0, 256, int(np.prod(SHAPE)), dtype=np.uint8)
              for i in range(2)]
    desc = CacheDesc(2, list(SHAPE), DataType.DT_UINT8, Placement.HOST)
    cache = dd.cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays], key, None)
    return cache, arrays


def _prompt_main():
    from llmdd import BlocksCacheKey, LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.PROMPT, PROMPT)
    dd.init(_config(listen=True))
    _cache, arrays = _blocks_cache(dd, 7, BlocksCacheKey(PROMPT, 0))
    _report((dd.statistics()["listen"][1], [a[:2 * 4096].copy() for a in arrays]))
    sys.stdin.readline()
    dd.finalize()


def _decoder_main(port):
    import llmdd_faults
    from llmdd import BlocksCacheKey, LLMClusterInfo, LLMDataDist, LLMException, LLMRole

    dd = LLMDataDist(LLMRole.DECODER, DECODER)
    dd.init(_config(listen=False))
    cache, arrays = _blocks_cache(dd, 0, None)
    for a in arrays:
        a[:] = SENTINEL
    info = LLMClusterInfo()
    info.remote_cluster_id = PROMPT
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    ret, _ = dd.link_clusters([info], 5000)
    results = [ret.name, dd.statistics()["links"][PROMPT]["transport"]]
    for dst in ([2, 3], [4, 5]):
        t0 = time.monotonic()
        try:
            dd.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), cache, [0, 1], dst)
            status = "LLM_SUCCESS"
        except LLMException as exc:
            status = exc.status_code.name
        results.append((status, time.monotonic() - t0))
    plan = llmdd_faults.env_plan()
    _report((results, [a[2 * 4096:4 * 4096].copy() for a in arrays], [a[4 * 4096:6 * 4096].copy() for a in arrays],
             [r.to_dict() for r in plan.fired] if plan is not None else None))
    sys.stdin.readline()
    with contextlib.suppress(Exception):
        dd.finalize()


def test_engine_pull_with_the_second_read_dropped():
    prompt = _child("prompt")
    decoder = None
    try:
        port, src = _receive(prompt, 30)
        decoder = _child("decoder", port, env={"LLMDD_FAULTS": json.dumps([{"op": "read", "action": "drop", "nth": 2}])})
        results, first, second, fired = _receive(decoder, 40)
        link_status, transport, (st1, t1), (st2, t2) = results
        assert link_status == "LLM_SUCCESS" and transport in ("tcp", "shm")
        assert st1 == "LLM_SUCCESS"
        assert all(np.array_equal(f, s) for f, s in zip(first, src))
        assert st2 == "LLM_TIMEOUT" and 0.9 < t2 < 1.0 + 1.0, (st2, t2)
        assert all((s == SENTINEL).all() for s in second)  # the dropped pull wrote nothing
        assert fired is not None and len(fired) == 1
        assert fired[0]["op"] == "read" and fired[0]["fault"]["action"] == "drop" and fired[0]["call"] == 2
        assert fired[0]["peer"] == PROMPT
    finally:
        for proc in (decoder, prompt):
            if proc is not None:
                _stop(proc)


def test_an_env_plan_drops_the_control_messages_it_names():
    """A plan given by LLMDD_FAULTS (how a process that is not the test's own, a vLLM worker, gets
    one) answers llmdd's control-message hook: the named message is dropped, others pass, and the
    firing is logged; a process without the plan has no such hook answer."""
    plan = [{"op": "control", "action": "drop", "message": "TransferRequest:peer_note", "count": None}]
    code = ("import llmdd_faults as F; print([F.llmdd_control_message(7, m, d) for m, d in "
            "(('TransferRequest:peer_note', 'received'), ('TransferRequest:pull', 'received'), "
            "('TransferRequest:peer_note', 'sent'))])")
    env = {k: v for k, v in os.environ.items() if k != "LLMDD_FAULTS"}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, LLMDD_FAULTS=json.dumps(plan)),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[True, None, None]", (out.stdout, out.stderr)
    control = subprocess.run([sys.executable, "-c", "import llmdd_faults as F; print(hasattr(F, 'llmdd_control_message'))"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert control.stdout.strip() == "False", (control.stdout, control.stderr)


if __name__ == "__main__":
    _role = sys.argv[1]
    if _role == "tcp-peer":
        _tcp_peer_main()
    elif _role == "prompt":
        _prompt_main()
    elif _role == "decoder":
        _decoder_main(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown role {_role!r}")


def test_a_wrapped_tcp_endpoint_keeps_its_per_link_capabilities():
    """The wrapper passes the inner endpoint's trust boundary through: it has capabilities when the
    inner one does, serve_links_only/grant/revoke reach it, so under fault injection a data
    connection without a granted capability is still refused; a granted one reads the right bytes
    (control), and a revoked one opens nothing more."""
    import secrets

    import attrs

    cls = wrap(TcpTransport, FaultPlan([]))
    t = cls({})
    a, b = t.open_endpoint(), t.open_endpoint()
    try:
        assert a.capabilities is True and b.capabilities is TcpTransport({}).open_endpoint().capabilities
        src = np.random.default_rng(77).integers(0, 256, SIZE, dtype=np.uint8)
        dst = np.zeros(SIZE, np.uint8)
        b.serve_links_only()
        d10 = b.register(MemRegion(region_id=10, addr=src.ctypes.data, size=SIZE, remote_accessible=True,
                                   placement=0))
        a.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
        with pytest.raises(Refused):                          # no capability: refused, as unwrapped
            a.connect(b.describe(), timeout=5.0)
        cap = secrets.token_bytes(32)
        b.grant(3, cap, [10])
        ch = a.connect(attrs.evolve(b.describe(), capability=cap), timeout=5.0)
        ch.add_remote_region(10, SIZE, d10)
        c = ch.read(make_ops(1, 0, 10, 0, 4096), deadline=time.monotonic() + 5.0)
        assert c.wait(10.0) and c.error is None
        assert np.array_equal(dst[:4096], src[:4096])
        ch.close()
        b.revoke(3)
        with pytest.raises(Refused):
            a.connect(attrs.evolve(b.describe(), capability=cap), timeout=5.0)
    finally:
        a.close()
        b.close()
