"""The latency path (one 64 KiB block per call), measured in one run with its anchors.

One 64 KiB block of one tensor (``pull_blocks``, p50 / p99 over ``--n`` calls) per transport, the raw
Python TCP request/reply and single-block ``process_vm_readv`` anchors, and optionally (``--bulk``)
``pull_blocks`` of 64 tensors x N blocks x 64 KiB over tcp against a raw two-stream Python socket.
With ``--push``, also one 64 KiB block of one tensor per ``push_blocks`` call (p50 / p99 over ``--n``
calls, the same random block draws for every transport, the last push checked on the prompt's side).
Uses the workers of ``llmdd bench`` (:mod:`llmdd._tools.bench`), so the figures are measured the same way.

    .venv/bin/python bench/probes/latency_path.py --transport shm --transport tcp [--push] [--bulk] [--profile]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys

from llmdd._tools.bench.common import KiB, MiB, load_average
from llmdd._tools.bench.runner import DECODER, NUM_TENSORS, PROMPT, SALT_ANCHOR, SALT_DECODER, SALT_PROMPT, \
    block_tables, close_all, start_peers

BB = 64 * KiB


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", action="append", default=None)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--kv-mib", type=int, default=256, help="bytes per side of the 64 KiB layout (MiB)")
    ap.add_argument("--bulk", action="store_true", help="also pull_blocks of the whole layout over tcp + anchors")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--push", action="store_true", help="also push_blocks of one 64 KiB block per call")
    ap.add_argument("--profile", action="store_true", help="print the cProfile of the one-block pulls")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    transports = a.transport or ["shm", "tcp"]
    kv = a.kv_mib * MiB
    nb = kv // NUM_TENSORS // BB
    spawn = mp.get_context("spawn")
    out: dict = {"load_before": load_average(), "anchors": {}, "transports": {}}

    x, y = start_peers(spawn, ["anchor-src", "anchor-dst"], 300)
    try:
        info = x.call("alloc", nbytes=kv)
        x.call("fill", salt=SALT_ANCHOR)
        y.call("alloc", nbytes=kv)
        out["anchors"]["cma_latency_64k"] = y.call("cma_latency", pid=info["pid"], raddr=info["addr"],
                                                   num_blocks=kv // BB, block_bytes=BB, n=a.n, warmup=a.warmup)
        port = x.call("listen")
        x.send("rr_serve", n=a.n + a.warmup)
        out["anchors"]["tcp_rr_64k"] = y.call("rr_client", port=port, block_bytes=BB, num_blocks=kv // BB, n=a.n,
                                              warmup=a.warmup)
        x.recv()
        if a.bulk:
            port = y.call("listen")
            y.send("stream_recv", streams=2, nbytes=kv, rounds=a.runs + 1, salt=SALT_ANCHOR)
            r = x.call("stream_send", port=port, streams=2, nbytes=kv, runs=a.runs, warmup=1)
            r.update(y.recv())
            out["anchors"]["tcp_2stream"] = r
    finally:
        close_all([x, y])
    print(f"anchors: cma p50 {out['anchors']['cma_latency_64k']['p50']:.1f} us, tcp req/reply p50 "
          f"{out['anchors']['tcp_rr_64k']['p50']:.1f} us"
          + (f", tcp 2 streams {out['anchors']['tcp_2stream']['median']:.2f} GB/s" if a.bulk else ""), flush=True)

    for t in transports:
        res: dict = {}
        out["transports"][t] = res
        prompt, dec = start_peers(spawn, [f"{t}-prompt", f"{t}-decoder"], 300)
        try:
            pinfo = prompt.call("init", role="PROMPT", cluster_id=PROMPT, transport=t, listen=True)
            dec.call("init", role="DECODER", cluster_id=DECODER, transport=t)
            for p in (prompt, dec):
                p.call("alloc", nbytes=kv)
                p.call("register_blocks", model_id=10, num_tensors=NUM_TENSORS, num_blocks=nb, block_bytes=BB)
            prompt.call("fill", salt=SALT_PROMPT)
            link = dec.call("link", remote=PROMPT, port=pinfo["port"])
            if link["status"] != "LLM_SUCCESS":
                raise RuntimeError(f"{t}: link failed: {link}")
            r = dec.call("latency_pull", remote=PROMPT, model_id=10, remote_model_id=10, num_blocks=nb, n=a.n,
                         warmup=a.warmup, profile=a.profile)
            last = r.pop("last")
            r.update(dec.call("check_blocks", num_tensors=1, tensor_bytes=nb * BB, block_bytes=BB,
                              dst_blocks=[last["dst"]], src_blocks=[last["src"]], salt=SALT_PROMPT))
            prof = r.pop("profile", None)
            res["latency_64k"] = r
            rr = out["anchors"]["tcp_rr_64k"]["p50"]
            print(f"{t}: one 64 KiB block p50 {r['p50']:.1f} us p99 {r['p99']:.1f} us "
                  f"[{r['p50'] / rr:.2f}x tcp req/reply] verified={r['verified']}", flush=True)
            if prof:
                print(prof)
            if a.push:
                dec.call("fill", salt=SALT_DECODER)
                r = dec.call("small_latency", op="push", remote=PROMPT, model_id=10, remote_model_id=10,
                             num_blocks=nb, blocks=1, tensors=1, n=a.n, warmup=a.warmup)
                last = r.pop("last")
                r.update(prompt.call("check_blocks", num_tensors=1, tensor_bytes=nb * BB, block_bytes=BB,
                                     dst_blocks=last["dst"], src_blocks=last["src"], salt=SALT_DECODER))
                res["push_latency_64k"] = r
                print(f"{t}: push one 64 KiB block p50 {r['p50']:.1f} us p99 {r['p99']:.1f} us "
                      f"verified={r['verified']}", flush=True)
            if a.bulk and t in ("tcp",):
                src, dst = block_tables(nb, 0)
                dec.call("zero")
                r = dec.call("blocks_timed", op="pull", remote=PROMPT, model_id=10, remote_model_id=10, src=src,
                             dst=dst, nbytes=kv, runs=a.runs, warmup=1)
                r.update(dec.call("check_blocks", num_tensors=NUM_TENSORS, tensor_bytes=nb * BB, block_bytes=BB,
                                  dst_blocks=dst, src_blocks=src, salt=SALT_PROMPT))
                res["pull_blocks_64k"] = r
                anchor = out["anchors"]["tcp_2stream"]["median"]
                print(f"{t}: pull_blocks {NUM_TENSORS}x{nb}x64KiB {r['median']:.2f} GB/s "
                      f"[{r['median'] / anchor:.2f}x tcp 2 streams] verified={r['verified']}", flush=True)
                if a.profile:
                    print(dec.call("blocks_profile", op="pull", remote=PROMPT, model_id=10, remote_model_id=10,
                                   src=src, dst=dst, runs=3))
        finally:
            close_all([dec, prompt])
    out["load_after"] = load_average()
    print(f"load {out['load_before']} -> {out['load_after']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
