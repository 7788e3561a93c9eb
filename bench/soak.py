#!/usr/bin/env python3
"""Soak (reliability.md 3.5 L4, shortened): N decoders pull from one prompt under random faults.

One prompt process registers a blocks cache filled with a known pattern; N decoder processes
(each its own engine, with the ``llmdd-faults`` plugin and a low-rate random plan) link to it and
pull random block tables for ``--seconds``, verifying every byte of every successful pull and
that blocks a pull did not target keep their poison byte.  A failed pull is recovered the way a
framework would: force unlink, relink.  Every few hundred pulls a decoder also unlinks and
relinks on purpose (link churn).

Reported: transfers done, faults injected (per action), errors by status code, leaks (pool
accounting, fds, threads, RSS, /dev/shm segments named by llmdd) of every process between a
warm-up baseline and the end, and corruption found (must be zero: a successful pull with wrong
bytes, or a write outside the pulled blocks).  Exit status 1 when corruption or a leak is found.

Usage: python bench/soak.py [--seconds 120] [--decoders 4] [--transport tcp] [--seed 1]
                            [--rate 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from typing import Any, Optional

import numpy as np

HOST = "127.0.0.1"
PROMPT = 1
NT, NB, BS = 4, 64, 16 << 10           # 4 tensors x 64 blocks x 16 KiB = 4 MiB per cache
POISON = 0xA5
SYNC_MS = 1000
#: a low-rate fault plan (per read batch); scaled by --rate.  ``corrupt`` is left out on purpose:
#: tcp carries no integrity check, so a flipped byte would be a (known) false success, not a bug
PLAN = [
    {"op": "read", "action": "fail", "error": "PeerGone", "probability": 0.004},
    {"op": "read", "action": "fail", "error": "TransportTimeout", "probability": 0.002},
    {"op": "read", "action": "truncate", "nbytes": 4096, "probability": 0.002},
    {"op": "read", "action": "delay", "delay": 0.02, "probability": 0.01},
    {"op": "read", "action": "drop", "probability": 0.0005},
    {"op": "complete", "action": "fail", "error": "PeerGone", "probability": 0.002},
]


# --------------------------------------------------------------------------- child side
def _pattern(nbytes: int) -> np.ndarray:
    rng = np.random.default_rng([PROMPT, 1])
    return rng.integers(0, 255, size=(NT, nbytes), dtype=np.uint8)


def _options(listen: bool, transport: str) -> dict:
    from llmdd import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = SYNC_MS
    if listen:
        cfg.listen_ip_info = f"{HOST}:0"
    options = dict(cfg.generate_options())
    options.update({"llmdd.transport": transport, "llmdd.keepalive_interval_ms": "500",
                    "llmdd.peer_timeout_ms": "5000"})
    return options


def _register(state: dict, seed: bool, key: Optional[tuple]) -> None:
    from llmdd import BlocksCacheKey, CacheDesc, DataType, Placement

    nbytes = NB * BS
    if seed:
        data = _pattern(nbytes)
        arrays = [np.ascontiguousarray(data[i]) for i in range(NT)]
    else:
        arrays = [np.full(nbytes, POISON, np.uint8) for _ in range(NT)]
    desc = CacheDesc(NT, [NB, BS], DataType.DT_UINT8, Placement.DEVICE)
    cache = state["dd"].cache_manager.register_blocks_cache(desc, [a.ctypes.data for a in arrays],
                                                           None if key is None else BlocksCacheKey(*key))
    state["cache"], state["arrays"] = cache, arrays


def prompt_setup(state: dict, transport: str) -> int:
    import llmdd.plugin  # noqa: F401
    from llmdd import LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.PROMPT, PROMPT)
    dd.init(_options(True, transport))
    state["dd"] = dd
    _register(state, True, (PROMPT, 0))
    return dd.statistics()["listen"][1]


def decoder_setup(state: dict, cluster_id: int, transport: str, plan: dict) -> None:
    import llmdd.plugin  # noqa: F401
    from llmdd import LLMDataDist, LLMRole
    from llmdd_faults import FaultInjector, FaultPlan

    dd = LLMDataDist(LLMRole.DECODER, cluster_id)
    state["inj"] = FaultInjector(FaultPlan([]))
    dd.add_plugin(state["inj"])
    dd.init(_options(False, transport))
    state["dd"] = dd
    state["plan_json"] = json.dumps(plan)
    _register(state, False, None)


def _cluster(port: Optional[int]):
    from llmdd import LLMClusterInfo

    info = LLMClusterInfo()
    info.remote_cluster_id = PROMPT
    info.append_local_ip_info(HOST, 0)
    if port is not None:
        info.append_remote_ip_info(HOST, port)
    return info


def _link(state: dict, port: int) -> str:
    ret, rets = state["dd"].link_clusters([_cluster(port)], 5000)
    return rets[0].name if rets else ret.name


def _unlink(state: dict) -> None:
    state["dd"].unlink_clusters([_cluster(None)], 2000, force=True)


def measure(state: dict) -> dict:
    """Pool accounting, llmdd shm segments, fds, threads and RSS of this process."""
    from llmdd.testing import ResourceSnapshot

    snap = ResourceSnapshot.take()
    mem = state["dd"].statistics()["memory"]
    pools = {name: int(p.get("used_bytes", 0)) for name, p in mem.get("pools", {}).items()}
    return {"pools": pools, "caches": len(mem.get("caches", {})), "fds": len(snap.fds),
            "threads": len(snap.threads), "rss": snap.rss_bytes,
            "shm": sorted(n for n in snap.shm if n.startswith(f"llmdd_{os.getpid()}_")),
            "links": len(state["dd"].statistics()["links"])}


def warm_up(state: dict, port: int) -> dict:
    """Link, pull everything once, unlink: the baseline is taken after lazily created resources."""
    from llmdd import BlocksCacheKey

    assert _link(state, port) == "LLM_SUCCESS"
    state["dd"].cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), state["cache"], list(range(NB)),
                                          list(range(NB)))
    _unlink(state)
    time.sleep(0.2)
    return measure(state)


def soak_loop(state: dict, port: int, seconds: float, seed: int) -> dict:
    """Pull random block tables until ``seconds`` pass; verify; recover from failures."""
    from llmdd import BlocksCacheKey, LLMException
    from llmdd_faults import FaultPlan

    plan = FaultPlan.from_json(state["plan_json"])
    inj_plan = state["inj"].plan
    inj_plan.__init__(plan.faults, seed=plan.seed)        # arm after the warm-up (same object)
    rng = random.Random(seed)
    want = _pattern(NB * BS).reshape(NT, NB, BS)
    arrays = state["arrays"]
    views = [a.reshape(NB, BS) for a in arrays]
    out: dict[str, Any] = {"transfers": 0, "bytes": 0, "errors": collections.Counter(), "corruption": [],
                           "relinks": 0, "churn": 0, "link_errors": collections.Counter(), "latency_ms": []}
    key = BlocksCacheKey(PROMPT, 0)
    code = _link(state, port)
    if code != "LLM_SUCCESS":
        out["link_errors"][code] += 1
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        k = rng.randint(1, 16)
        src = [rng.randrange(NB) for _ in range(k)]
        dstb = rng.sample(range(NB), k)
        for v in views:
            v[:] = POISON
        t0 = time.monotonic()
        try:
            state["dd"].cache_manager.pull_blocks(key, state["cache"], src, dstb)
        except LLMException as exc:
            out["errors"][exc.status_code.name] += 1
            _unlink(state)                              # recover: force unlink, relink
            code = _link(state, port)
            out["relinks"] += 1
            if code != "LLM_SUCCESS":
                out["link_errors"][code] += 1
                time.sleep(0.05)
            continue
        out["latency_ms"].append((time.monotonic() - t0) * 1e3)
        out["transfers"] += 1
        out["bytes"] += k * BS * NT
        got = np.stack(views)
        for s, d in zip(src, dstb):
            if not np.array_equal(got[:, d], want[:, s]):
                out["corruption"].append(f"pull {n}: dst block {d} != src block {s}")
        untouched = sorted(set(range(NB)) - set(dstb))
        if untouched and not (got[:, untouched] == POISON).all():
            out["corruption"].append(f"pull {n}: bytes written outside the pulled blocks")
        if n % 300 == 0:                                 # link churn
            _unlink(state)
            code = _link(state, port)
            out["churn"] += 1
            if code != "LLM_SUCCESS":
                out["link_errors"][code] += 1
    fired = collections.Counter(f"{f.op}:{f.fault.action}" for f in state["inj"].fired)
    inj_plan.__init__([], seed=0)                        # quiet again for the final measurement
    _unlink(state)
    lat = sorted(out["latency_ms"])
    out["latency_ms"] = {"p50": lat[len(lat) // 2] if lat else None,
                         "p99": lat[int(len(lat) * 0.99)] if lat else None}
    out["faults"] = dict(fired)
    out["errors"] = dict(out["errors"])
    out["link_errors"] = dict(out["link_errors"])
    return out


def prompt_drop_links(state: dict) -> None:
    from llmdd import LLMClusterInfo

    for cid in list(state["dd"].statistics()["links"]):
        info = LLMClusterInfo()
        info.remote_cluster_id = cid
        state["dd"].unlink_clusters([info], 2000, force=True)


def wait_quiet(state: dict, seconds: float = 5.0) -> None:
    """Wait until no task of this engine is live (the prompt serves reads asynchronously)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        live = state["dd"].statistics()["lifecycles"]["task"].live
        if not any(live.get(k) for k in ("created", "waiting", "running")):
            return
        time.sleep(0.05)


