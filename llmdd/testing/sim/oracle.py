"""The byte oracle and the revocation model: what a transfer must deliver, and where bytes may land.

The oracle watches two things:

* every landing of the ``sim`` transport (the fabric's ``land`` observation: the destination address
  ranges of one batch).  A destination block may be written only while a call or task that targets it
  is open (a *window*, opened by the workload when it makes the call and closed when the call returned
  or the task's callback ran).  A landing anywhere else (after the call returned, was cancelled or
  failed, or into memory no call targets, such as an outbox) is ``no_late_landing``;
* every transfer's outcome: a successful pull or push must have delivered exactly the owner's bytes of
  those blocks and layers (``bytes_delivered``); it must not succeed when, at its start, this side's link
  to the peer was failed or closed (or never made), the peer was down or had restarted since the link
  was made (an old incarnation), or the owner's cache was deregistered (``no_success_after_revocation``);
  a successful tagged pull's tag must have reached the owner exactly once, in order per link, by the
  time the call returned (``tags_once_in_order``); a non-blocking task ends exactly once, and by its
  engine's finalize (``task_once``); a finalized engine leaves nothing (``nothing_left``).
"""

from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING, Optional, cast

import numpy as np

from llmdd._lifecycle.tables import LINK_DOWN, LINK_REPORTED, LinkState, Machine
from llmdd.testing.sim.invariants import Call, Record

if TYPE_CHECKING:
    from llmdd.testing.sim.workload import Node, TaskRec

__all__ = ["Oracle"]

_SUCCESS = ("ok", "LLM_SUCCESS")
#: the task kinds that wait in a queue before they start (finalize must withdraw them)
NONBLOCKING = ("pull_blocks_async", "transfer_cache_async")


