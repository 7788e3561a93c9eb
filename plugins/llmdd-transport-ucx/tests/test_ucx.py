"""ucx-specific tests: lazy import, probe without NIXL, clean exit, two processes, which UCX
transport ran, deadlines with requests in flight, option mapping, and two llmdd engines
linked over ucx (the tcp transport must move nothing then)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from llmdd.lowlevel import MemRegion, TransportTimeout
from llmdd._seam.ops import make_ops
import llmdd_ucx
from llmdd_ucx import UcxTransport, _nixl
from llmdd_ucx._options import ucx_env

_INFO = UcxTransport.probe()
needs_nixl = pytest.mark.skipif(not _INFO.available, reason=f"ucx transport unavailable: {_INFO.reason}")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
INTEGRATION = os.path.join(REPO, "tests", "integration")
MiB = 1 << 20


def _run_py(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    for k in ("UCX_MODULES", "UCX_TLS", "UCX_PROTO_INFO"):
        full.pop(k, None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full)


def _region(rid: int, buf: np.ndarray, remote: bool = True) -> MemRegion:
    return MemRegion(region_id=rid, addr=buf.ctypes.data, size=buf.nbytes, remote_accessible=remote, placement=0)


# ------------------------------------------------------------------------------ import / probe


def test_import_does_not_load_nixl():
    r = _run_py("""
        import sys, llmdd_ucx
        assert not [m for m in sys.modules if m.startswith(("nixl", "nixl_cu"))], sorted(sys.modules)
        import os; assert "UCX_MODULES" not in os.environ
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_probe_without_nixl_says_why():
    r = _run_py("""
        import sys
        for m in ("nixl", "nixl_cu12", "nixl_cu13"):
            sys.modules[m] = None          # import of any of them raises ImportError
        from llmdd_ucx import UcxTransport
        info = UcxTransport.probe()
        assert not info.available
        print("REASON", info.reason)
    """)
    assert r.returncode == 0, r.stderr
    assert "REASON NIXL is not installed (pip install --no-deps nixl-cu12)" in r.stdout


def test_plugin_registers_through_entry_point():
    from importlib.metadata import entry_points
    eps = [ep for ep in entry_points(group="llmdd") if ep.name == "ucx"]
    assert eps and eps[0].value == "llmdd_ucx"
    assert UcxTransport.name == "ucx" and not UcxTransport.same_host_only
    assert 10 < UcxTransport.priority < 100


def test_option_mapping_and_user_env_wins(monkeypatch):
    env = ucx_env({"llmdd.ucx.tls": "tcp", "llm.RdmaTrafficClass": 132, "llm.RdmaServiceLevel": 3})
    assert env == {"UCX_TLS": "tcp", "UCX_IB_TRAFFIC_CLASS": "132", "UCX_IB_SL": "3"}
    monkeypatch.setenv("UCX_IB_SL", "5")
    monkeypatch.delenv("UCX_IB_TRAFFIC_CLASS", raising=False)
    with _nixl.scoped_env(env):
        assert os.environ["UCX_IB_SL"] == "5"  # set by the user: kept
        assert os.environ["UCX_IB_TRAFFIC_CLASS"] == "132"
    assert "UCX_IB_TRAFFIC_CLASS" not in os.environ and os.environ["UCX_IB_SL"] == "5"


def test_chunking_bounds_bytes_and_descriptors():
    ld = np.array([[0, 10, 0], [100, 3, 0], [200, 25, 0]], dtype=np.uint64)
    rd = ld.copy()
    rd[:, 0] += 1000
    chunks = llmdd_ucx._xfer.chunk(ld, rd, 8, 2)
    lens = np.concatenate([c[0][:, 1] for c in chunks])
    assert int(lens.sum()) == 38 and lens.max() <= 8
    assert all(len(c[0]) <= 2 and int(c[0][:, 1].sum()) <= 8 for c in chunks)
    starts = np.concatenate([c[0][:, 0] for c in chunks])
    assert np.array_equal(np.concatenate([c[1][:, 0] for c in chunks]) - starts, np.full(len(starts), 1000))


