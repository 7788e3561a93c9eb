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

from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement  # noqa: E402
from llmdd._data.port import RequestOp  # noqa: E402
from llmdd._control.protocol import messages as m  # noqa: E402

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


# ---------------------------------------------------------------------------- a linked hostile peer
def _link_to(state: dict, remote: int):
    return state["dd"]._core.link_manager.get(remote)


def hostile_send(state: dict, remote: int, port: int, msgs: list, deadline_s: float) -> dict:
    """Send ``msgs`` (post-handshake control messages, any content) over this engine's real, linked
    control connection to ``remote``, then probe the owner with a request round trip (the owner's
    reader handles messages in order, so its answer means every message before it was handled).
    Relinks first when an earlier batch made the owner fail the link."""
    link = _link_to(state, remote)
    if link is None or R.link_states(state).get(remote) != "linked":
        R.unlink(state, [(remote, port)], force=True)
        res = R.link(state, [(remote, port)])
        if res["status"] != "LLM_SUCCESS":
            return {"relinked": False, "link": res["status"]}
        link = _link_to(state, remote)
    lm = state["dd"]._core.link_manager
    sent = 0
    for msg in msgs:
        try:
            link.control.send(msg)
            sent += 1
        except Exception:  # noqa: BLE001 - the owner closed the link mid-batch: that is an outcome
            break
    # a link the owner failed is already failed here when its Error arrived before we ask
    first = "failed" if R.link_states(state).get(remote) == "failed" else _probe(lm, link, deadline_s)
    out = {"relinked": True, "sent": sent, "probe": first, "state": R.link_states(state).get(remote)}
    if first != "answered":
        # the owner failed the link (on purpose, for a refused message): it must still serve a new one
        R.unlink(state, [(remote, port)], force=True)
        res = R.link(state, [(remote, port)])
        out["fresh_link"] = res["status"]
        out["fresh_probe"] = _probe(lm, _link_to(state, remote), deadline_s) if res["status"] == "LLM_SUCCESS" \
            else None
    return out


_STATUS_VALUES = {code.value for code in LLMStatusCode}


def _probe(lm, link, deadline_s: float) -> str:
    try:
        status, _ = lm.request(link, RequestOp.ENGINE_INFO, {}, deadline=time.monotonic() + deadline_s)
        if status == 0:
            return "answered"
        # the owner's answer on a link it failed meanwhile (it serves nothing there): its status
        return LLMStatusCode(status).name if status in _STATUS_VALUES else f"status {status}"
    except LLMException as exc:
        return exc.status_code.name


def request_raw(state: dict, remote: int, op: str, args: dict, deadline_s: float) -> dict:
    """One request with arbitrary arguments over the real link; the owner's reply status and the link
    state after it."""
    lm = state["dd"]._core.link_manager
    try:
        # any op string, as a hostile peer would send it (the engine's own calls take a RequestOp)
        status, result = lm.exchange._exchange(_link_to(state, remote), op,
                                               lambda rid: m.TransferRequest(request_id=rid, op=op, args=args),
                                               time.monotonic() + deadline_s)
        out = {"status": status, "error": result.get("error", "")}
    except LLMException as exc:
        out = {"status": exc.status_code.name, "error": str(exc)}
    out["state"] = R.link_states(state).get(remote)
    return out


def request_ignoring_state(state: dict, remote: int, op: str, args: dict, deadline_s: float) -> dict:
    """One request sent over the control connection whatever state this side's link is in (a hostile
    peer ignores its own link's failure): the owner's reply status, or ``"no reply"`` at the deadline."""
    from llmdd._control.link import Pending
    lm = state["dd"]._core.link_manager
    link = _link_to(state, remote)
    rid = lm.exchange.new_request_id()
    pending = Pending(lm.loop.event())
    link.pending[rid] = pending
    try:
        link.control.send(m.TransferRequest(request_id=rid, op=op, args=args))
        pending.event.wait(deadline_s)   # set by the reply (or by the link closing meanwhile)
    finally:
        link.pending.pop(rid, None)
    if pending.reply is None:
        return {"status": "no reply", "error": "", "state": R.link_states(state).get(remote)}
    return {"status": pending.reply.status_code, "error": dict(pending.reply.result).get("error", ""),
            "state": R.link_states(state).get(remote)}


def notify_raw(state: dict, remote: int, msg) -> None:
    _link_to(state, remote).control.send(msg)


def wait_link_failed(state: dict, remote: int, timeout: float) -> str:
    """The link's state once it is no longer linked, or at the deadline."""
    return R.wait_link_state(state, remote, ("failed", None), timeout)[0]


# ---------------------------------------------------------------------------- cache events
class _CacheEvents:
    def __init__(self) -> None:
        self.events: list = []

    @__import__("llmdd.plugin").plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        self.events.append(event)


def record_cache_events(state: dict) -> None:
    if "cache_events" not in state:
        rec = _CacheEvents()
        state["dd"].add_plugin(rec)
        state["cache_events"] = rec
    state["cache_events"].events.clear()


def cache_events(state: dict, trigger: str) -> list:
    return [(e.id, e.info.get("blocks")) for e in state["cache_events"].events if e.trigger == trigger]


def cache_event_tags(state: dict, trigger: str) -> list:
    return [(e.id, e.info.get("tag"), e.info.get("tensors")) for e in state["cache_events"].events
            if e.trigger == trigger]


def ask_raw(state: dict, remote: int, msg, deadline_s: float) -> dict:
    """One acknowledged notice (a TaggedDone) over the real link: the owner's reply status and the link
    state after it."""
    lm = state["dd"]._core.link_manager
    try:
        status, result = lm.ask(_link_to(state, remote), msg, deadline=time.monotonic() + deadline_s)
        out = {"status": status, "error": result.get("error", "")}
    except LLMException as exc:
        out = {"status": exc.status_code.name, "error": str(exc)}
    out["state"] = R.link_states(state).get(remote)
    return out


def cache_id_of(state: dict, name: str) -> int:
    return state["caches"][name].cache_id


# ---------------------------------------------------------------------------- crash leftovers
def own_segments(state: dict) -> list:
    """The /dev/shm names this process created (pool and control segments)."""
    from llmdd._memory.segments import segment_prefix

    prefix = f"{segment_prefix()}{os.getpid()}_"   # in this process's scope (LLMDD_SHM_SCOPE)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def link_and_pull_once(state: dict, remote: int, port: int) -> str:
    res = R.link(state, [(remote, port)])
    if res["status"] != "LLM_SUCCESS":
        return res["status"]
    return R.transfer(state, "pull_blocks", ("blocks", remote, 0), "dst", [0, 1], [0, 1])[0]


# ---------------------------------------------------------------------------- typed outcomes
def wait_fault_fired(state: dict, count: int, timeout: float) -> int:
    """Wait (deadline ``timeout``) until the faults plugin has fired ``count`` faults."""
    end = time.monotonic() + timeout
    while True:
        n = len(state["inj"].fired)
        if n >= count or time.monotonic() >= end:
            return n
        time.sleep(0.005)


def watch_poison(state: dict, name: str, seconds: float) -> bool:
    """Refill ``name`` with POISON, then report whether it stayed so for ``seconds`` (a measurement
    window: nothing may write into memory after the call that used it returned)."""
    R.fill(state, name, R.POISON)
    time.sleep(seconds)
    return R.poison_kept(state, name)
