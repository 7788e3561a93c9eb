"""Issue 39 (6): where the CPU of a vLLM instance with the connector loaded goes while it serves
only local requests, against an instance without a connector (a probe; no verdict).

Run in the vLLM venv (scripts/test_vllm.sh builds it)::

    nice -n 10 .venv-vllm/bin/python bench/probes/vllm_idle_cpu.py --out bench/results-committed/issue39/idle-cpu-<UTC>.json [--py-spy]

The three instances of ``scripts/bench_vllm_ttft.py`` (prefill ``kv_producer``, decode
``kv_consumer``, one without a connector; same model), one warm-up transfer (links decode to
prefill) and one local request each, then, per instance process and thread (``/proc/<pid>/task``),
the CPU seconds used in an idle window of ``--idle-s`` seconds and over ``--reps`` local 100-token
requests alternated between the decode instance and the instance without a connector (their
TTFTs recorded too).  With ``--py-spy`` (py-spy installed in the venv) a ``py-spy dump`` of every
instance process is taken in the idle window: which Python frame each busy thread is in.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from bench_vllm_ttft import MAX_LEN, MODEL, _ttft, _wait_freed  # noqa: E402

from llmdd_vllm.instance import Instance  # noqa: E402
from llmdd_vllm.tinymodel import write_tiny_llama  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _group_pids(pgid: int) -> list:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:       # field 5 (pgrp), after pid and comm
            out.append(int(name))
    return sorted(out)


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _threads(pids: list) -> dict:
    """(pid, tid) -> [comm, cpu seconds (user+system)]"""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    raw = f.read()
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            fields = raw.rsplit(")", 1)[1].split()
            out[f"{pid}/{tid}"] = [comm, (int(fields[11]) + int(fields[12])) / TICK]
    return out


def _delta(a: dict, b: dict, seconds: float) -> list:
    rows = []
    for k, (comm, cpu) in b.items():
        d = cpu - a.get(k, [comm, 0.0])[1]
        if d > 0:
            rows.append({"thread": k, "comm": comm, "cpu_s": round(d, 3), "cpu_share": round(d / seconds, 3)})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--py-spy", action="store_true")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="llmdd-vllm-idle-")
    model = write_tiny_llama(os.path.join(root, "model"), seed=11, **MODEL)
    common = dict(max_model_len=MAX_LEN, kv_space_gib="2", start_timeout_s=900, wait=False)
    insts = {"p": Instance(model, role="kv_producer", log_path=os.path.join(root, "p.log"), **common),
             "d": Instance(model, role="kv_consumer", log_path=os.path.join(root, "d.log"), **common),
             "n": Instance(model, log_path=os.path.join(root, "n.log"), **common)}
    out: dict = {"command": " ".join(["python"] + sys.argv), "loadavg_start": os.getloadavg()}
    try:
        for inst in insts.values():
            inst.wait_ready()
        p, d, n = insts["p"], insts["d"], insts["n"]
        pids = {k: _group_pids(i.proc.pid) for k, i in insts.items()}
        out["processes"] = {k: {str(pid): _cmd(pid) for pid in v} for k, v in pids.items()}
        rng = np.random.default_rng(20)
        w = rng.integers(3, 500, 100).tolist()
        kv = _ttft(p, w, {"do_remote_decode": True})["kv_transfer_params"]
        _ttft(d, w, kv)
        _ttft(n, w)
        _wait_freed(p)
        allp = sum(pids.values(), [])
        a, t0 = _threads(allp), time.monotonic()
        if args.py_spy and shutil.which("py-spy", path=os.path.dirname(sys.executable)):
            spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
            dumps = {}
            for k, v in pids.items():
                for pid in v:
                    r = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
                    dumps[f"{k}:{pid}"] = r.stdout + r.stderr
            out["py_spy_idle"] = dumps
        time.sleep(max(0.0, args.idle_s - (time.monotonic() - t0)))
        b, t1 = _threads(allp), time.monotonic()
        out["idle"] = {"seconds": round(t1 - t0, 2), "threads": _delta(a, b, t1 - t0)}
        ttft = []
        for rep in range(args.reps):
            prompt = rng.integers(3, 500, 100).tolist()
            if rep % 2:
                y, x = _ttft(n, prompt), _ttft(d, prompt)
            else:
                x, y = _ttft(d, prompt), _ttft(n, prompt)
            ttft.append({"with_connector_ttft_s": x["ttft_s"], "without_connector_ttft_s": y["ttft_s"]})
            print(json.dumps(ttft[-1]), flush=True)
        c, t2 = _threads(allp), time.monotonic()
        out["requests"] = {"seconds": round(t2 - t1, 2), "threads": _delta(b, c, t2 - t1), "ttft": ttft}
    finally:
        for inst in insts.values():
            inst.close()
    out["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for phase in ("idle", "requests"):
        print(phase, out[phase]["seconds"], "s")
        for r in out[phase]["threads"][:15]:
            who = next(k for k, v in pids.items() if int(r["thread"].split("/")[0]) in v)
            print(f"  {who} {r['thread']:>14} {r['comm']:<16} {r['cpu_s']:7.2f} s  {r['cpu_share']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
