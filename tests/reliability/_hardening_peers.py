"""Peer-side functions of the hardening regressions (issue: bounded peer input, no deadlock under
concurrent registration, typed outcomes).  Module-level ``fn(state, ...)`` for the harness; the
engine set-up and patterns are those of ``_rel_peers``."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _rel_peers as R  # noqa: E402

from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMException, Placement  # noqa: E402

#: scheduling slack allowed past a call's own deadline: the time a descheduled thread of a loaded
#: 2-core machine may need to notice the deadline and return (not a widened contract bound)
SCHED_SLACK_S = 0.5


# ---------------------------------------------------------------------------- registration churn
def churn_start(state: dict, num_tensors: int, num_blocks: int, block_bytes: int) -> None:
    """Register and unregister a scratch blocks cache in a loop (a new registration each round),
    in a thread of this child, until :func:`churn_stop`.  Each call's duration is recorded."""
    stop = threading.Event()
    box: dict = {"rounds": 0, "max_call_s": 0.0, "errors": []}
    arrays = [np.zeros(num_blocks * block_bytes, np.uint8) for _ in range(num_tensors)]
    desc = CacheDesc(num_tensors, [num_blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
    cm = state["dd"].cache_manager

    def run() -> None:
        model = 1000
        while not stop.is_set():
            model += 1
            t0 = time.monotonic()
            try:
                cache = cm.register_blocks_cache(desc, [a.ctypes.data for a in arrays], BlocksCacheKey(
                    state["cluster_id"], model % 7 + 1))
                t1 = time.monotonic()
                cm.unregister_cache(cache.cache_id)
            except LLMException as exc:
                box["errors"].append(exc.status_code.name)
                t1 = time.monotonic()
            box["max_call_s"] = max(box["max_call_s"], t1 - t0, time.monotonic() - t1)
            box["rounds"] += 1

    t = threading.Thread(target=run, name="churn")
    state["churn"] = (t, stop, box, arrays)
    t.start()


def churn_stop(state: dict, timeout: float) -> dict:
    """Stop the churn; ``joined`` False means a register/unregister call never returned."""
    t, stop, box, _arrays = state.pop("churn")
    stop.set()
    t.join(timeout)
    return {"joined": not t.is_alive(), "rounds": box["rounds"], "max_call_s": box["max_call_s"],
            "errors": sorted(set(box["errors"]))}


def link_pull_unlink_loop(state: dict, remote: int, port: int, seconds: float, num_tensors: int,
                          num_blocks: int, block_bytes: int, seed: int) -> dict:
    """For ``seconds``: link, pull every block of the owner's blocks cache (model 0) and compare the
    bytes with the owner's pattern, unlink.  Every call's duration is recorded against its deadline."""
    expected = R.pattern(remote, seed, num_tensors, num_blocks * block_bytes)
    out = {"rounds": 0, "linked": 0, "pulled": 0, "wrong_bytes": 0, "link_status": {}, "pull_status": {},
           "unlink_status": {}, "over_deadline": []}
    link_ms, unlink_ms = 3000, 1500
    sync_s = R.SYNC_MS / 1000.0
    end = time.monotonic() + seconds
    blocks = list(range(num_blocks))
    while time.monotonic() < end:
        out["rounds"] += 1
        res = R.link(state, [(remote, port)], timeout_ms=link_ms)
        out["link_status"][res["status"]] = out["link_status"].get(res["status"], 0) + 1
        if res["took"] > link_ms / 1000.0 + SCHED_SLACK_S:
            out["over_deadline"].append(("link", res["took"]))
        if res["status"] != "LLM_SUCCESS":
            continue
        out["linked"] += 1
        R.fill(state, "dst", R.POISON)
        status, took, _ = R.transfer(state, "pull_blocks", ("blocks", remote, 0), "dst", blocks, blocks)
        out["pull_status"][status] = out["pull_status"].get(status, 0) + 1
        # a pull makes at most two round trips (tables are local) plus the copy, each bounded by sync_kv_timeout
        if took > 2 * sync_s + SCHED_SLACK_S:
            out["over_deadline"].append(("pull", took))
        if status == "LLM_SUCCESS":
            out["pulled"] += 1
            if not np.array_equal(R.snapshot(state, "dst"), expected):
                out["wrong_bytes"] += 1
        res = R.unlink(state, [(remote, port)], timeout_ms=unlink_ms)
        out["unlink_status"][res["status"]] = out["unlink_status"].get(res["status"], 0) + 1
        if res["took"] > unlink_ms / 1000.0 + SCHED_SLACK_S:
            out["over_deadline"].append(("unlink", res["took"]))
        if res["status"] != "LLM_SUCCESS":
            R.unlink(state, [(remote, port)], force=True)
    return out
