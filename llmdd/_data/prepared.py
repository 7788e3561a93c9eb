"""Prepared transfers (issues 21, 37): a small pull_blocks / push_blocks planned once per shape.

A :class:`PreparedPlan` holds, per (direction, link, local cache, model id, layer ranges, tnpl), the
peer's cache id and layouts, the tensor ranges and the per-tensor (local, remote) region pairs; its
:meth:`PreparedPlan.ops` builds the same op rows :func:`~llmdd._data.planner.plan_blocks` would for a
few blocks in plain Python, and its ``prepared`` is the link's channel's prepared transfer for the
shape (the seam's ``Channel.prepare``: the shm plugin's C function, the tcp and ucx plugins' one-call
paths), or None.  :class:`PreparedPlans` keeps them and says, in one place
(:meth:`PreparedPlans.current`), whether a kept plan may still be used.

The transfer engine's ``pull`` / ``push`` (llmdd._data.engine) try a plan first: the prepared
transfer when there is one, else the plan's ops on the batch path; a call no plan serves (a tag, a
key that is not a ``BlocksCacheKey``, a contiguous remote cache, an error in the plan's steps) takes
the general steps, which raise what the contract says.
"""

from __future__ import annotations

import struct
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from llmdd._base.lazy import np, when_numpy_loaded
from llmdd._base.status import LLMException
from llmdd._base.types import BlocksCacheKey, Cache, KvCache
from llmdd._data.busy import BusyTable, Turn
from llmdd._data.layouts import Layouts
from llmdd._data.planner import BlockList, CacheLayout, plan_blocks, tensor_range
from llmdd._protocol.port import ControlPort, LinkView
from llmdd._protocol.tables import DescriptorTables
from llmdd._seam import ops as _ops
from llmdd._seam.abc import Channel, PreparedTransfer

if TYPE_CHECKING:
    import numpy
    from llmdd._memory.manager import CacheRecord, MemoryManager

__all__ = ["PreparedPlan", "PreparedPlans", "PREPARED_MAX_BLOCKS"]

#: the most blocks of a call that pull / push try a plan for (larger calls take the general steps)
PREPARED_MAX_BLOCKS = 16


_OP_ROWS: dict[int, struct.Struct] = {}  # packers of n OP_DTYPE rows (little-endian, packed as OP_DTYPE)


def _op_rows(n: int) -> struct.Struct:
    packer = _OP_ROWS.get(n)
    if packer is None:
        packer = _OP_ROWS[n] = struct.Struct("<" + "IQIQQ" * n)
    return packer


OP_DTYPE: numpy.dtype   # llmdd._seam.ops.OP_DTYPE, once numpy is in use (llmdd._base.lazy)


@when_numpy_loaded
def _numpy_loaded(numpy: ModuleType) -> None:
    global OP_DTYPE
    OP_DTYPE = _ops.OP_DTYPE
    assert _op_rows(1).size == OP_DTYPE.itemsize, "OP_DTYPE is no longer five packed fields"


