"""The tcp transport's _move over TLS (the bytes of a request, both ends of a TLS-wrapped socketpair, one
process) in two trees, same run, interleaved: per-op memoryview slices (old) vs stages gathered and
scattered with llmdd.lowlevel.copy_runs (new).  Median microseconds per move over REPS, three rounds,
and the new/old ratio.  Certificates from trustme (the test extra).  Seeded random bytes, random
distinct blocks on both sides; every block checked after each round.

    python bench/probes/tcp_tls_move_micro.py OLD_TREE NEW_TREE     # e.g. a `git archive` of the older commit, .
"""
import importlib.util
import os
import queue
import socket
import ssl
import sys
import threading
import time

import numpy as np
import trustme



def pick(mod, name):
    """``mod.name``, or ``mod._name`` in a version of the module from before issue 37 made it public."""
    return getattr(mod, name, None) or getattr(mod, "_" + name)

def load(tree, name):
    """The tree's llmdd_tcp as package ``name``; the module that holds ``_move``: the package itself, or its
    ``_io`` module once issue 16 (5) split the transport into modules."""
    pkg = tree + "/plugins/llmdd-transport-tcp/src/llmdd_tcp"
    spec = importlib.util.spec_from_file_location(name, pkg + "/__init__.py", submodule_search_locations=[pkg])
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return sys.modules.get(name + "._io", m)


new = load(sys.argv[2], "tcp_new")
old = load(sys.argv[1], "tcp_old")
ca = trustme.CA()
cert = ca.issue_cert("localhost")
sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
cert.configure_cert(sctx)
cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ca.configure_trust(cctx)
SIZE = 16 << 20
src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
dst = np.zeros_like(src)


def where(mod, arr):
    ids, addrs = np.array([0], np.int64), np.array([arr.ctypes.data], np.uint64)
    try:
        return pick(mod, "Where")(ids, addrs, {0: pick(mod, "region_view")(arr.ctypes.data, arr.nbytes)})   # the old signature
    except (TypeError, AttributeError):   # AttributeError: the split package's _io, with no _region_view
        return pick(mod, "Where")(ids, addrs)


def pair():
    a, b = socket.socketpair()
    out = {}

    def srv():
        out["s"] = sctx.wrap_socket(a, server_side=True)
        out["s"].do_handshake()

    t = threading.Thread(target=srv)
    t.start()
    c = cctx.wrap_socket(b, server_hostname="localhost")
    c.do_handshake()
    t.join()
    return out["s"], c


def run(mod, nops, blk, reps, rng):
    s, c = pair()
    ws, wd = where(mod, src), where(mod, dst)
    t = []
    todo, done = queue.SimpleQueue(), queue.SimpleQueue()

    def sender():   # one persistent thread, as the owner's worker threads are
        while (job := todo.get()) is not None:
            pick(mod, "move")(s, ws, *job, None, True)
            done.put(1)

    th = threading.Thread(target=sender)
    th.start()
    for _ in range(reps):
        nb = SIZE // blk
        so = rng.permutation(nb)[:nops].astype(np.uint64) * np.uint64(blk)
        do = rng.permutation(nb)[:nops].astype(np.uint64) * np.uint64(blk)
        reg = np.zeros(nops, np.uint32)
        ln = np.full(nops, blk, np.uint64)
        t0 = time.perf_counter()
        todo.put((reg, so, ln))
        pick(mod, "move")(c, wd, reg, do, ln, None, False)
        done.get()
        t.append(time.perf_counter() - t0)
    todo.put(None)
    th.join()
    for a_, b_ in zip(so.tolist(), do.tolist()):
        assert np.array_equal(dst[b_:b_ + blk], src[a_:a_ + blk])
    s.close()
    c.close()
    dst[:] = 0
    return float(np.median(t)) * 1e6


print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  load {os.getloadavg()}  "
      f"old {sys.argv[1]}  new {sys.argv[2]}")
for nops, blk, reps in ((1, 65536, 200), (8, 16384, 200), (128, 16384, 50), (256, 4096, 50), (2048, 1024, 30),
                        (4096, 64, 30), (64, 262144, 5)):
    r = []
    for i in range(3):
        r.append((run(old, nops, blk, reps, np.random.default_rng(i)), run(new, nops, blk, reps, np.random.default_rng(i))))
    print(f"{nops:6d} ops x {blk:6d} B: old/new median us per move " + "  ".join(f"{o:8.1f}/{n:8.1f}" for o, n in r)
          + f"   new/old {np.median([n / o for o, n in r]):.2f}", flush=True)
print(f"load after {os.getloadavg()}")