def test_a_few_ops_become_the_descriptors_of_their_coalesced_batch():
    """The plain-Python path of a batch of a few ops (``_few_descs``) merges and orders them as
    ``coalesce_ops`` does (seeded random batches with runs continuing on both sides, zero lengths)."""
    from types import SimpleNamespace

    from llmdd.lowlevel import coalesce_ops
    from llmdd_ucx._channel import _few_descs

    local = {rid: SimpleNamespace(region=SimpleNamespace(addr=addr)) for rid, addr in ((1, 1 << 20), (2, 5 << 20))}
    remote = {10: SimpleNamespace(addr=9 << 30, dev=0), 11: SimpleNamespace(addr=3 << 30, dev=7)}
    rng = np.random.default_rng(17)
    merged_some = False
    for _ in range(300):
        n = int(rng.integers(1, 9))
        blocks = rng.integers(0, 6, n)
        ops = make_ops(rng.choice([1, 2], n), blocks * 4096, rng.choice([10, 11], n), blocks * 4096,
                       rng.choice([0, 4096, 4096, 4096], n))
        want = coalesce_ops(ops)
        merged_some |= 0 < len(want) < int((ops["length"] > 0).sum())
        chunks, total, nops, lids, rids = _few_descs(ops.tolist(), local, remote, 1 << 30, 1 << 16)
        (ld, rd), = chunks
        assert nops == len(want) == len(ld) and total == int(want["length"].sum())
        assert ld == [(local[int(o["local_region"])].region.addr + int(o["local_offset"]), int(o["length"]), 0)
                      for o in want]
        assert rd == [(remote[int(o["remote_region"])].addr + int(o["remote_offset"]), int(o["length"]),
                       remote[int(o["remote_region"])].dev) for o in want]
        assert lids == set(want["local_region"].tolist()) and rids == set(want["remote_region"].tolist())
    assert merged_some
    ops = make_ops(1, [0, 4096], 10, [0, 4096], 4096)
    assert _few_descs(ops.tolist(), local, remote, 4096, 16) is None      # more than one chunk's bytes
    assert _few_descs(make_ops(1, [0, 8192], 10, [0, 0], 1).tolist(), local, remote, 1 << 20, 1) is None


# ------------------------------------------------------------------------------ process exit


def test_a_broadcast_to_many_clients_starts_no_thread_per_client():
    """DRAIN/BYE to every client: all requests leave, then one deadline covers every answer (the
    notification loop sets the waiters; here the stand-in for ``send_notif`` answers at once), with
    no thread per client; a client that does not answer is dropped and counted."""
    import threading

    from llmdd_ucx import OPT_CONTROL_TIMEOUT, UcxEndpoint, _proto

    ep = object.__new__(UcxEndpoint)   # the bookkeeping of an endpoint, without NIXL
    ep.lock = threading.RLock()
    ep._clients = {f"peer-{i}": 1 for i in range(200)}
    ep.cfg = {OPT_CONTROL_TIMEOUT: 0.2}
    ep._waiters = {}
    ep._kick = threading.Event()
    ep._stats = {"control_timeouts": 0}
    ep._log = llmdd_ucx._endpoint._log
    threads0 = threading.active_count()
    sent = []

    def send(peer, kind, token, payload=b""):
        assert threading.active_count() <= threads0
        sent.append(peer)
        if peer == "peer-7":
            return False                    # a gone peer cannot be told anything
        if peer != "peer-9":                # peer-9 never answers
            ep._waiters[token].set()
        return True

    ep._send = send
    ep._broadcast(_proto.DRAIN, b"")
    assert sorted(sent) == sorted(f"peer-{i}" for i in range(200))
    assert set(ep._clients) == {f"peer-{i}" for i in range(200)} - {"peer-7", "peer-9"}
    assert ep._stats["control_timeouts"] == 2 and ep._waiters == {}


