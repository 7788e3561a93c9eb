"""Three ways for the shm plugin's pure-Python path to copy a batch of runs between two mapped
shared-memory segments of this process, same run, interleaved, median microseconds per batch:

* ``loop``: one ``ctypes.memmove`` per run (the path before issue 17 point 4);
* ``cma``: one ``process_vm_readv`` on the own pid per batch, iovec arrays built with numpy
  (``llmdd_shm._cma.Cma.transfer``: what the issue suggested);
* ``gather``: ``llmdd.lowlevel.copy_runs`` (numpy gathers for short runs, memmove for long ones).

Random distinct blocks of a 64 MiB segment into random distinct blocks of another; every run's
bytes checked after each method.  Ratios are against ``loop``.

    python bench/probes/shm_copy_micro.py
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

from llmdd_shm import _seg
from llmdd_shm._cma import Cma, iovecs
from llmdd.lowlevel import copy_runs

N = 64 << 20
SHAPES = [(1, 65536), (8, 16384), (16, 16384), (128, 16384), (32, 4096), (64, 4096), (256, 4096), (256, 8192),
          (256, 16384), (256, 32768), (1024, 65536), (1024, 1024), (2048, 1024), (4096, 64)]


def main() -> None:
    names = [f"llmdd_bench_copy_{os.getpid()}_{k}" for k in ("src", "dst")]
    m1, m2 = (_seg.create(n, N) for n in names)
    try:
        src = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(m1.addr))
        dst = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(m2.addr))
        src[:] = np.random.default_rng(1).integers(0, 256, N, dtype=np.uint8)
        cma, pid, rng = Cma(), os.getpid(), np.random.default_rng(2)
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  load {os.getloadavg()}  nproc {os.cpu_count()}")
        for nops, blk in SHAPES:
            nb = N // blk
            so = rng.choice(nb, nops, replace=False).astype(np.uint64) * np.uint64(blk)
            do = rng.choice(nb, nops, replace=False).astype(np.uint64) * np.uint64(blk)
            ln = np.full(nops, blk, np.uint64)
            la, ra = do + np.uint64(m2.addr), so + np.uint64(m1.addr)

            def loop() -> None:
                mm = ctypes.memmove
                for d, s, n in zip(la.tolist(), ra.tolist(), ln.tolist()):
                    mm(d, s, n)

            methods = {"loop": loop, "cma": lambda: cma.transfer(pid, iovecs(la, ln), iovecs(ra, ln), write=False),
                       "gather": lambda: copy_runs(la, ra, ln)}
            res: dict = {k: [] for k in methods}
            reps = max(5, min(2000, int(2e8 // (nops * blk))))
            for _ in range(3):
                for k, f in methods.items():
                    dst[:] = 0
                    t = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        f()
                        t.append(time.perf_counter() - t0)
                    res[k].append(float(np.median(t)) * 1e6)
                    for i in range(nops):
                        d, s = int(do[i]), int(so[i])
                        assert np.array_equal(dst[d:d + blk], src[s:s + blk]), (k, nops, blk, i)
            med = {k: float(np.median(v)) for k, v in res.items()}
            print(f"{nops:5d} x {blk:6d} B: " + "  ".join(f"{k} {v:9.1f} us" for k, v in med.items())
                  + f"   cma/loop {med['cma'] / med['loop']:.2f}  gather/loop {med['gather'] / med['loop']:.2f}",
                  flush=True)
        print(f"load after {os.getloadavg()}")
    finally:
        for m, n in zip((m1, m2), names):
            m.close()
            _seg.unlink(n)


if __name__ == "__main__":
    main()
