"""Peer-side functions of the fenced-pull tests (test_fence.py), run in harness children beside
:mod:`_dataplane_peers` (same ``state``).

The decoder runs its pull on a thread of its own (:func:`start_pull`, :func:`join_pull`), so that the
test can drive the owner while the pull is held by the decoder's fault plan (a ``partition`` of its
first read: the read is not posted until :func:`heal`).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from llmdd import BlockFence, BlocksCacheKey, LLMConfig, LLMDataDist, LLMException, LLMRole

import _dataplane_peers as P


def setup_stalled_decoder(state: dict, cluster_id: int, *, transport: Optional[str], sync_ms: int,
                          stall_read: bool, remote_accessible: bool = False) -> None:
    """A decoder engine whose first read batch (with ``stall_read``) waits for :func:`heal` (the faults
    plugin's ``partition``), the plan added before init as an ordinary plugin."""
    from llmdd_faults import Fault, FaultInjector, FaultPlan

    old = state.get("dd")
    if old is not None:
        old.finalize()
        state.clear()
    plan = FaultPlan([Fault("read", "partition", nth=1, count=1, name="stall")] if stall_read else [], seed=7)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = sync_ms
    if remote_accessible:
        cfg.enable_remote_cache_accessible = True
    options = cfg.generate_options()
    if transport:
        options["llmdd.transport"] = transport
    dd = LLMDataDist(LLMRole.DECODER, cluster_id)
    names = [transport] if transport else ["tcp", "shm"]
    dd.add_plugin(FaultInjector(plan, wrap=names, force=True), name="fence_test_faults")
    dd.init(options)
    state.update(dd=dd, caches={}, arrays={}, events=[], tasks={}, syncs={}, plan=plan, pulls={})


def block_fence(state: dict, name: str, blocks: list) -> dict:
    """(owner) What a fenced pull of ``blocks`` of cache ``name`` must find now."""
    return state["dd"].cache_manager.block_fence(state["caches"][name], blocks).as_dict()


def fence_blocks(state: dict, name: str, blocks: list) -> None:
    """(owner) Fence ``blocks`` of cache ``name`` (their generations go up)."""
    state["dd"].cache_manager.fence_blocks(state["caches"][name], blocks)


def reuse_blocks(state: dict, name: str, num_blocks: int, blocks: list, seed: int) -> None:
    """(owner) Overwrite ``blocks`` of every tensor of cache ``name`` with new seeded random bytes (the
    blocks' next user writing them)."""
    rng = np.random.default_rng(seed)
    for arr in state["arrays"][name]:
        rows = arr.reshape(num_blocks, -1)
        for b in blocks:
            rows[b] = np.frombuffer(rng.bytes(rows.shape[1]), dtype=np.uint8)


def start_pull(state: dict, name: str, key: BlocksCacheKey, dst: str, src_blocks: list, dst_blocks: list,
               fence: Optional[dict], tag: Optional[str] = None) -> None:
    """(decoder) Start ``pull_blocks`` on a thread; :func:`join_pull` gives its outcome."""
    done: dict = {}

    def run() -> None:
        kwargs: dict = {"tag": tag}
        if fence is not None:
            kwargs["fence"] = BlockFence.from_dict(fence)
        try:
            state["dd"].cache_manager.pull_blocks(key, state["caches"][dst], src_blocks, dst_blocks, **kwargs)
            done["status"] = "LLM_SUCCESS"
        except LLMException as exc:
            done["status"] = exc.status_code.name
            done["message"] = str(exc)

    thread = threading.Thread(target=run, name=f"fence-test-{name}", daemon=True)
    state["pulls"][name] = (thread, done)
    thread.start()


def join_pull(state: dict, name: str, timeout: float) -> dict:
    """(decoder) The outcome of :func:`start_pull` ``name`` (``{"status": ...}``), waiting at most ``timeout``."""
    thread, done = state["pulls"][name]
    thread.join(timeout)
    return dict(done) if not thread.is_alive() else {"status": "still running"}


def wait_stalled(state: dict, timeout: float) -> int:
    """(decoder) Wait until the plan's partition took hold of a read batch; returns how often it fired."""
    plan = state["plan"]
    deadline = time.monotonic() + timeout
    while plan.fired_count(op="read", action="partition") == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    return plan.fired_count(op="read", action="partition")


def heal(state: dict) -> None:
    """(decoder) Let the held read go on."""
    state["plan"].heal()


def owner_read_events(state: dict) -> list:
    """(owner) The "peer finished reading" events recorded since :func:`_dataplane_peers.subscribe`:
    ``(tag, failed)`` each."""
    return [(e["info"].get("tag"), e["error"]) for e in P.events(state, "cache", "peer_read")]


def note_events(state: dict) -> list:
    """(owner) The ``peer_note`` events recorded: ``(peer, notes)`` each."""
    return [(e["info"].get("peer"), e["info"].get("notes")) for e in P.events(state, "cache", "peer_note")]


def notify(state: dict, key: BlocksCacheKey, notes: list) -> str:
    """(decoder) ``notify_owner``; the status name."""
    try:
        state["dd"].cache_manager.notify_owner(key, notes)
    except LLMException as exc:
        return exc.status_code.name
    return "LLM_SUCCESS"