def finalize(state: dict) -> None:
    state.pop("dd").finalize()


# --------------------------------------------------------------------------- parent side
def _leaks(before: dict, after: dict, *, fd_slack: int = 2, rss_slack: int = 32 << 20) -> list:
    out = []
    if after["pools"] != before["pools"]:
        out.append(f"pool bytes {before['pools']} -> {after['pools']}")
    if after["caches"] != before["caches"]:
        out.append(f"caches {before['caches']} -> {after['caches']}")
    if after["fds"] > before["fds"] + fd_slack:
        out.append(f"fds {before['fds']} -> {after['fds']}")
    if after["threads"] > before["threads"] + 1:
        out.append(f"threads {before['threads']} -> {after['threads']}")
    if after["rss"] > before["rss"] + rss_slack:
        out.append(f"RSS {before['rss'] >> 20} -> {after['rss'] >> 20} MiB")
    new_shm = sorted(set(after["shm"]) - set(before["shm"]))
    if new_shm:
        out.append(f"/dev/shm segments {new_shm}")
    if after["links"]:
        out.append(f"{after['links']} links left")
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rate", type=float, default=1.0, help="scale every fault probability")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)

    from llmdd.testing._harness import Cluster

    here = os.path.abspath(__file__)
    # the child functions travel by reference (module + file); under ``python bench/soak.py`` this
    # module is ``__main__``, so load it once more under a real name the children can import
    if __name__ == "__main__":
        import importlib.util

        spec = importlib.util.spec_from_file_location("llmdd_bench_soak", here)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["llmdd_bench_soak"] = mod
        spec.loader.exec_module(mod)
    else:
        mod = sys.modules[__name__]
    started = time.time()
    env = {"LLMDD_AUTH_SECRET": None, "LLMDD_FAULTS": None}
    with Cluster(env=env) as cluster:
        prompt, *decoders = cluster.spawn("soak_p", *[f"soak_d{i}" for i in range(args.decoders)],
                                          startup_timeout=120)
        port = prompt.call(mod.prompt_setup, args.transport)
        shm_before = sorted(n for n in os.listdir("/dev/shm") if n.startswith("llmdd_"))
        base = {}
        for i, d in enumerate(decoders):
            plan = {"seed": args.seed * 1000 + i,
                    "faults": [dict(f, probability=min(1.0, f["probability"] * args.rate), count=None)
                               for f in PLAN]}
            d.call(mod.decoder_setup, 100 + i, args.transport, plan)
            base[d.name] = d.call(mod.warm_up, port)
        prompt.call(mod.wait_quiet)
        prompt.call(mod.prompt_drop_links)
        base["prompt"] = prompt.call(mod.measure)
        futures = [d.call_async(mod.soak_loop, port, args.seconds, args.seed * 7919 + i) for i, d in enumerate(decoders)]
        results = [f.result(timeout=args.seconds + 120) for f in futures]
        prompt.call(mod.wait_quiet)
        prompt.call(mod.prompt_drop_links)
        time.sleep(0.5)
        after = {d.name: d.call(mod.measure) for d in decoders}
        after["prompt"] = prompt.call(mod.measure)
        alive = {h.name: h.is_alive() for h in [prompt, *decoders]}
        for h in [prompt, *decoders]:
            h.call(mod.finalize)
    shm_after = sorted(n for n in os.listdir("/dev/shm") if n.startswith("llmdd_"))

    total = collections.Counter()
    errors: collections.Counter = collections.Counter()
    faults: collections.Counter = collections.Counter()
    link_errors: collections.Counter = collections.Counter()
    corruption = []
    for r in results:
        total.update({k: r[k] for k in ("transfers", "bytes", "relinks", "churn")})
        errors.update(r["errors"])
        faults.update(r["faults"])
        link_errors.update(r["link_errors"])
        corruption += r["corruption"]
    leaks = {name: _leaks(base[name], after[name]) for name in base}
    leaks = {k: v for k, v in leaks.items() if v}
    leftover_shm = sorted(set(shm_after) - set(shm_before))
    report = {
        "command": " ".join([os.path.relpath(here), *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "seconds": args.seconds, "decoders": args.decoders, "transport": args.transport,
        "transfers": total["transfers"], "gib_moved": round(total["bytes"] / 2**30, 2),
        "recoveries_relink": total["relinks"], "churn_relinks": total["churn"],
        "faults_injected": dict(faults), "faults_injected_total": sum(faults.values()),
        "errors_by_code": dict(errors), "link_errors": dict(link_errors),
        "latency_ms_p50_per_decoder": [r["latency_ms"]["p50"] for r in results],
        "latency_ms_p99_per_decoder": [r["latency_ms"]["p99"] for r in results],
        "corruption": corruption, "leaks": leaks, "leftover_dev_shm": leftover_shm, "alive": alive,
        "baseline": base, "end": after,
    }
    ok = not corruption and not leaks and not leftover_shm and all(alive.values())
    report["ok"] = ok
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    summary = {k: report[k] for k in ("command", "transfers", "gib_moved", "faults_injected_total",
                                      "faults_injected", "errors_by_code", "link_errors", "recoveries_relink",
                                      "churn_relinks", "corruption", "leaks", "leftover_dev_shm", "alive", "ok",
                                      "latency_ms_p50_per_decoder", "latency_ms_p99_per_decoder")}
    print(json.dumps(summary, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
