"""End-to-end latency of one 64 KiB block of one tensor: ``pull_blocks`` and ``push_blocks`` through the
public API between two engine processes (harness children), with the raw Python request/reply of the
same block (16-byte request, ``sendall`` of the block, ``recv_into``) measured in the same run as the
anchor, interleaved in rounds.  Prints p50 / p99 and the ratio to the anchor's p50; ``--json`` keeps
every figure.

    .venv/bin/python bench/probes/small_latency.py --transport tcp --n 2000 --kv-mib 64 [--option llmdd.tcp.spin_us=0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _small_latency_peers as S  # noqa: E402

PROMPT, DECODER = 1, 2


def _p(us: list, q: float) -> float:
    s = sorted(us)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of n/rounds calls each")
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine option for both engines (repeatable), e.g. llmdd.tcp.spin_us=0")
    a = ap.parse_args()
    from llmdd.testing._harness import Cluster

    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    nbytes = a.kv_mib << 20
    out: dict = {"load_before": os.getloadavg(), "transport": a.transport, "n": a.n, "options": a.option}
    with Cluster(env=env) as c:
        p, d = c.spawn("prompt", "decoder")
        extra = dict(kv.split("=", 1) for kv in a.option)
        port = p.call(S.setup, "PROMPT", PROMPT, a.transport, True, extra)
        d.call(S.setup, "DECODER", DECODER, a.transport, False, extra)
        p.call(S.register, PROMPT, nbytes, 1)
        d.call(S.register, DECODER, nbytes, 2)
        if d.call(S.link, PROMPT, port) != "LLM_SUCCESS":
            raise SystemExit("link failed")
        rr_port = p.call(S.rr_serve)
        per = max(1, a.n // a.rounds)
        res: dict = {"raw": [], "pull": [], "push": []}
        verified = True
        for r in range(a.rounds):
            res["raw"] += d.call(S.rr_client, rr_port, per, a.warmup if r == 0 else 10, 7 + r)
            for op in ("pull", "push"):
                got = d.call(S.timed, op, PROMPT, per, a.warmup if r == 0 else 10, 100 + r)
                res[op] += got["us"]
                s, t = got["last"]
                if op == "pull":
                    verified &= p.call(S.digest, s) == d.call(S.digest, t)
                else:
                    verified &= d.call(S.digest, s) == p.call(S.digest, t)
    out["load_after"] = os.getloadavg()
    raw = statistics.median(res["raw"])
    out["verified"] = verified
    for k, us in res.items():
        out[k] = {"p50": _p(us, 0.5), "p99": _p(us, 0.99), "n": len(us)}
        print(f"{a.transport} {k}: p50 {out[k]['p50']:.1f} us p99 {out[k]['p99']:.1f} us "
              f"[{out[k]['p50'] / raw:.2f}x raw req/reply]", flush=True)
    print(f"verified={verified} load {out['load_before']} -> {out['load_after']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
