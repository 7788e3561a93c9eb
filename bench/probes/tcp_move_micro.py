"""The tcp transport's _move (the bytes of a request, both ends of a socketpair, one process) in two
trees, same run, interleaved: per-op memoryview slices (old) vs numpy iovec arrays through
sendmsg/recvmsg (new).  Median microseconds per move over REPS, three rounds, and the new/old ratio.

    python bench/probes/tcp_move_micro.py OLD_TREE NEW_TREE     # e.g. a `git archive` of the older commit, .
"""
import importlib.util, os, socket, sys, threading, time, numpy as np

def pick(mod, name):
    """``mod.name``, or ``mod._name`` in a version of the module from before issue 37 made it public."""
    return getattr(mod, name, None) or getattr(mod, "_" + name)

def load(path, name):
    # the tree's llmdd_tcp as package `name`; the module that holds _move: the package itself, or its _io module
    # once issue 16 (5) split the transport into modules
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[os.path.dirname(path)]); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return sys.modules.get(name + "._io", m)
new = load(sys.argv[2] + "/plugins/llmdd-transport-tcp/src/llmdd_tcp/__init__.py", "tcp_new")
old = load(sys.argv[1] + "/plugins/llmdd-transport-tcp/src/llmdd_tcp/__init__.py", "tcp_old")
src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8); dst = np.zeros_like(src)
def run(mod, nops, blk, reps):
    a, b = socket.socketpair(); 
    for s in (a,b): s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4<<20); s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4<<20)
    reg = np.zeros(nops, np.uint32); off = (np.arange(nops, dtype=np.uint64) * blk); ln = np.full(nops, blk, np.uint64)
    if mod is new:
        ws = pick(new, "Where")(np.array([0], np.int64), np.array([src.ctypes.data], np.uint64))
        wd = pick(new, "Where")(np.array([0], np.int64), np.array([dst.ctypes.data], np.uint64))
    else:
        ws = {0: pick(old, "region_view")(src.ctypes.data, src.nbytes)}; wd = {0: pick(old, "region_view")(dst.ctypes.data, dst.nbytes)}
    t = []
    for _ in range(reps):
        th = threading.Thread(target=pick(mod, "move"), args=(a, ws, reg, off, ln, None, True)); 
        t0 = time.perf_counter(); th.start(); pick(mod, "move")(b, wd, reg, off, ln, None, False); th.join(); t.append(time.perf_counter() - t0)
    a.close(); b.close(); assert np.array_equal(dst[:nops*blk], src[:nops*blk]); dst[:] = 0
    return np.median(t) * 1e6
for nops, blk, reps in ((1, 65536, 400), (8, 16384, 300), (128, 16384, 100), (2048, 1024, 100), (20000, 64, 30)):
    r = []
    for i in range(3):
        r.append((run(old, nops, blk, reps), run(new, nops, blk, reps)))
    print(f"{nops:6d} ops x {blk:6d} B: old/new median us per move " + "  ".join(f"{o:8.1f}/{n:8.1f}" for o, n in r) + f"   new/old {np.median([n/o for o,n in r]):.2f}")