@needs_nixl
def test_process_using_the_plugin_exits_cleanly():
    r = _run_py("""
        import os, time, numpy as np
        from llmdd.lowlevel import MemRegion
        from llmdd._seam.ops import make_ops
        from llmdd_ucx import UcxTransport
        assert UcxTransport.probe().available
        assert os.environ["UCX_MODULES"] == "^ib"
        t = UcxTransport({})
        a, b = t.open_endpoint(), t.open_endpoint()
        x = np.zeros(1 << 20, np.uint8); y = np.arange(1 << 20).astype(np.uint8)
        a.register(MemRegion(region_id=1, addr=x.ctypes.data, size=x.nbytes, remote_accessible=True, placement=0))
        d = b.register(MemRegion(region_id=2, addr=y.ctypes.data, size=y.nbytes, remote_accessible=True, placement=0))
        ch = a.connect(b.describe(), timeout=10)
        ch.add_remote_region(2, y.nbytes, d)
        c = ch.read(make_ops(1, 0, 2, 0, 1 << 20), deadline=time.monotonic() + 10)
        assert c.wait(15) and c.error is None and np.array_equal(x, y)
        print("moved")
        # no close: the process just exits
    """)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "moved" in r.stdout


@needs_nixl
def test_user_ucx_modules_is_respected():
    r = _run_py("""
        import os
        from llmdd_ucx import UcxTransport
        UcxTransport.probe()
        print("MODULES", os.environ["UCX_MODULES"])
    """, env={"UCX_MODULES": "^ib,rdmacm"})
    assert r.returncode == 0, r.stderr
    assert "MODULES ^ib,rdmacm" in r.stdout


# ------------------------------------------------------------------------------ two processes

_TWO_PROC = """
import multiprocessing as mp, os, sys, time
import numpy as np
from llmdd.lowlevel import MemRegion
from llmdd._seam.ops import make_ops
from llmdd_ucx import UcxTransport

SIZE = 8 << 20
TLS = sys.argv[1]

def owner(conn):
    t = UcxTransport({"llmdd.ucx.tls": TLS})
    ep = t.open_endpoint()
    src = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    sink = np.zeros(SIZE, np.uint8)
    d_src = ep.register(MemRegion(region_id=10, addr=src.ctypes.data, size=SIZE, remote_accessible=True, placement=0))
    d_sink = ep.register(MemRegion(region_id=11, addr=sink.ctypes.data, size=SIZE, remote_accessible=True, placement=0))
    conn.send((ep.describe(), d_src, d_sink))
    conn.recv()                                  # the initiator is done
    conn.send((src.tobytes(), sink.tobytes(), ep.statistics()))
    conn.recv()
    ep.close()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=owner, args=(there,))
    p.start()
    t = UcxTransport({"llmdd.ucx.tls": TLS})
    ep = t.open_endpoint()
    dst = np.zeros(SIZE, np.uint8)
    out = np.random.default_rng(8).integers(0, 256, SIZE, dtype=np.uint8)
    ep.register(MemRegion(region_id=1, addr=dst.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    ep.register(MemRegion(region_id=2, addr=out.ctypes.data, size=SIZE, remote_accessible=False, placement=0))
    desc, d_src, d_sink = here.recv()
    ch = ep.connect(desc, timeout=20)
    ch.add_remote_region(10, SIZE, d_src)
    ch.add_remote_region(11, SIZE, d_sink)
    rng = np.random.default_rng(0)
    n, blk = SIZE // 16384, 16384
    ls, rs = rng.permutation(n), rng.permutation(n)
    c = ch.read(make_ops(1, ls * blk, 10, rs * blk, blk), deadline=time.monotonic() + 30)
    assert c.wait(40) and c.error is None, c.error
    c = ch.write(make_ops(2, 0, 11, 0, SIZE), deadline=time.monotonic() + 30)
    assert c.wait(40) and c.error is None, c.error
    here.send("done")
    src, sink, owner_stats = here.recv()
    src = np.frombuffer(src, np.uint8).reshape(n, blk)
    assert np.array_equal(dst.reshape(n, blk)[ls], src[rs]), "read moved wrong bytes"
    assert np.array_equal(np.frombuffer(sink, np.uint8), out), "write moved wrong bytes"
    st = ch.statistics()
    assert st["bytes_read"] == SIZE and st["bytes_written"] == SIZE, st
    print("TWO_PROC_OK", st["requests"], owner_stats["clients"], flush=True)
    ch.close()
    here.send("bye")
    p.join(30)
    ep.close()
    assert p.exitcode == 0, p.exitcode
"""


