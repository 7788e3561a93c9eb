"""Issue 39 (6): a local 100-token request's TTFT on the decode instance (connector loaded) and on
an instance without a connector, alternated, with and without a pause between the two requests of
a pair, plus every instance thread's CPU affinity and (``--py-spy``) a py-spy record of the
decode and the plain instance's processes over the no-pause phase (a probe; no verdict).

    nice -n 10 .venv-vllm/bin/python bench/probes/vllm_local_ttft.py --out DIR [--reps 8] [--gap-s 1.5] [--py-spy]

Same three instances and model as ``scripts/bench_vllm_ttft.py``; one warm-up transfer links the
decode instance to the prefill instance first.  Writes ``DIR/local-ttft.json`` and, with
``--py-spy``, ``DIR/pyspy-<instance>-<pid>.txt`` (py-spy's raw collapsed stacks, idle frames kept).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm_ttft import MAX_LEN, MODEL, _ttft, _wait_freed  # noqa: E402
from vllm_idle_cpu import _cmd, _group_pids  # noqa: E402

from llmdd_vllm.instance import Instance  # noqa: E402
from llmdd_vllm.tinymodel import write_tiny_llama  # noqa: E402


def _affinity(pids: list) -> dict:
    out = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
                cpus = sorted(os.sched_getaffinity(int(tid)))
            except OSError:
                continue
            out[f"{pid}/{tid}"] = [comm, cpus]
    return out


def _pairs(d: Instance, n: Instance, rng, reps: int, gap_s: float) -> list:
    rows = []
    for rep in range(reps):
        prompt = rng.integers(3, 500, 100).tolist()
        first, second = (n, d) if rep % 2 else (d, n)
        t_first = _ttft(first, prompt)["ttft_s"]
        time.sleep(gap_s)
        t_second = _ttft(second, prompt)["ttft_s"]
        time.sleep(gap_s)
        with_c, without = (t_second, t_first) if rep % 2 else (t_first, t_second)
        rows.append({"rep": rep, "connector_first": not rep % 2, "gap_s": gap_s,
                     "with_connector_ttft_s": with_c, "without_connector_ttft_s": without})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=1.5)
    ap.add_argument("--py-spy", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="llmdd-vllm-local-")
    model = write_tiny_llama(os.path.join(root, "model"), seed=11, **MODEL)
    common = dict(max_model_len=MAX_LEN, kv_space_gib="2", start_timeout_s=900, wait=False)
    insts = {"p": Instance(model, role="kv_producer", log_path=os.path.join(root, "p.log"), **common),
             "d": Instance(model, role="kv_consumer", log_path=os.path.join(root, "d.log"), **common),
             "n": Instance(model, log_path=os.path.join(root, "n.log"), **common)}
    out: dict = {"command": " ".join(["python"] + sys.argv), "loadavg_start": os.getloadavg()}
    spies: list = []
    try:
        for inst in insts.values():
            inst.wait_ready()
        p, d, n = insts["p"], insts["d"], insts["n"]
        pids = {k: _group_pids(i.proc.pid) for k, i in insts.items()}
        out["processes"] = {k: {str(pid): _cmd(pid) for pid in v} for k, v in pids.items()}
        out["affinity"] = {k: _affinity(v) for k, v in pids.items()}
        rng = np.random.default_rng(20)
        w = rng.integers(3, 500, 100).tolist()
        kv = _ttft(p, w, {"do_remote_decode": True})["kv_transfer_params"]
        _ttft(d, w, kv)
        _ttft(n, w)
        _wait_freed(p)
        time.sleep(args.gap_s)
        spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) if args.py_spy else None
        if spy:
            for k in ("d", "n"):
                for pid in pids[k]:
                    if "resource_tracker" in out["processes"][k][str(pid)]:
                        continue
                    path = os.path.join(args.out, f"pyspy-{k}-{pid}.txt")
                    spies.append(subprocess.Popen([spy, "record", "--pid", str(pid), "--idle", "--threads",
                                                   "--rate", "200", "--format", "raw", "--output", path,
                                                   "--nonblocking"], stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
            time.sleep(3)
        out["no_gap"] = _pairs(d, n, rng, args.reps, 0.0)
        for s in spies:
            s.send_signal(2)
        for s in spies:
            s.wait(60)
        spies = []
        out["gap"] = _pairs(d, n, rng, args.reps, args.gap_s)
    finally:
        for s in spies:
            s.kill()
        for inst in insts.values():
            inst.close()
    out["loadavg_end"] = os.getloadavg()
    with open(os.path.join(args.out, "local-ttft.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
