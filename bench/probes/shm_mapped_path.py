"""The shm transport's pure-Python path (``LLMDD_SHM_NATIVE=0``) over *pool* memory (mapped segments):
``Channel.read`` / ``write`` of n random distinct blocks, two source trees, same run, interleaved.

Issue 17 point 4.  Pool regions are moved by the peer's mapping of the owner's segment, so this is the
path that copied with one ``ctypes.memmove`` per op; ``llmdd bench`` pulls user memory (cross-memory
attach) and never takes it.  Each worker (a fresh interpreter, one tree on its PYTHONPATH, the native
path off) opens two shm endpoints in one process, registers a 64 MiB seeded-random pool region on the
owner and a 64 MiB pool sink on the reader, connects, and times each shape (one op per block, blocks
drawn without replacement, offsets multiples of the block) as the median of ``reps`` batches; the
bytes of every block of the last batch are checked against the source.  The driver runs the trees
alternately ``--rounds`` times and reports per shape the median over rounds of the new/old ratio.

    python bench/probes/shm_mapped_path.py --trees OLD_TREE NEW_TREE --rounds 3 --out DIR
    python bench/probes/shm_mapped_path.py --worker [--cprofile FILE]      # one tree: the one on PYTHONPATH
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
SIZE = 64 * MiB
#: (ops, block bytes, direction); the first two take the plugin's few-ops (<= 8) plan
SHAPES = [(1, 65536, "read"), (8, 16384, "read"), (16, 16384, "read"), (128, 16384, "read"),
          (16, 8192, "read"), (256, 8192, "read"), (16, 4096, "read"), (64, 4096, "read"),
          (256, 4096, "read"), (256, 4096, "write"), (1024, 1024, "read"), (4096, 256, "read"),
          (4096, 64, "write"), (256, 65536, "read"), (1024, 65536, "write")]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def worker(cprofile: str = "") -> dict:
    import numpy as np
    import llmdd_shm
    from llmdd_shm import _hotpath
    from llmdd._memory.backend import HostBackend
    from llmdd.lowlevel import MemRegion, make_ops

    assert _hotpath.native is None, "run with LLMDD_SHM_NATIVE=0"
    t = llmdd_shm.ShmTransport({llmdd_shm.OPT_NATIVE: "off"})
    a, b = t.open_endpoint(), t.open_endpoint()
    be = HostBackend()
    sseg, dseg = be.allocate_segment(SIZE), be.allocate_segment(SIZE)
    out: dict = {"tree": os.path.abspath(os.path.join(os.path.dirname(llmdd_shm.__file__), *[".."] * 4)),
                 "load_before": _load(), "shapes": {}}
    try:
        src, dst = sseg.array()[:SIZE], dseg.array()[:SIZE]
        src[:] = np.random.default_rng(17).integers(0, 256, SIZE, dtype=np.uint8)
        a.register(MemRegion(region_id=1, addr=dseg.addr, size=SIZE, remote_accessible=False, placement=0,
                             shm_name=dseg.name, shm_offset=0))
        d = b.register(MemRegion(region_id=2, addr=sseg.addr, size=SIZE, remote_accessible=True, placement=0,
                                 shm_name=sseg.name, shm_offset=0))
        ch = a.connect(b.describe(), timeout=10)
        ch.add_remote_region(2, SIZE, d)
        rng = np.random.default_rng(4)
        prof = None
        if cprofile:
            import cProfile

            prof = cProfile.Profile()
        for nops, blk, direction in SHAPES:
            nb = SIZE // blk
            reps = max(5, min(400, int(3e8 // (nops * blk))))
            batches = [(rng.choice(nb, nops, replace=False), rng.choice(nb, nops, replace=False)) for _ in range(reps)]
            times = []
            for lb, rb in batches:
                ops = make_ops(1, lb.astype(np.uint64) * blk, 2, rb.astype(np.uint64) * blk, blk)
                fn = ch.read if direction == "read" else ch.write
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                c = fn(ops, deadline=time.monotonic() + 30)
                ok = c.wait(30)
                if prof is not None:
                    prof.disable()
                times.append(time.perf_counter() - t0)
                assert ok and c.error is None, c.error
            lb, rb = batches[-1]
            for i in range(nops):   # the last batch's bytes, every block
                l, r = int(lb[i]) * blk, int(rb[i]) * blk
                if direction == "read":
                    assert np.array_equal(dst[l:l + blk], src[r:r + blk]), (nops, blk, i)
                else:
                    assert np.array_equal(src[r:r + blk], dst[l:l + blk]), (nops, blk, i)
            if direction == "write":   # the source again, for the read shapes after it
                src[:] = np.random.default_rng(17).integers(0, 256, SIZE, dtype=np.uint8)
            out["shapes"][f"{direction}_{nops}x{blk}"] = {"p50_us": round(statistics.median(times) * 1e6, 2),
                                                         "reps": reps, "verified": True}
        if prof is not None:
            import io
            import pstats

            s = io.StringIO()
            ps = pstats.Stats(prof, stream=s)
            ps.sort_stats("tottime").print_stats(30)
            with open(cprofile, "w") as f:
                f.write(f"# cProfile of every timed batch of bench/probes/shm_mapped_path.py --worker (shapes {SHAPES})\n")
                f.write(s.getvalue())
        out["statistics"] = {k: v for k, v in ch.statistics().items() if isinstance(v, int)}
        ch.close()
    finally:
        a.close()
        b.close()
        be.release(sseg)
        be.release(dseg)
    out["load_after"] = _load()
    return out


def _env(tree: str) -> dict:
    pp = [tree] + sorted(glob.glob(os.path.join(tree, "plugins", "*", "src")))
    return dict(os.environ, PYTHONPATH=":".join(pp), LLMDD_SHM_NATIVE="0")


def driver(trees: list[str], rounds: int, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    runs: list[dict] = []
    for r in range(rounds):
        for side, tree in zip(("old", "new"), trees):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=_env(tree),
                               cwd=tree, capture_output=True, text=True, timeout=900)
            if p.returncode:
                sys.exit(f"worker ({side}, {tree}) failed:\n{p.stdout}\n{p.stderr}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res.update(side=side, round=r)
            runs.append(res)
            print(f"round {r} {side}: load {res['load_before']} -> {res['load_after']}", flush=True)
    shapes = list(runs[0]["shapes"])
    summary = {}
    for s in shapes:
        old = [x["shapes"][s]["p50_us"] for x in runs if x["side"] == "old"]
        new = [x["shapes"][s]["p50_us"] for x in runs if x["side"] == "new"]
        summary[s] = {"old_p50_us": old, "new_p50_us": new,
                      "new_over_old": round(statistics.median(n / o for o, n in zip(old, new)), 3)}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"command": " ".join(sys.argv), "trees": trees, "runs": runs, "summary": summary}, f, indent=1)
    print(f"{'shape':22s} {'old p50 us (rounds)':>34s} {'new p50 us (rounds)':>34s}  new/old")
    for s, v in summary.items():
        print(f"{s:22s} {' '.join(f'{x:10.1f}' for x in v['old_p50_us']):>34s} "
              f"{' '.join(f'{x:10.1f}' for x in v['new_p50_us']):>34s}  {v['new_over_old']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--cprofile", default="")
    ap.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="shm-mapped-path-results")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.cprofile)))
        return
    if not a.trees:
        ap.error("--trees OLD NEW or --worker")
    driver([os.path.abspath(t) for t in a.trees], a.rounds, a.out)


if __name__ == "__main__":
    main()