@needs_nixl
@pytest.mark.parametrize("tls,expect", [("", "cma"), ("tcp", "tcp")], ids=["UCX_TLS=default", "UCX_TLS=tcp"])
def test_two_processes_move_bytes_and_record_the_ucx_transport(tmp_path, tls, expect):
    script = tmp_path / "two_proc.py"
    script.write_text(_TWO_PROC)
    env = {"UCX_PROTO_INFO": "y", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, str(script), tls], capture_output=True, text=True,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("UCX_")}, **env})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "TWO_PROC_OK" in r.stdout
    # UCX_PROTO_INFO=y prints a table per operation and peer, e.g.
    #   | remote memory read by ucp_get*(multi) into host memory from host |
    #   | 0..inf | zero-copy   | cma/memory                                |
    used = set(re.findall(r"\|\s*[0-9.]+(?:K|M|G)?\.\.[0-9a-z.KMG]+\s*\|[^|]*\|\s*([a-z_0-9]+)/", out))
    assert used, f"UCX printed no protocol selection:\n{out[-3000:]}"
    print("UCX transports used:", sorted(used))
    assert expect in used, f"expected UCX to run {expect}, it used {sorted(used)}"
    if expect == "tcp":
        assert used == {"tcp"}, f"UCX_TLS=tcp still selected {sorted(used)}"


# ------------------------------------------------------------------------------ deadlines


