"""The raw tcp request/reply anchor with the machine's other CPU idle, and with it kept busy.

Two ``llmdd bench`` workers (no engine) time ``--n`` raw request/replies of one 64 KiB block each
(the ``tcp_rr_64k`` anchor's own commands: a 16-byte request, the block back), in ``--rounds``
interleaved rounds of two conditions:

- ``idle``: nothing else runs;
- ``busy``: one ``nice 19`` process spins in a loop for the round (it takes no CPU from the two
  workers that they want; it only keeps a CPU from going idle).

On a virtual machine a wake-up of an idle CPU costs far more than one of a busy CPU (the halted
virtual CPU must be scheduled again by the host), and a blocking request/reply pays two wake-ups
per call.  The anchor's figure therefore depends on what else the machine runs at the moment it is
measured; ``llmdd bench`` also measures it interleaved with the engine's own calls
(``latency_64k.paired``), which is the comparison the ``21.1-tcp-paired`` target makes.

    .venv/bin/python bench/probes/rr_idle_wakeup.py --rounds 4 --n 1000 --out results.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time

from llmdd._tools.bench.runner import close_all, start_peers

BB = 64 * 1024


def _spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    src, dst = start_peers(ctx, ["rr-src", "rr-dst"], 120.0)
    size = 128 << 20
    rows: list = []
    try:
        src.call("alloc", nbytes=size)
        src.call("fill", salt=3)
        dst.call("alloc", nbytes=size)
        for r in range(a.rounds):
            for cond in ("idle", "busy"):
                spin = _spinner() if cond == "busy" else None
                try:
                    port = src.call("listen")
                    src.send("rr_serve", n=a.n + 100)
                    got = dst.call("rr_client", port=port, block_bytes=BB, num_blocks=size // BB, n=a.n, warmup=100)
                    src.recv()
                finally:
                    if spin is not None:
                        spin.kill()
                        spin.wait()
                got.pop("hist", None)
                rows.append({"round": r, "condition": cond, **got})
                print(f"round {r} {cond:4s}: p50 {got['p50']:.1f} us, p90 {got['p90']:.1f} us", flush=True)
    finally:
        close_all([src, dst])
    summary = {c: statistics.median(x["p50"] for x in rows if x["condition"] == c) for c in ("idle", "busy")}
    print(f"median of the rounds' p50: idle {summary['idle']:.1f} us, busy {summary['busy']:.1f} us "
          f"({summary['idle'] / summary['busy']:.2f}x)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "load": os.getloadavg(), "cpus": os.cpu_count(), "machine": platform.platform(),
                       "rows": rows, "median_p50_us": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