class PreparedPlan:
    """What a small pull_blocks / push_blocks of one shape needs besides its block lists: the peer's
    cache id, the two layouts, the tensor ranges, the (local, remote) region of each tensor pair, the
    tables, record and regions it was made on (see :meth:`PreparedPlans.current`), the link's busy
    turn (``turn``, made once: ``with plan.turn:`` is the transfer's turn on its link), and the
    channel's prepared transfer for the shape (``prepared``, None when the channel has none for it)."""

    __slots__ = ("link", "tables", "cv", "rv", "rec", "regions", "cache_id", "src", "dst", "src_tensors",
                 "dst_tensors", "push", "pairs", "bs", "su", "du", "per_block", "prepared", "chan", "turn")

    def __init__(self, link: LinkView, tables: DescriptorTables, rec: CacheRecord, cache_id: int, src: CacheLayout, dst: CacheLayout,
                 src_tensors: range, dst_tensors: range, push: bool, *, turn: Turn) -> None:
        self.link, self.tables, self.rec, self.regions = link, tables, rec, rec.regions
        self.turn = turn
        self.cv, self.rv = tables.cache_table_version, tables.regions_version
        self.cache_id, self.src, self.dst, self.push = cache_id, src, dst, push
        self.src_tensors, self.dst_tensors = src_tensors, dst_tensors
        sreg, dreg = src.region_ids, dst.region_ids
        # (local region, remote region) per tensor pair, in the planner's order
        self.pairs = [(sreg[t1], dreg[t2]) if push else (dreg[t2], sreg[t1])
                      for t1, t2 in zip(src_tensors, dst_tensors)]
        self.bs, self.su, self.du = src.unit_size, src.units, dst.units
        self.per_block = src.unit_size * len(self.pairs)
        self.prepared: Optional[PreparedTransfer] = None   # the channel's prepared transfer for this shape
        self.chan: Optional[Channel] = None   # the channel ``prepared`` was asked of

    def ops(self, src_blocks: BlockList, dst_blocks: BlockList) -> tuple:
        """(ops, total bytes): the ops :func:`plan_blocks` makes for these blocks (the same rows, in the
        same order); blocks it would refuse, or more than it plans in plain Python, go through it."""
        su, du = self.su, self.du
        n = len(dst_blocks)
        ok = 0 < n <= 16 and len(src_blocks) == n
        if ok:
            for b in src_blocks:
                if type(b) is not int or not 0 <= b < su:
                    ok = False
                    break
            for b in dst_blocks:
                if type(b) is not int or not 0 <= b < du:
                    ok = False
                    break
        if not ok:
            return self._planned(src_blocks, dst_blocks)
        runs: Sequence[Sequence[int]]
        if n == 1:
            runs = ((src_blocks[0], dst_blocks[0], 1),)
        else:
            pairs: Iterable[tuple[int, int]]
            if len(set(dst_blocks)) != n:   # a destination block listed twice: the last pair wins
                pairs = [(a, b) for i, (a, b) in enumerate(zip(src_blocks, dst_blocks)) if b not in dst_blocks[i + 1:]]
            else:
                pairs = zip(src_blocks, dst_blocks)
            merged: list[list[int]] = []
            ps = pd = -2
            for a, b in pairs:
                if a == ps + 1 and b == pd + 1:
                    merged[-1][2] += 1
                else:
                    merged.append([a, b, 1])
                ps, pd = a, b
            runs = merged
        if len(runs) * len(self.pairs) > 64:
            return self._planned(src_blocks, dst_blocks)
        bs = self.bs
        flat: list = []
        blocks = 0
        if self.push:   # local = src
            for s0, d0, c in runs:
                blocks += c
            for lreg, rreg in self.pairs:
                for s0, d0, c in runs:
                    flat += (lreg, s0 * bs, rreg, d0 * bs, c * bs)
        else:           # local = dst
            for s0, d0, c in runs:
                blocks += c
            for lreg, rreg in self.pairs:
                for s0, d0, c in runs:
                    flat += (lreg, d0 * bs, rreg, s0 * bs, c * bs)
        rows = len(flat) // 5
        ops = np.frombuffer(bytearray(_op_rows(rows).pack(*flat)), dtype=OP_DTYPE)
        return ops, blocks * self.per_block

    def _planned(self, src_blocks: BlockList, dst_blocks: BlockList) -> tuple:
        ops = plan_blocks(src=self.src, dst=self.dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
                          src_tensors=self.src_tensors, dst_tensors=self.dst_tensors,
                          local="src" if self.push else "dst")
        return ops, (int(ops["length"].sum()) if len(ops) else 0)