@needs_nixl
def test_deadline_with_requests_in_flight_drains_before_reporting():
    t = UcxTransport({"llmdd.ucx.tls": "tcp", "llmdd.ucx.chunk_bytes": str(8 * MiB)})
    a, b = t.open_endpoint(), t.open_endpoint()
    size = 128 * MiB
    dst = np.full(size, 0xA5, np.uint8)
    src = np.ones(size, np.uint8)
    try:
        a.register(_region(1, dst))
        d = b.register(_region(10, src))
        ch = a.connect(b.describe(), timeout=10)
        ch.add_remote_region(10, size, d)
        t0 = time.monotonic()
        c = ch.read(make_ops(1, np.arange(size // 65536) * 65536, 10, np.arange(size // 65536) * 65536, 65536),
                    deadline=t0 + 0.02)
        assert c.wait(30)
        assert isinstance(c.error, TransportTimeout), c.error
        assert time.monotonic() - t0 < 10
        # drained before reporting: every posted request reached a final state and was released (a
        # request still in flight at the drain's limit is kept as "stranded" and the error is PeerGone
        # instead), so none can write into dst any more; the bytes are checked against that
        assert a.statistics()["stranded_requests"] == 0
        dst[:] = 0xA5
        c2 = ch.read(make_ops(1, 0, 10, 0, 4096), deadline=time.monotonic() + 10)   # one round trip later
        assert c2.wait(15) and c2.error is None
        assert (dst[:4096] == 1).all() and (dst[4096:] == 0xA5).all(), "bytes landed after the timeout was reported"
        ch.close()   # (the read above: the channel still works afterwards)
    finally:
        a.close()
        b.close()


@needs_nixl
def test_region_registered_after_connect_is_reachable():
    t = UcxTransport({})
    a, b = t.open_endpoint(), t.open_endpoint()
    try:
        x = np.zeros(MiB, np.uint8)
        a.register(_region(1, x))
        ch = a.connect(b.describe(), timeout=10)
        y = np.arange(MiB).astype(np.uint8)
        d = b.register(_region(5, y))           # after the peer loaded b's metadata
        ch.add_remote_region(5, MiB, d)
        c = ch.read(make_ops(1, 0, 5, 0, MiB), deadline=time.monotonic() + 10)
        assert c.wait(15) and c.error is None and np.array_equal(x, y)
        ch.close()
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------ engines


@needs_nixl
@pytest.mark.timeout(90)
def test_two_engines_link_over_ucx_and_tcp_moves_nothing():
    if INTEGRATION not in sys.path:
        sys.path.insert(0, INTEGRATION)
    try:
        import _dataplane_peers as P
    except ImportError as exc:  # pragma: no cover - the repo layout changed
        pytest.skip(f"engine peer helpers not found: {exc}")
    from llmdd import BlocksCacheKey
    env = {"PYTHONPATH": os.pathsep.join([INTEGRATION, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    pool = P.PeerPool(env)
    try:
        p, d, port = pool.pair("ucx")
        nt, nb, bs = 8, 64, 16384
        p.call(P.register, "src", nt, [nb, bs], blocks=True, seed=3, key=BlocksCacheKey(1, 0))
        d.call(P.register, "dst", nt, [nb, bs], blocks=True)
        assert d.call(P.link, 1, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
        info = d.call(P.link_info, 1)
        assert info["transport"] == "ucx", info
        src = p.call(P.snapshot, "src").reshape(nt, nb, bs)
        rng = np.random.default_rng(1)
        s, t = rng.permutation(nb)[:40].tolist(), rng.permutation(nb)[:40].tolist()
        d.call(P.cm, "pull_blocks", BlocksCacheKey(cluster_id=1), P.Ref("dst"), s, t)
        dst = d.call(P.snapshot, "dst").reshape(nt, nb, bs)
        assert np.array_equal(dst[:, t], src[:, s])
        moved = nt * 40 * bs
        for peer in (p, d):
            eps = peer.call(endpoint_statistics)
            assert set(eps) >= {"ucx"}, eps
            tcp = eps.get("tcp")
            if tcp is not None:
                assert tcp["bytes_served"] == 0 and tcp["requests"] == 0, tcp
        ucx_d = d.call(endpoint_statistics)["ucx"]
        assert ucx_d["bytes_read"] >= moved, ucx_d
    finally:
        pool.close()


def endpoint_statistics(state: dict) -> dict:
    """(peer side) the engine's transport endpoints and their channels' counters."""
    lm = state["dd"]._require_core().link_manager
    out = {}
    for name, ep in lm.endpoints.open.items():
        st = dict(ep.statistics())
        chans = [c.statistics() for c in getattr(ep, "_channels", ())]
        st["bytes_read"] = sum(c.get("bytes_read", 0) for c in chans)
        st["bytes_written"] = sum(c.get("bytes_written", 0) for c in chans)
        out[name] = {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool, type(None)))}
    return out


@needs_nixl
@pytest.mark.timeout(180)
def test_a_linked_peer_gets_no_key_for_a_region_that_is_not_remote_accessible():
    """Two processes (the committed probe): a peer holding everything a link sends it (description
    and both region descriptors, keys loaded into NIXL) and calling NIXL itself reads the
    remote-accessible region's exact bytes (the control: the direct path works) but NIXL has no key
    for the region that is not remote-accessible, and the llmdd channel refuses it too."""
    probe = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "results-committed",
                         "issue14", "ucx_keys.py")
    proc = subprocess.run([sys.executable, os.path.abspath(probe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert got["key sent for the remote-accessible region"] == "True"
    assert got["key sent for the region NOT remote-accessible"] == "False"
    assert got["remote-accessible region"] == "state DONE, bytes match owner: True"
    assert got["region NOT remote-accessible"].startswith("refused by NIXL"), got
    assert got["memory never registered"].startswith("refused by NIXL"), got
    assert got["llmdd channel, region NOT remote-accessible"].startswith("refused: Refused"), got
