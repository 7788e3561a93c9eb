"""The workload: many engines driven through llmdd's public API at once, valid and invalid calls.

Every engine (a :class:`Node`) holds three blocks caches of ``TENSORS`` tensors (``LAYERS`` layers of
two tensors) and ``BLOCKS`` blocks, registered from numpy buffers it owns:

* the **outbox** (key ``BlocksCacheKey(cid, 0)``), filled with a pattern seeded by the engine, its
  incarnation and the registration's generation; peers pull from it and nobody ever writes it;
* the **inbox** (key ``BlocksCacheKey(cid, 1)``): peers push into it;
* the **scratch** cache (no key): this engine's pulls land there.

So the owner's bytes of a pull never change while it runs, and every destination block belongs to at
most one call or task at a time (a block in use is *reserved*): the byte oracle can say exactly what a
successful transfer must have delivered, and which memory may be written while which call runs.

:class:`Workload` draws each step's operation from its own seeded :class:`random.Random`: link,
unlink (force or not; mutual links arise from both sides linking), pull_blocks (blocks, layer ranges,
tags), pull_blocks_async, push_blocks, register/deregister of the outbox, switch_role, finalize and
re-init, crash and restart (where the backend can crash a process), invalid calls, and letting time
pass.  Each call is a :class:`~llmdd.testing.sim.invariants.Call` in the run's record, with the
deadline the contract gives it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from llmdd import BlocksCacheKey, Cache, CacheDesc, CacheTask, DataType, LLMClusterInfo, LLMConfig, LLMDataDist
from llmdd import LLMRole, LLMStatusCode
from llmdd.events import TransitionEvent
from llmdd.plugin import hookimpl
from llmdd.testing.sim.invariants import Call, Record

if TYPE_CHECKING:
    from llmdd.testing.sim.backends import Backend
    from llmdd.testing.sim.oracle import Oracle

__all__ = ["Workload", "Node", "TENSORS", "LAYERS", "BLOCKS", "ELEMS", "OPS"]

TENSORS = 4
LAYERS = TENSORS // 2
BLOCKS = 8
ELEMS = 16                     # float32 per block per tensor
BLOCK_BYTES = ELEMS * 4
SYNC_KV_MS = 400               # llm.SyncKvCacheWaitTime: the deadline of every byte-moving step
LINK_MS = 1500                 # link_clusters / unlink_clusters timeout
#: byte-moving steps a pull or push may take, each with SYNC_KV_MS (the owner's tables, the busy turn
#: and the transfer, the read-done acknowledgement of a tag)
TRANSFER_STEPS = 3
FINALIZE_S = 2 * LINK_MS / 1000.0 + TRANSFER_STEPS * SYNC_KV_MS / 1000.0

#: operation -> weight (the workload's mix)
OPS = {
    "link": 12, "unlink": 5, "pull": 24, "pull_async": 10, "push": 10, "invalid": 8, "reregister": 4,
    "switch_role": 2, "restart": 2, "crash": 2, "wait": 10,
}


class EventTap:
    """A plugin recording every lifecycle event of one engine incarnation into the run's record."""

    def __init__(self, record: Record, engine: int, incarnation: int) -> None:
        self.record, self.engine, self.incarnation = record, engine, incarnation

    def _add(self, event: TransitionEvent) -> None:
        self.record.events.append((self.engine, self.incarnation, event))

    @hookimpl
    def llmdd_engine_transition(self, event: TransitionEvent) -> None:
        self._add(event)

    @hookimpl
    def llmdd_link_transition(self, event: TransitionEvent) -> None:
        self._add(event)

    @hookimpl
    def llmdd_cache_transition(self, event: TransitionEvent) -> None:
        self._add(event)

    @hookimpl
    def llmdd_task_transition(self, event: TransitionEvent) -> None:
        self._add(event)

    @hookimpl
    def llmdd_comm_group_transition(self, event: TransitionEvent) -> None:
        self._add(event)

    @hookimpl
    def llmdd_listener_transition(self, event: TransitionEvent) -> None:
        self._add(event)


