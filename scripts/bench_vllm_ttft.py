"""Issue 20 (5): decode-side time to first token with the KV transfer vs. recomputing the prompt.

Run in the vLLM venv (scripts/test_vllm.sh builds it)::

    nice -n 10 .venv-vllm/bin/python scripts/bench_vllm_ttft.py --out bench/results-committed/issue20/ttft-<UTC>.json

Three real vLLM instances, each in processes of its own (``llmdd_vllm.instance``): a prefill
instance (``kv_producer``), a decode instance (``kv_consumer``) and one without a connector, on a
Llama of seeded random float32 weights (``llmdd_vllm.tinymodel``: 8 layers, hidden 1024, 16 heads,
8 KV heads, head 64, intermediate 2816; block 32, max_model_len 4160). Per prompt length and
repetition (interleaved), each a fresh random prompt (no prefix caching):

* ``transfer``: the prefill instance runs the prompt (max_tokens=1, do_remote_decode), then the
  decode instance runs it with the returned kv_transfer_params (max_tokens=1): its time to first
  token (vLLM's step loop, from ``add_request`` to the first token) and the connector's own pull
  time for it (``pull_seconds`` counter delta: link + ``pull_blocks_async`` until done);
* ``recompute``: the decode instance runs the same prompt without params (it computes it);
* ``overhead``: a short prompt computed locally on the decode instance (connector loaded) and on
  the instance without a connector: the connector's cost on a request that does not use it.

Each transfer row also carries the connector's breakdown of that pull (``pull_log``: the scheduler
made the job, the worker's step hook queued it, the pull thread planned, checked the link,
submitted, llmdd called back, vLLM collected it; ``llmdd_vllm.worker.PHASES``).  With
``--engine-bench`` the script runs ``llmdd bench --quick --transport shm`` before the instances
start and after they stop (same session), and records its ``pull_blocks`` GB/s (64 KiB and 16 KiB
blocks, 64 tensors, 128 MiB, two processes): the engine's own bandwidth to set the pull against.

Before every timed request the prefill instance has freed all held blocks (``pending_sends`` 0), so
no instance spins on held blocks while another is timed. Writes one JSON file: the command, the
machine, the model, and every raw figure; ``scripts/vllm_ttft_table.py`` prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from llmdd_vllm.instance import Instance
from llmdd_vllm.tinymodel import write_tiny_llama

MODEL = dict(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816, vocab=512, max_positions=8192)
MAX_LEN = 4160


def _counters(inst: Instance) -> dict:
    (c,) = inst.call(op="counters")["workers"]
    return c


def _wait_freed(p: Instance, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _counters(p)["pending_sends"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the prefill instance still holds blocks")
        time.sleep(0.05)


def _ttft(inst: Instance, prompt: list, params=None) -> dict:
    out = inst.call(op="generate", prompts=[prompt], max_tokens=1, params=[params], timeout_s=600, timeout=660)
    r = out["results"][0]
    return {"ttft_s": r["first_token_s"], "wall_s": out["wall_s"], "tokens": r["tokens"],
            "kv_transfer_params": r["kv_transfer_params"]}


def engine_bench() -> dict:
    """``llmdd bench --quick --transport shm``'s pull_blocks medians (GB/s) on this machine, now."""
    out_dir = tempfile.mkdtemp(prefix="llmdd-bench-")
    r = subprocess.run([sys.executable, "-m", "llmdd", "bench", "--quick", "--transport", "shm", "--no-anchors",
                        "--quiet", "--json", "--out", out_dir], capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise RuntimeError(f"llmdd bench failed ({r.returncode}): {r.stderr[-2000:]}")
    shm = json.loads(r.stdout)["transports"]["shm"]
    return {"command": "python -m llmdd bench --quick --transport shm --no-anchors --json",
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": os.getloadavg(),
            **{k: {"median_gbps": shm[k]["median"], "min_gbps": shm[k]["min"], "max_gbps": shm[k]["max"]}
               for k in ("pull_blocks_64k", "pull_blocks_16k") if k in shm}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--overhead-len", type=int, default=100)
    ap.add_argument("--overhead-reps", type=int, default=5)
    ap.add_argument("--overhead-alternate", action="store_true",
                    help="alternate which instance runs the overhead prompt first (default: the decode instance)")
    ap.add_argument("--transport", default=None, help="force shm or tcp (default: llmdd's choice)")
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--kv-space-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE of each instance")
    ap.add_argument("--two-at-a-time", action="store_true",
                    help="at most two instances at once (memory): the prefill and decode instances for the transfers, "
                         "then the prefill instance stops and the one without a connector starts for the overhead")
    ap.add_argument("--engine-bench", action="store_true",
                    help="run llmdd bench --quick --transport shm before and after (the engine's own pull GB/s)")
    args = ap.parse_args()
    engine: dict = {"before": engine_bench()} if args.engine_bench else {}
    lengths = [int(x) for x in args.lengths.split(",")]
    extra = {"transport": args.transport} if args.transport else {}
    root = tempfile.mkdtemp(prefix="llmdd-vllm-ttft-")
    model = write_tiny_llama(os.path.join(root, "model"), seed=11, **MODEL)
    common = dict(max_model_len=MAX_LEN, kv_space_gib=args.kv_space_gib, nice=args.nice, start_timeout_s=900,
                  wait=False)
    insts = {"p": Instance(model, role="kv_producer", extra=extra, log_path=os.path.join(root, "p.log"), **common),
             "d": Instance(model, role="kv_consumer", extra=extra, log_path=os.path.join(root, "d.log"), **common)}

    def plain() -> Instance:
        return Instance(model, log_path=os.path.join(root, "n.log"), **common)
    if not args.two_at_a_time:
        insts["n"] = plain()
    load0 = os.getloadavg()
    rows: list = []
    overhead: list = []
    error = None
    transports: dict = {}
    hooks: dict = {}
    try:
        for inst in insts.values():
            inst.wait_ready()
        p, d = insts["p"], insts["d"]
        rng = np.random.default_rng(20)
        # warm-up: one small transfer (links the two instances) and one local request per instance
        w = rng.integers(3, 500, 100).tolist()
        kv = _ttft(p, w, {"do_remote_decode": True})["kv_transfer_params"]
        _ttft(d, w, kv)
        if "n" in insts:
            _ttft(insts["n"], w)
        _wait_freed(p)
        for rep in range(args.reps):
            for length in lengths:
                prompt = rng.integers(3, 500, length).tolist()
                pre = _ttft(p, prompt, {"do_remote_decode": True})
                c0 = _counters(d)
                tr = _ttft(d, prompt, pre["kv_transfer_params"])
                c1 = _counters(d)
                _wait_freed(p)
                rc = _ttft(d, prompt)
                assert c1["requests_pulled"] - c0["requests_pulled"] == 1 and c1["pull_failures"] == c0["pull_failures"]
                (pull,) = [e for e in c1.get("pull_log", []) if e not in c0.get("pull_log", [])]
                rows.append({"rep": rep, "prompt_tokens": length, "prefill_instance_ttft_s": pre["ttft_s"],
                             "transfer_ttft_s": tr["ttft_s"], "recompute_ttft_s": rc["ttft_s"],
                             "pull_s": c1["pull_seconds"] - c0["pull_seconds"],
                             "bytes_pulled": c1["bytes_pulled"] - c0["bytes_pulled"],
                             "same_first_token": tr["tokens"] == rc["tokens"], "pull_breakdown": pull})
                print(json.dumps(rows[-1]), flush=True)
        if args.overhead_reps and "n" not in insts:
            insts.pop("p").close()
            insts["n"] = plain()
            insts["n"].wait_ready()
            _ttft(insts["n"], w)
        n = insts.get("n")
        for rep in range(args.overhead_reps):
            prompt = rng.integers(3, 500, args.overhead_len).tolist()
            if args.overhead_alternate and rep % 2:
                b, a = _ttft(n, prompt), _ttft(d, prompt)
            else:
                a, b = _ttft(d, prompt), _ttft(n, prompt)
            overhead.append({"rep": rep, "prompt_tokens": args.overhead_len, "with_connector_ttft_s": a["ttft_s"],
                             "without_connector_ttft_s": b["ttft_s"]})
            print(json.dumps(overhead[-1]), flush=True)
        last = _counters(d)
        transports = last["transports"]
        # the worker-side step hooks' cost over the whole run (every step of the decode instance)
        hooks = {k: last[k] for k in ("step_hook_calls", "step_hook_seconds", "max_step_hook_s") if k in last}
    except Exception as exc:  # noqa: BLE001 - an instance lost mid-run (OOM on a shared host): keep what was measured
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for inst in insts.values():
            inst.close()
    if args.engine_bench:
        engine["after"] = engine_bench()
    out = {"command": " ".join(["python"] + sys.argv), "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
           "loadavg_start": load0, "loadavg_end": os.getloadavg()},
           "model": dict(MODEL, dtype="float32", block_size=32, max_model_len=MAX_LEN),
           "transports": transports, "rows": rows, "overhead": overhead, "engine_bench": engine, "step_hooks": hooks, "error": error,
           "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
