"""Issue 39 (8): LlmddConnector side by side with vLLM's NixlConnector, in one run, same model and prompts.

Run in the vLLM venv (scripts/test_vllm.sh builds it) with NIXL added::

    .venv-vllm/bin/python -m pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    nice -n 10 .venv-vllm/bin/python scripts/bench_vllm_vs_nixl.py --out bench/results-committed/issue39/nixl/run-<UTC>.json

Five real vLLM instances (``llmdd_vllm.instance``) on the model of
``scripts/bench_vllm_ttft.py`` (seeded random float32 Llama, 8 layers, hidden 1024): a prefill
(``kv_producer``) and a decode (``kv_consumer``) instance per connector, LlmddConnector (llmdd's
choice of transport) and NixlConnector (NIXL's UCX backend, ``kv_buffer_device="cpu"``), all four up
at once, and for the last measurement one instance without a connector, started once the two prefill
instances are closed (memory). Three measurements, in this order, each alternating the two connectors (the one
that goes first swaps every repetition), so every ratio comes from one run:

* ``ttft``: per prompt length and repetition, a fresh random prompt: the connector's prefill
  instance runs it (max_tokens=1, do_remote_decode), then its decode instance with the returned
  kv_transfer_params (max_tokens=1); the decode instance's time to first token (vLLM's step loop,
  ``add_request`` to the first token), as in bench_vllm_ttft.py. Both connectors get the same prompt;
  their first tokens are compared;
* ``mixed``: 32 requests at once through a P/D proxy: seeded prompt lengths and output lengths
  (``--mixed-lengths``, ``--mixed-out``), all 32 sent to the prefill instance in one batch, then
  (the proxy forwarding each one's kv_transfer_params) all 32 to the decode instance in one batch;
  output tokens per second over the whole (prefill + decode wall time) and over the decode phase;
* ``local``: a short prompt computed locally on each decode instance (connector loaded) and on the
  instance without a connector, the order rotated every repetition.

Before every timed llmdd request its prefill instance has freed all held blocks (as in
bench_vllm_ttft.py); NixlConnector's prefill instance frees a request's blocks at its next engine
step after the decode side's notification (the instance is idle between commands, so nothing spins).
Writes one JSON file (command, machine, load averages per phase, model, every raw figure);
``scripts/vllm_ttft_table.py --nixl`` writes the table with its verdicts into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm_ttft import MAX_LEN, MODEL, _counters, _ttft, _wait_freed  # noqa: E402

from llmdd_vllm.instance import Instance  # noqa: E402
from llmdd_vllm.tinymodel import write_tiny_llama  # noqa: E402

CONNECTORS = ("llmdd", "nixl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> list:
    return list(os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--mixed-reps", type=int, default=2)
    ap.add_argument("--mixed-n", type=int, default=32)
    ap.add_argument("--mixed-lengths", default="128,1024", help="prompt lengths drawn uniformly from MIN,MAX")
    ap.add_argument("--mixed-out", default="16,64", help="output lengths drawn uniformly from MIN,MAX")
    ap.add_argument("--local-reps", type=int, default=16)
    ap.add_argument("--local-len", type=int, default=100)
    ap.add_argument("--kv-space-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE of each instance (whole GiB)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per instance (num_gpu_blocks_override; 32 tokens, 1 MiB each): less memory than "
                         "--kv-space-gib's whole GiB; at least one 4096-token prompt (128) and the mixed load")
    ap.add_argument("--first", choices=CONNECTORS, default="llmdd", help="the connector that goes first in repetition 0")
    ap.add_argument("--nice", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    first = (args.first,) + tuple(c for c in CONNECTORS if c != args.first)
    mlo, mhi = (int(x) for x in args.mixed_lengths.split(","))
    olo, ohi = (int(x) for x in args.mixed_out.split(","))
    root = tempfile.mkdtemp(prefix="llmdd-vllm-nixl-")
    model = write_tiny_llama(os.path.join(root, "model"), seed=11, **MODEL)
    common = dict(max_model_len=MAX_LEN, kv_space_gib=args.kv_space_gib, nice=args.nice, start_timeout_s=1200,
                  wait=False, num_blocks=args.num_blocks)
    nixl = dict(connector="NixlConnector", kv_buffer_device="cpu", extra={"backends": ["UCX"]})
    ports = {k: str(_free_port()) for k in ("xp", "xd")}
    insts = {"lp": Instance(model, role="kv_producer", log_path=os.path.join(root, "lp.log"), **common),
             "ld": Instance(model, role="kv_consumer", log_path=os.path.join(root, "ld.log"), **common),
             "xp": Instance(model, role="kv_producer", log_path=os.path.join(root, "xp.log"),
                            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": ports["xp"]}, **nixl, **common),
             "xd": Instance(model, role="kv_consumer", log_path=os.path.join(root, "xd.log"),
                            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": ports["xd"]}, **nixl, **common),
             }
    pd = {"llmdd": (insts["lp"], insts["ld"]), "nixl": (insts["xp"], insts["xd"])}
    out: dict = {"command": " ".join(["python"] + sys.argv), "logs": root,
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_start": _load()},
                 "model": dict(MODEL, dtype="float32", block_size=32, max_model_len=MAX_LEN),
                 "connectors": {"llmdd": "LlmddConnector (llmdd_vllm)",
                                "nixl": "NixlConnector (vLLM 0.32, NIXL 1.5.1, UCX backend, kv_buffer_device=cpu)"},
                 "rows": [], "mixed": [], "local": [], "phases": {}}
    try:
        t0 = time.monotonic()
        for inst in insts.values():
            inst.wait_ready()
        out["start_s"] = time.monotonic() - t0
        print(f"instances ready in {out['start_s']:.0f} s", flush=True)
        rng = np.random.default_rng(39)

        def transfer(name: str, prompt: list, max_tokens: int = 1) -> dict:
            p, d = pd[name]
            pre = _ttft(p, prompt, {"do_remote_decode": True})
            c0 = _counters(d) if name == "llmdd" else None
            tr = _ttft(d, prompt, pre["kv_transfer_params"])
            r = {"ttft_s": tr["ttft_s"], "prefill_ttft_s": pre["ttft_s"], "tokens": tr["tokens"]}
            if c0 is not None:
                c1 = _counters(d)
                if c1["requests_pulled"] - c0["requests_pulled"] != 1 or c1["pull_failures"] != c0["pull_failures"]:
                    raise RuntimeError(f"llmdd did not pull the request: {c0} -> {c1}")
                r["pull_s"] = c1["pull_seconds"] - c0["pull_seconds"]
                _wait_freed(p)
            return r

        # warm-up: one transfer per connector (links / NIXL handshake), one local request per instance
        w = rng.integers(3, 500, 100).tolist()
        for name in CONNECTORS:
            transfer(name, w)
        for inst in (insts["ld"], insts["xd"]):
            _ttft(inst, w)
        if _ttft(insts["xd"], w)["tokens"] != _ttft(insts["ld"], w)["tokens"]:
            raise RuntimeError("the two decode instances disagree on a local first token")

        def phase_local() -> None:
            trio = [("llmdd", insts["ld"]), ("nixl", insts["xd"]), ("none", insts["n"])]
            for rep in range(args.local_reps):
                prompt = rng.integers(3, 500, args.local_len).tolist()
                order = trio[rep % 3:] + trio[:rep % 3]
                row: dict = {"rep": rep, "prompt_tokens": args.local_len, "order": [k for k, _ in order]}
                for k, inst in order:
                    row[k + "_ttft_s"] = _ttft(inst, prompt)["ttft_s"]
                row["loadavg"] = _load()
                out["local"].append(row)
                print(json.dumps(row), flush=True)

        def phase_ttft() -> None:
            for rep in range(args.reps):
                order = first if rep % 2 == 0 else first[::-1]
                for length in lengths:
                    prompt = rng.integers(3, 500, length).tolist()
                    row: dict = {"rep": rep, "prompt_tokens": length, "order": list(order)}
                    res = {name: transfer(name, prompt) for name in order}
                    for name in CONNECTORS:
                        row[name + "_ttft_s"] = res[name]["ttft_s"]
                        row[name + "_prefill_ttft_s"] = res[name]["prefill_ttft_s"]
                    row["llmdd_pull_s"] = res["llmdd"]["pull_s"]
                    row["same_first_token"] = res["llmdd"]["tokens"] == res["nixl"]["tokens"]
                    row["loadavg"] = _load()
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    _save(args.out, out)

        def phase_mixed() -> None:
            mrng = np.random.default_rng(3939)
            for rep in range(args.mixed_reps):
                lens = mrng.integers(mlo, mhi + 1, args.mixed_n)
                outs = mrng.integers(olo, ohi + 1, args.mixed_n).tolist()
                prompts = [mrng.integers(3, 500, int(n)).tolist() for n in lens]
                order = first if rep % 2 == 0 else first[::-1]
                row: dict = {"rep": rep, "requests": args.mixed_n, "prompt_tokens": int(lens.sum()),
                             "output_tokens": int(sum(outs)), "order": list(order)}
                toks = {}
                for name in order:
                    p, d = pd[name]
                    pre = p.call(op="generate", prompts=prompts, max_tokens=1,
                                 params=[{"do_remote_decode": True}] * len(prompts), timeout_s=1200, timeout=1260)
                    params = [r["kv_transfer_params"] for r in pre["results"]]
                    dec = d.call(op="generate", prompts=prompts, max_tokens=outs, params=params,
                                 timeout_s=1200, timeout=1260)
                    got = sum(len(r["tokens"]) for r in dec["results"])
                    if got != sum(outs):
                        raise RuntimeError(f"{name}: {got} output tokens, {sum(outs)} asked for")
                    toks[name] = [r["tokens"] for r in dec["results"]]
                    row[name] = {"loadavg_end": _load(), "prefill_wall_s": pre["wall_s"], "decode_wall_s": dec["wall_s"],
                                 "decode_ttft_s": [r["first_token_s"] for r in dec["results"]],
                                 "tokens_per_s": got / (pre["wall_s"] + dec["wall_s"]),
                                 "decode_tokens_per_s": got / dec["wall_s"]}
                    if name == "llmdd":
                        _wait_freed(p)
                row["same_tokens"] = sum(a == b for a, b in zip(toks["llmdd"], toks["nixl"]))
                row["loadavg"] = _load()
                out["mixed"].append(row)
                _save(args.out, out)
                print(json.dumps({k: v for k, v in row.items() if k not in CONNECTORS}
                                 | {c: {k: v for k, v in row[c].items() if k != "decode_ttft_s"} for c in CONNECTORS}),
                      flush=True)

        out["transports"] = _counters(insts["ld"])["transports"]
        for ph, run, reps in (("ttft", phase_ttft, args.reps), ("mixed", phase_mixed, args.mixed_reps),
                              ("local", phase_local, args.local_reps)):
            if not reps:
                continue
            if ph == "local":
                # the prefill instances go before the instance without a connector starts (memory: five
                # instances of ~2.6 GB each do not fit beside the other work on this machine)
                for k in ("lp", "xp"):
                    insts.pop(k).close()
                insts["n"] = Instance(model, log_path=os.path.join(root, "n.log"), **common)
                insts["n"].wait_ready()
                _ttft(insts["n"], w)
            l0, s0 = _load(), time.monotonic()
            run()
            out["phases"][ph] = {"loadavg_start": l0, "loadavg_end": _load(), "wall_s": time.monotonic() - s0}
            _save(args.out, out)      # each phase's figures are kept even if a later one fails
    finally:
        for inst in insts.values():
            inst.close()
    out["machine"]["loadavg_end"] = _load()
    out["utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _save(args.out, out)
    return 0


def _save(path: str, out: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