class Node:
    """One engine of the workload and what the workload knows of it."""

    def __init__(self, cid: int, role: LLMRole) -> None:
        self.cid = cid
        self.role = role
        self.process = f"e{cid}"
        self.dd: Optional[LLMDataDist] = None
        self.incarnation = 0
        self.generation = 0
        self.listen: Optional[tuple[str, int]] = None
        self.bufs: dict[str, list[np.ndarray]] = {}
        self.caches: dict[str, Cache] = {}
        self.reserved: set[tuple[str, int]] = set()
        #: the record index of this incarnation's start (a peer's link made before it is to an old one)
        self.started_at = 0
        #: record event index when the outbox was last deregistered (None: registered)
        self.outbox_gone = False
        self.tasks: list["TaskRec"] = []

    @property
    def up(self) -> bool:
        return self.dd is not None

    def block_ranges(self, cache: str, blocks: list[int], layers: range) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for layer in layers:
            for t in (2 * layer, 2 * layer + 1):
                base = self.bufs[cache][t].ctypes.data
                out.extend((base + b * BLOCK_BYTES, BLOCK_BYTES) for b in blocks)
        return out

    def blocks_of(self, cache: str, blocks: list[int], layers: range) -> np.ndarray:
        return np.stack([self.bufs[cache][t][b].copy() for layer in layers for t in (2 * layer, 2 * layer + 1)
                         for b in blocks])


class TaskRec:
    def __init__(self, call: Call, node: Node, peer: Node, dst_blocks: list[int], layers: range,
                 expect: Optional[np.ndarray], windows: list) -> None:
        self.call, self.node, self.peer = call, node, peer
        self.dst_blocks, self.layers, self.expect, self.windows = dst_blocks, layers, expect, windows
        self.results: list[LLMStatusCode] = []
        self.handle: Optional[CacheTask] = None
        self.checked = False
        self.twice_reported = False   # the oracle said it ended more than once


def pattern(cid: int, incarnation: int, generation: int) -> np.ndarray:
    rng = np.random.default_rng([cid, incarnation, generation])
    return rng.standard_normal((TENSORS, BLOCKS, ELEMS)).astype(np.float32)