class Oracle:
    def __init__(self, record: Record, block_bytes: int) -> None:
        self.record = record
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}            # block address -> open windows on it
        self._late: list[str] = []
        self._cursor = 0
        #: (engine, incarnation, peer) -> (last link state, record index of the last handshake_succeeded)
        self.links: dict[tuple[int, int, int], tuple[Optional[enum.Enum], int]] = {}
        self.incarnation: dict[int, int] = {}
        self.down: set[int] = set()
        self.outbox_gone: set[int] = set()
        self.started_at: dict[int, int] = {}
        #: (owner, owner incarnation, peer) -> tags delivered (peer_read events), in order
        self.delivered: dict[tuple[int, int, int], list[str]] = {}
        self.acked: dict[tuple[int, int, int], list[str]] = {}
        self.failed_tags: set[str] = set()
        self.nodes: dict[int, Node] = {}
        self._stats_cursor = 0
        self.tasks: list[TaskRec] = []
        #: (engine, incarnation, peer) -> record index of this side's successful unlink (its hold released)
        self.released: dict[tuple[int, int, int], int] = {}
        #: engine -> (incarnation, record index) while its finalize runs
        self.finalizing: dict[int, tuple[int, int]] = {}

    # ------------------------------------------------------------------ landings
    def observe(self, kind: str, batch_id: int, detail: object) -> None:
        """The fabric's observer (called under its lock); ``detail`` is a landing's dict for ``land``."""
        if kind != "land" or not isinstance(detail, dict):
            return
        bb = self.block_bytes
        with self._lock:
            for addr, ln in detail["ranges"]:
                for at in range(addr, addr + max(ln, 1), bb):
                    if self._open.get(at, 0) <= 0:
                        self._late.append(f"batch {batch_id} ({detail['kind']} by {detail['process']} from "
                                          f"{detail['peer']}) wrote {ln} bytes at {addr:#x} in {detail['dst_process']}"
                                          f" where no open call targets (block at {at:#x})")
                        break

    def open(self, process: str, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            for addr, _ in ranges:
                self._open[addr] = self._open.get(addr, 0) + 1

    def close(self, process: str, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            for addr, _ in ranges:
                left = self._open.get(addr, 0) - 1
                if left > 0:
                    self._open[addr] = left
                else:
                    self._open.pop(addr, None)

    # ------------------------------------------------------------------ the model, from events
    def _read_events(self) -> None:
        events = self.record.events
        while self._cursor < len(events):
            engine, inc, ev = events[self._cursor]
            if ev.machine is Machine.LINK:
                key = (engine, inc, int(ev.id))
                _, shook = self.links.get(key, (None, -1))
                if ev.trigger == "handshake_succeeded":
                    shook = self._cursor
                    self.released.pop(key, None)
                self.links[key] = (ev.dest, shook)
            elif ev.machine is Machine.TASK and ev.trigger == "start" and ev.info.get("kind") in NONBLOCKING:
                # a queued non-blocking task (a step of one already running may start: finalize waits for it)
                going = self.finalizing.get(engine)
                if going is not None and going[0] == inc and going[1] <= self._cursor:
                    self.record.add("no_success_after_revocation", f"engine {engine}: task {ev.id!r} started after "
                                    "its engine's finalize began (a queued task must be withdrawn)")
            elif ev.machine is Machine.CACHE and ev.trigger == "peer_read":
                tag = ev.info.get("tag")
                if tag is not None:
                    peer = int(ev.info.get("peer", -1))
                    text = tag.decode() if isinstance(tag, bytes) else str(tag)
                    self.delivered.setdefault((engine, inc, peer), []).append(text)
                    if ev.error is not None:
                        self.failed_tags.add(text)
            self._cursor += 1

    def engine_up(self, node: Node) -> None:
        self.incarnation[node.cid] = node.incarnation
        self.down.discard(node.cid)
        self.outbox_gone.discard(node.cid)
        self.started_at[node.cid] = node.started_at

    def going_down(self, node: Node) -> None:
        self.down.add(node.cid)
        self._read_events()
        self.finalizing[node.cid] = (node.incarnation, len(self.record.events))

    def link_call(self, a: Node, b: Node, op: str, status: Optional[str]) -> None:
        """This side's link_clusters / unlink_clusters of ``b`` ended with ``status``."""
        self._read_events()
        key = (a.cid, a.incarnation, b.cid)
        if op == "unlink" and status == "LLM_SUCCESS":
            self.released[key] = len(self.record.events)
        elif op == "link" and status in ("LLM_SUCCESS", "LLM_ALREADY_LINK"):
            self.released.pop(key, None)

    def deregistered(self, node: Node) -> None:
        self.outbox_gone.add(node.cid)

    def registered(self, node: Node) -> None:
        self.outbox_gone.discard(node.cid)

    def transfer_context(self, a: Node, b: Node, kind: str, tag: Optional[str]) -> dict:
        """What was true when the call started: the reasons it must not succeed."""
        self._read_events()
        reasons = []
        state, shook = self.links.get((a.cid, a.incarnation, b.cid), (None, -1))
        if (a.cid, a.incarnation, b.cid) in self.released:
            reasons.append(f"engine {a.cid} unlinked {b.cid} and did not link it again")
        if state is None:
            reasons.append(f"engine {a.cid} never linked {b.cid} in this incarnation")
        elif state in LINK_DOWN:
            reasons.append(f"engine {a.cid}'s link to {b.cid} was {state.value}")
        if b.cid in self.down or not b.up:
            reasons.append(f"engine {b.cid} was down")
        elif shook >= 0 and self.started_at.get(b.cid, 0) > shook:
            reasons.append(f"engine {b.cid} restarted (incarnation {b.incarnation}) after the link was made")
        if kind == "pull" and b.cid in self.outbox_gone:
            reasons.append(f"engine {b.cid}'s cache was deregistered")
        return {"kind": kind, "a": a, "b": b, "tag": tag, "reasons": reasons,
                "b_inc": b.incarnation, "a_inc": a.incarnation}

    def transfer_done(self, call: Call, ctx: dict, got: Optional[np.ndarray], expect: Optional[np.ndarray]) -> None:
        if call.status not in _SUCCESS:
            return
        rec = self.record
        what = f"engine {call.engine} {call.op}({call.args})"
        if ctx["reasons"]:
            rec.add("no_success_after_revocation", f"{what} succeeded although " + "; ".join(ctx["reasons"]))
        if got is None or expect is None or got.shape != expect.shape or \
                not np.array_equal(got.view(np.uint32), expect.view(np.uint32)):
            rec.add("bytes_delivered", f"{what} succeeded but the destination does not hold the owner's bytes")
        tag = ctx["tag"]
        if tag is not None and ctx["kind"] == "pull":
            self._read_events()
            key = (ctx["b"].cid, ctx["b_inc"], ctx["a"].cid)
            acked = self.acked.setdefault(key, [])
            acked.append(tag)
            got_tags = self.delivered.get(key, [])
            if tag in self.failed_tags:
                rec.add("tags_once_in_order", f"{what} succeeded but its tag reached the owner as a failure")
            if got_tags.count(tag) != 1:
                rec.add("tags_once_in_order", f"{what}: its tag reached the owner {got_tags.count(tag)} times "
                        "by the time the call returned")
            else:
                order = [t for t in got_tags if t in set(acked)]
                if order != acked[-len(order):] and order != acked:
                    rec.add("tags_once_in_order", f"{what}: tags reached the owner as {order}, acknowledged as "
                            f"{acked}")

    # ------------------------------------------------------------------ tasks and ends
    def task_started(self, task: TaskRec) -> None:
        self.tasks.append(task)

    def finalized(self, node: Node, leftovers: dict) -> None:
        self._read_events()
        self.finalizing.pop(node.cid, None)
        left = {k: v for k, v in leftovers.items() if v}
        if left:
            self.record.add("nothing_left", f"engine {node.cid} (incarnation {node.incarnation}) left {left} "
                            "after finalize")
        self._tasks_of(node, "finalize")

    def crashed(self, node: Node) -> None:
        # a crashed process's tasks die with it: their callbacks never come (nor must they)
        for task in node.tasks:
            task.checked = True
        node.tasks = []

    def _tasks_of(self, node: Node, when: str) -> None:
        for task in node.tasks:
            if not task.results:
                self.record.add("task_once", f"engine {node.cid}'s {task.call.op}({task.call.args}) had not ended "
                                f"by its {when}")
            task.checked = True
        node.tasks = []

    def check_statistics(self, node: Node) -> None:
        """``statistics()``'s state of every link of ``node`` is the last state its events said."""
        dd = node.dd
        if dd is None:   # not up
            return
        self._read_events()
        try:
            links = dd.statistics()["links"]
        except Exception as exc:  # noqa: BLE001 - a statistics() that raises disagrees with everything
            self.record.add("statistics_agree", f"engine {node.cid}: statistics() raised {exc!r}")
            return
        for peer, info in links.items():
            state, _ = self.links.get((node.cid, node.incarnation, int(peer)), (None, -1))
            # what statistics() reports of a state is the table's LINK_REPORTED (a RELEASED link, which
            # the peer keeps after an unlink, is reported "linked", as upstream reports it)
            if state is None or info["state"] != LINK_REPORTED[cast(LinkState, state)]:
                self.record.add("statistics_agree", f"engine {node.cid}: statistics() says its link to {peer} is "
                                f"{info['state']}, its events say {None if state is None else state.value}")

    def check(self, rec: Record) -> None:
        """The per-step part (an extra check of :func:`~llmdd.testing.sim.invariants.check_step`)."""
        for cid in {c.engine for c in rec.calls[self._stats_cursor:]}:
            node = self.nodes.get(cid)
            if node is not None:
                self.check_statistics(node)
        self._stats_cursor = len(rec.calls)
        with self._lock:
            late, self._late = self._late, []
        for detail in late:
            rec.add("no_late_landing", detail)
        for task in self.tasks:
            n = len(task.results)
            if n > 1 and not task.twice_reported:
                task.twice_reported = True
                rec.add("task_once", f"engine {task.node.cid}'s {task.call.op}({task.call.args}) ended {n} times: "
                        f"{task.results}")