class PreparedPlans:
    """The engine's kept plans of small block transfers, by shape, and the last one per direction.

    A plan is kept per (direction, link, local cache, model id, layer ranges, tnpl) and used while
    :meth:`current` holds.  Lookups need no lock: the table only grows (cleared past 4096 shapes) and
    the memo is one tuple replaced whole."""

    def __init__(self, *, port: ControlPort, memory: "MemoryManager", layouts: Layouts, busy: BusyTable,
                 timeout_s: float) -> None:
        self._lm = port
        self._busy = busy
        self._memory = memory
        self._layouts = layouts
        self._timeout_s = timeout_s
        self._plans: dict[tuple, PreparedPlan] = {}
        # the last plan per direction (False: pull, True: push) with the call's key, cache and range
        # objects (immutable, and held by the memo: identity stands for equality) and tnpl
        self._memo: dict[bool, tuple] = {}

    def current(self, plan: PreparedPlan) -> bool:
        """The one validity check of a kept plan: its local cache is still the live record of its id
        with the same regions; its link is still the cluster's, LINKED, with the same channel; the
        peer's tables are the same object at the same cache-table and regions versions.  (A change of
        either side's tables also makes the channel's prepared transfer decline; this check keeps the
        engine's own view, the layouts and regions the plan was made from, from going stale.)"""
        rec, link = plan.rec, plan.link
        tables = link.tables
        return (rec.live and rec.regions is plan.regions and self._memory.get(rec.cache_id) is rec
                and link.in_use and link.channel is plan.chan and self._lm.get(link.peer_cluster_id) is link
                and tables is plan.tables and tables.cache_table_version == plan.cv
                and tables.regions_version == plan.rv)

    def lookup(self, push: bool, key: BlocksCacheKey, cache: Union[Cache, KvCache], src_layer_range: Optional[range],
               dst_layer_range: Optional[range], tnpl: int) -> Optional[PreparedPlan]:
        """A current plan for this call's shape (kept, or made now), or None when no plan serves it
        (the local cache or the link not usable now, a contiguous remote cache, a step of the plan
        refused): the caller then takes the general steps, which raise what the contract says."""
        memo = self._memo.get(push)
        if (memo is not None and memo[0] is key and memo[1] is cache and memo[2] is src_layer_range
                and memo[3] is dst_layer_range and memo[4] == tnpl and self.current(memo[5])):
            return memo[5]
        plan = self._kept(push, key.cluster_id, cache.cache_id, key, src_layer_range, dst_layer_range, tnpl)
        if plan is not None:
            self._memo[push] = (key, cache, src_layer_range, dst_layer_range, tnpl, plan)
        return plan

    def lookup_by_id(self, push: bool, cluster_id: int, local_id: int, remote_id: int,
                     src_layer_range: Optional[range], dst_layer_range: Optional[range],
                     tnpl: int) -> Optional[PreparedPlan]:
        """:meth:`lookup` for a peer's cache named by id (the C++ API), both caches planned as blocks
        caches (upstream's "mix" caches; :meth:`CacheLayout.as_kind`)."""
        return self._kept(push, cluster_id, local_id, remote_id, src_layer_range, dst_layer_range, tnpl)

    def _kept(self, push: bool, cluster_id: int, local_id: int, remote: Union[BlocksCacheKey, int],
              src_layer_range: Optional[range], dst_layer_range: Optional[range], tnpl: int) -> Optional[PreparedPlan]:
        rec = self._memory.get(local_id)
        link = self._lm.get(cluster_id)
        if rec is None or not rec.live or link is None or not link.in_use or link.channel is None:
            return None
        # ranges by (start, stop, step): range(0, 2, 2) == range(0, 1), but only one passes the checks
        pk = (push, id(link), local_id, remote.model_id if isinstance(remote, BlocksCacheKey) else ("id", remote),
              None if src_layer_range is None else (src_layer_range.start, src_layer_range.stop, src_layer_range.step),
              None if dst_layer_range is None else (dst_layer_range.start, dst_layer_range.stop, dst_layer_range.step),
              tnpl)
        plan = self._plans.get(pk)
        if plan is not None and plan.link is link and plan.rec is rec and self.current(plan):
            return plan
        try:
            plan = self._make(push, link, rec, remote, src_layer_range, dst_layer_range, tnpl)
        except LLMException:
            return None   # the general steps meet the same refusal and raise it
        if plan is None:
            return None
        if len(self._plans) > 4096:
            self._plans.clear()
        self._plans[pk] = plan
        return plan

    def _make(self, push: bool, link: LinkView, rec: "CacheRecord", remote: Union[BlocksCacheKey, int],
              src_layer_range: Optional[range], dst_layer_range: Optional[range], tnpl: int) -> Optional[PreparedPlan]:
        tables = link.tables
        cv, rv = tables.cache_table_version, tables.regions_version   # read before the layouts
        _, local = self._layouts.local_layout(rec.cache_id)
        if isinstance(remote, BlocksCacheKey):
            cache_id, _ = self._layouts.resolve_remote(link, remote)
            peer = self._layouts.remote_layout(link, cache_id)
            remote_is_blocks = peer.is_blocks
        else:   # by id: both caches as blocks caches
            cache_id = remote
            local, peer = local.as_kind(True), self._layouts.remote_layout(link, cache_id).as_kind(True)
            remote_is_blocks = True
        self._layouts.check_placements(link, remote_cache_id=cache_id, local_rec=rec, local_is="src" if push else "dst",
                                       kind="push_blocks" if push else "pull_blocks", remote_is_blocks=remote_is_blocks)
        src, dst = (local, peer) if push else (peer, local)
        if not src.is_blocks or not dst.is_blocks:
            return None   # a contiguous cache on one side: the general steps plan it
        src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
        dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
        # the planner's checks of the two layouts (block 0 exists in any cache)
        plan_blocks(src=src, dst=dst, src_blocks=[0], dst_blocks=[0], src_tensors=src_tensors,
                    dst_tensors=dst_tensors, local="src" if push else "dst")
        plan = PreparedPlan(link, tables, rec, cache_id, src, dst, src_tensors, dst_tensors, push,
                            turn=self._busy.turn(link))
        plan.cv, plan.rv = cv, rv
        self.prepare(plan)
        return plan

    def prepare(self, plan: PreparedPlan) -> None:
        """Ask the plan's link's channel for its prepared transfer of the shape, on the tables of now
        (made again after one declined; None: the channel has no prepared path for it).  No lock held."""
        channel = plan.link.channel
        plan.chan = channel
        plan.prepared = None if channel is None else channel.prepare(
            plan.pairs, plan.bs, plan.su, plan.du, plan.push, timeout_s=self._timeout_s)

    def forget(self, link: LinkView) -> None:
        """The link is down: its plans go."""
        for pk in [pk for pk, plan in list(self._plans.items()) if plan.link is link]:
            self._plans.pop(pk, None)
        for push, memo in list(self._memo.items()):
            if memo[5].link is link:
                self._memo.pop(push, None)