class Workload:
    """Draws and runs one operation per step against the backend's engines (module docstring)."""

    def __init__(self, backend: Backend, record: Record, oracle: Oracle, *, engines: int, seed: int,
                 ops: Optional[dict] = None) -> None:
        self.backend = backend
        self.record = record
        self.oracle = oracle
        self.rng = random.Random(f"workload-{seed}")
        self.nodes = [Node(i + 1, LLMRole.PROMPT if i % 2 == 0 else LLMRole.DECODER) for i in range(engines)]
        mix = dict(OPS if ops is None else ops)
        if not backend.can_crash:
            mix.pop("crash", None)
        self._ops = list(mix)
        self._weights = [mix[o] for o in self._ops]

    # ------------------------------------------------------------------ engines
    def options(self, node: Node) -> dict:
        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.local_comm_res = ""
        cfg.enable_remote_cache_accessible = True
        cfg.sync_kv_timeout = SYNC_KV_MS
        opts = dict(cfg.generate_options())
        opts.update(self.backend.engine_options(node))
        return opts

    def start(self, node: Node) -> None:
        node.incarnation += 1
        node.generation = 0
        node.started_at = len(self.record.events)
        node.reserved.clear()
        dd = LLMDataDist(node.role, node.cid)
        dd.add_plugin(EventTap(self.record, node.cid, node.incarnation), name=f"sim-tap-{node.cid}")
        self.backend.init(node, dd, self.options(node))
        node.dd = dd
        listen = dd.statistics()["listen"]
        node.listen = None if listen is None else (listen[0], int(listen[1]))
        node.bufs = {}
        node.caches = {}
        desc = CacheDesc(TENSORS, [BLOCKS, ELEMS], DataType.DT_FLOAT)
        for name, key in (("outbox", BlocksCacheKey(node.cid, 0)), ("inbox", BlocksCacheKey(node.cid, 1)),
                          ("scratch", None)):
            data = pattern(node.cid, node.incarnation, 0) if name == "outbox" else \
                np.zeros((TENSORS, BLOCKS, ELEMS), np.float32)
            node.bufs[name] = [np.ascontiguousarray(data[t]) for t in range(TENSORS)]
            node.caches[name] = dd.cache_manager.register_blocks_cache(
                desc, [b.ctypes.data for b in node.bufs[name]], key)
        node.outbox_gone = False
        self.oracle.engine_up(node)

    def start_all(self) -> None:
        for node in self.nodes:
            self.start(node)

    # ------------------------------------------------------------------ one step
    def step(self) -> str:
        op = self.rng.choices(self._ops, self._weights)[0]
        getattr(self, f"op_{op}")()
        return op

    def _pick(self, up: bool = True) -> Node:
        nodes = [n for n in self.nodes if n.up == up] if up else self.nodes
        return self.rng.choice(nodes or self.nodes)

    def _pair(self) -> tuple[Node, Node]:
        a = self._pick()
        others = [n for n in self.nodes if n is not a]
        return a, self.rng.choice(others)

    def _call(self, node: Node, op: str, args: str, budget_s: float, fn: Callable[[], Any]) -> Call:
        now = self.backend.now()
        call = Call(step=self.record.step, engine=node.cid, op=op, args=args, started=now, deadline=now + budget_s)
        self.record.calls.append(call)
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - the contract check judges it
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) or type(exc).__name__ == "Stuck":
                raise
            call.exception = exc
            code = getattr(exc, "status_code", None)
            call.status = code.name if code is not None else f"raised:{type(exc).__name__}"
        else:
            call.result = result
            call.status = getattr(result, "name", None) or "ok"
            if isinstance(result, tuple) and result:
                call.status = getattr(result[0], "name", str(result[0]))
        call.ended = self.backend.now()
        return call

    def _cluster(self, node: Node, peer: Node) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = peer.cid
        info.append_local_ip_info(self.backend.host_of(node), 0)
        if peer.listen is not None:
            info.append_remote_ip_info(peer.listen[0], peer.listen[1])
        return info

    # ------------------------------------------------------------------ operations
    def op_wait(self) -> None:
        self.backend.advance(self.rng.choice((0.001, 0.01, 0.1, 0.5, 1.0)))

    def op_link(self) -> None:
        a, b = self._pair()
        if not a.up:
            return
        dd = a.dd
        assert dd is not None
        call = self._call(a, "link_clusters", f"{b.cid}", LINK_MS / 1000.0,
                          lambda: dd.link_clusters([self._cluster(a, b)], LINK_MS))
        self.oracle.link_call(a, b, "link", call.status)

    def op_unlink(self) -> None:
        a, b = self._pair()
        if not a.up:
            return
        dd = a.dd
        assert dd is not None
        force = self.rng.random() < 0.3
        call = self._call(a, "unlink_clusters", f"{b.cid}, force={force}", LINK_MS / 1000.0,
                          lambda: dd.unlink_clusters([self._cluster(a, b)], LINK_MS, force=force))
        self.oracle.link_call(a, b, "unlink", call.status)

    def _transfer_shape(self, src: Node, dst: Node, dst_cache: str) -> Optional[tuple[list, list, range, range]]:
        n = self.rng.randint(1, 4)
        free = [b for b in range(BLOCKS) if (dst_cache, b) not in dst.reserved]
        if len(free) < n:
            return None
        dst_blocks = self.rng.sample(free, n)
        src_blocks = self.rng.sample(range(BLOCKS), n)
        k = self.rng.randint(1, LAYERS)
        s0 = self.rng.randint(0, LAYERS - k)
        d0 = self.rng.randint(0, LAYERS - k)
        return src_blocks, dst_blocks, range(s0, s0 + k), range(d0, d0 + k)

    def _layer_kwargs(self, src_layers: range, dst_layers: range) -> dict:
        if len(src_layers) == LAYERS and self.rng.random() < 0.5:
            return {}
        return {"src_layer_range": src_layers, "dst_layer_range": dst_layers}

    def op_pull(self, nonblocking: bool = False) -> None:
        a, b = self._pair()
        if not a.up:
            return
        shape = self._transfer_shape(b, a, "scratch")
        if shape is None:
            return
        src_blocks, dst_blocks, src_layers, dst_layers = shape
        dd = a.dd
        assert dd is not None
        kwargs = self._layer_kwargs(src_layers, dst_layers)
        if not kwargs:
            src_layers = dst_layers = range(LAYERS)
        tag = None
        if self.rng.random() < 0.3:
            tag = f"t{self.record.step}-{a.cid}-{b.cid}"
            kwargs["tag"] = tag
        expect = b.blocks_of("outbox", src_blocks, src_layers) if b.up else None
        windows = a.block_ranges("scratch", dst_blocks, dst_layers)
        key = BlocksCacheKey(b.cid, 0)
        args = f"{b.cid}, src={src_blocks}, dst={dst_blocks}, layers={src_layers}->{dst_layers}, tag={tag}"
        ctx = self.oracle.transfer_context(a, b, "pull", tag)
        for blk in dst_blocks:
            a.reserved.add(("scratch", blk))
        self.oracle.open(a.process, windows)
        cache = a.caches["scratch"]
        if not nonblocking:
            call = self._call(a, "pull_blocks", args, TRANSFER_STEPS * SYNC_KV_MS / 1000.0,
                              lambda: dd.cache_manager.pull_blocks(key, cache, src_blocks=src_blocks,
                                                                   dst_blocks=dst_blocks, **kwargs))
            self.oracle.close(a.process, windows)
            for blk in dst_blocks:
                a.reserved.discard(("scratch", blk))
            self.oracle.transfer_done(call, ctx, a.blocks_of("scratch", dst_blocks, dst_layers)
                                      if call.status == "ok" else None, expect)
            return
        rec = TaskRec(Call(step=self.record.step, engine=a.cid, op="pull_blocks_async", args=args,
                           started=self.backend.now(), deadline=0.0), a, b, dst_blocks, dst_layers, expect, windows)

        def callback(status: LLMStatusCode, rec: TaskRec = rec) -> None:
            rec.results.append(status)
            if len(rec.results) == 1:
                self.oracle.close(rec.node.process, rec.windows)
                for blk in rec.dst_blocks:
                    rec.node.reserved.discard(("scratch", blk))
                rec.call.ended = self.backend.now()
                rec.call.status = getattr(status, "name", str(status))
                got = rec.node.blocks_of("scratch", rec.dst_blocks, rec.layers) \
                    if rec.call.status == "LLM_SUCCESS" else None
                self.oracle.transfer_done(rec.call, ctx, got, rec.expect)

        call = self._call(a, "pull_blocks_async", args, SYNC_KV_MS / 1000.0,
                          lambda: dd.cache_manager.pull_blocks_async(key, cache, src_blocks=src_blocks,
                                                                     dst_blocks=dst_blocks, callback=callback,
                                                                     **kwargs))
        if call.exception is not None:      # refused at once: no task
            self.oracle.close(a.process, windows)
            for blk in dst_blocks:
                a.reserved.discard(("scratch", blk))
            return
        a.tasks.append(rec)
        self.oracle.task_started(rec)

    def op_pull_async(self) -> None:
        self.op_pull(nonblocking=True)

    def op_push(self) -> None:
        a, b = self._pair()
        if not a.up or not b.up:
            return
        shape = self._transfer_shape(a, b, "inbox")
        if shape is None:
            return
        src_blocks, dst_blocks, src_layers, dst_layers = shape
        dd = a.dd
        assert dd is not None
        kwargs = self._layer_kwargs(src_layers, dst_layers)
        if not kwargs:
            src_layers = dst_layers = range(LAYERS)
        expect = a.blocks_of("outbox", src_blocks, src_layers)
        windows = b.block_ranges("inbox", dst_blocks, dst_layers)
        for blk in dst_blocks:
            b.reserved.add(("inbox", blk))
        ctx = self.oracle.transfer_context(a, b, "push", None)
        self.oracle.open(b.process, windows)
        cache = a.caches["outbox"]
        key = BlocksCacheKey(b.cid, 1)
        call = self._call(a, "push_blocks", f"{b.cid}, src={src_blocks}, dst={dst_blocks}, "
                          f"layers={src_layers}->{dst_layers}", TRANSFER_STEPS * SYNC_KV_MS / 1000.0,
                          lambda: dd.cache_manager.push_blocks(key, cache, src_blocks=src_blocks,
                                                               dst_blocks=dst_blocks, **kwargs))
        self.oracle.close(b.process, windows)
        for blk in dst_blocks:
            b.reserved.discard(("inbox", blk))
        got = b.blocks_of("inbox", dst_blocks, dst_layers) if call.status == "ok" and b.up else None
        self.oracle.transfer_done(call, ctx, got, expect)

    def op_reregister(self) -> None:
        node = self._pick()
        if not node.up:
            return
        dd = node.dd
        assert dd is not None
        if not node.outbox_gone:
            cache = node.caches["outbox"]
            self._call(node, "unregister_cache", "outbox", FINALIZE_S,
                       lambda: dd.cache_manager.unregister_cache(cache.cache_id))
            node.outbox_gone = True
            self.oracle.deregistered(node)
            return
        node.generation += 1
        data = pattern(node.cid, node.incarnation, node.generation)
        for t in range(TENSORS):
            node.bufs["outbox"][t][:] = data[t]
        desc = CacheDesc(TENSORS, [BLOCKS, ELEMS], DataType.DT_FLOAT)
        bufs = node.bufs["outbox"]
        call = self._call(node, "register_blocks_cache", "outbox", FINALIZE_S,
                          lambda: dd.cache_manager.register_blocks_cache(desc, [b.ctypes.data for b in bufs],
                                                                         BlocksCacheKey(node.cid, 0)))
        if call.exception is None:
            node.caches["outbox"] = call.result
            node.outbox_gone = False
            self.oracle.registered(node)

    def op_switch_role(self) -> None:
        node = self._pick()
        if not node.up:
            return
        dd = node.dd
        assert dd is not None
        role = LLMRole.DECODER if node.role is LLMRole.PROMPT else LLMRole.PROMPT
        opts = {} if node.listen is None else {"llm.listenIpInfo": f"{node.listen[0]}:{node.listen[1]}"}
        call = self._call(node, "switch_role", role.name, FINALIZE_S, lambda: dd.switch_role(role, opts))
        if call.exception is None:
            node.role = role

    def op_restart(self) -> None:
        node = self._pick()
        if not node.up:
            self.start(node)
            return
        self.finalize(node)
        self.start(node)

    def finalize(self, node: Node) -> None:
        dd = node.dd
        assert dd is not None
        self.oracle.going_down(node)
        self._call(node, "finalize", "", FINALIZE_S, dd.finalize)
        node.dd = None
        self.oracle.finalized(node, self.backend.leftovers(node))

    def op_crash(self) -> None:
        node = self._pick()
        if not node.up:
            self.start(node)
            return
        self.oracle.going_down(node)
        self.backend.crash(node)
        node.dd = None
        self.oracle.crashed(node)
        if self.rng.random() < 0.7:
            self.start(node)

    def op_invalid(self) -> None:
        a, b = self._pair()
        if not a.up:
            return
        dd = a.dd
        assert dd is not None
        cm = dd.cache_manager
        scratch = a.caches["scratch"]
        which = self.rng.randrange(7)
        key = BlocksCacheKey(b.cid, 0)
        budget = TRANSFER_STEPS * SYNC_KV_MS / 1000.0
        if which == 0:
            self._call(a, "pull_blocks", "lengths differ", budget,
                       lambda: cm.pull_blocks(key, scratch, src_blocks=[0, 1], dst_blocks=[2]))
        elif which == 1:
            self._call(a, "pull_blocks", "dst block out of range", budget,
                       lambda: cm.pull_blocks(key, scratch, src_blocks=[0], dst_blocks=[BLOCKS + 3]))
        elif which == 2:
            self._call(a, "pull_blocks", "src block out of range", budget,
                       lambda: cm.pull_blocks(key, scratch, src_blocks=[BLOCKS + 1], dst_blocks=[0]))
        elif which == 3:
            self._call(a, "pull_blocks", "never linked", budget,
                       lambda: cm.pull_blocks(BlocksCacheKey(10_000 + b.cid, 0), scratch, src_blocks=[0],
                                              dst_blocks=[0]))
        elif which == 4:
            self._call(a, "pull_blocks", "tag too long", budget,
                       lambda: cm.pull_blocks(key, scratch, src_blocks=[0], dst_blocks=[0], tag="x" * 300))
        elif which == 5:
            self._call(a, "pull_blocks", "wrong key type", budget,
                       lambda: cm.pull_blocks("not a key", scratch, src_blocks=[0], dst_blocks=[0]))
        else:
            info = LLMClusterInfo()
            info.remote_cluster_id = 20_000 + b.cid
            info.append_local_ip_info(self.backend.host_of(a), 0)
            info.append_remote_ip_info(*self.backend.nobody_listens())
            self._call(a, "link_clusters", "nobody listens", LINK_MS / 1000.0,
                       lambda: dd.link_clusters([info], LINK_MS))
        # an invalid call writes nothing: a reserved-free block changed would be a landing the oracle sees

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Finalize every engine that is up (the run's last step)."""
        for node in self.nodes:
            if node.up:
                self.finalize(node)
