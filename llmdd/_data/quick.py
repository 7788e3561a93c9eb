"""The small-transfer path (issue 21): a small pull_blocks / push_blocks planned once per shape.

A :class:`QuickPlan` holds, per (direction, link, local cache, model id, layer ranges, tnpl), the
peer's cache id and layouts, the tensor ranges and the per-tensor (local, remote) region pairs, valid
while the peer's tables, the local record and its regions are the same objects and versions; its
:meth:`QuickPlan.ops` builds the same op rows :func:`~llmdd._data.planner.plan_blocks` would for a
few blocks in plain Python, and :func:`fast_for` asks the link's channel for its one-call path for
the shape (the shm plugin's C function).  :class:`SmallTransfers` runs such a call: through the
channel's one-call path when it has one and nobody listens to task events, else through the
transfer engine's ops path, with the same checks, errors and outcomes as its general pull / push.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Iterable, Optional, Protocol, Sequence

from llmdd._base.lazy import np, when_numpy_loaded
from llmdd._base.status import LLMException, TransportError
from llmdd._data.busy import BusyTable
from llmdd._data.layouts import Layouts
from llmdd._data.notices import READ, OwnerNotices
from llmdd._data.planner import CacheLayout, plan_blocks, tensor_range
from llmdd._protocol.port import ControlPort, LinkView
from llmdd._extension.manager import Hooks
from llmdd._seam import ops as _ops

if TYPE_CHECKING:
    from llmdd._lifecycle.machines import Lifecycle
    from llmdd._memory.manager import CacheRecord, MemoryManager

__all__ = ["QuickPlan", "SmallTransfers", "BlockingTransfers", "fast_for"]


_OP_ROWS: dict[int, struct.Struct] = {}  # packers of n OP_DTYPE rows (little-endian, packed as OP_DTYPE)


def _op_rows(n: int) -> struct.Struct:
    packer = _OP_ROWS.get(n)
    if packer is None:
        packer = _OP_ROWS[n] = struct.Struct("<" + "IQIQQ" * n)
    return packer


OP_DTYPE: Any   # llmdd._seam.ops.OP_DTYPE, once numpy is in use (llmdd._base.lazy)


@when_numpy_loaded
def _numpy_loaded(numpy: Any) -> None:
    global OP_DTYPE
    OP_DTYPE = _ops.OP_DTYPE
    assert _op_rows(1).size == OP_DTYPE.itemsize, "OP_DTYPE is no longer five packed fields"


class QuickPlan:
    """What a small pull_blocks / push_blocks of one shape needs besides its block lists."""

    __slots__ = ("link", "tables", "cv", "rv", "rec", "regions", "cache_id", "src", "dst", "src_tensors",
                 "dst_tensors", "push", "pairs", "bs", "su", "du", "per_block", "fast", "chan")

    def __init__(self, link: LinkView, tables: Any, rec: CacheRecord, cache_id: int, src: CacheLayout, dst: CacheLayout,
                 src_tensors: range, dst_tensors: range, push: bool) -> None:
        self.link, self.tables, self.rec, self.regions = link, tables, rec, rec.regions
        self.cv, self.rv = tables.cache_table_version, tables.regions_version
        self.cache_id, self.src, self.dst, self.push = cache_id, src, dst, push
        self.src_tensors, self.dst_tensors = src_tensors, dst_tensors
        sreg, dreg = src.region_ids, dst.region_ids
        # (local region, remote region) per tensor pair, in the planner's order
        self.pairs = [(sreg[t1], dreg[t2]) if push else (dreg[t2], sreg[t1])
                      for t1, t2 in zip(src_tensors, dst_tensors)]
        self.bs, self.su, self.du = src.unit_size, src.units, dst.units
        self.per_block = src.unit_size * len(self.pairs)
        self.fast: Any = None   # the channel's one-call path for this shape (see TransferEngine._run_fast)
        self.chan: Any = None   # the channel ``fast`` was made by

    def ops(self, src_blocks: Any, dst_blocks: Any) -> tuple:
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

    def _planned(self, src_blocks: Any, dst_blocks: Any) -> tuple:
        ops = plan_blocks(src=self.src, dst=self.dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
                          src_tensors=self.src_tensors, dst_tensors=self.dst_tensors,
                          local="src" if self.push else "dst")
        return ops, (int(ops["length"].sum()) if len(ops) else 0)


def fast_for(link: LinkView, plan: QuickPlan, timeout_s: float) -> Any:
    """The link's channel's one-call path for ``plan``'s shape, or None (a channel without one: a
    fault-injecting wrapper, a vendor's transport; or one that cannot take the shape).

    The channel's ``quick_plan(pairs, block_bytes, src_units, dst_units, push, timeout_s=...)`` returns
    ``f(src_blocks, dst_blocks)``: the bytes moved; a negative number when it did not do the transfer
    and nothing of it happened (the ops path then runs it); or it raises the transport error of a
    transfer it started and that failed, by ``timeout_s`` after the call at the latest (reported as the
    ops path reports it)."""
    channel = link.channel
    plan.chan = channel
    make = getattr(channel, "quick_plan", None)
    if make is None:
        return None
    return make(plan.pairs, plan.bs, plan.su, plan.du, plan.push, timeout_s=timeout_s)


#: the task triggers of a blocking transfer that succeeded (run_ops: start, transfer_succeeded)
_TASK_DONE = ("start", "transfer_succeeded")


class BlockingTransfers(Protocol):
    """What the small-transfer path takes from the transfer engine (implemented by ``TransferEngine``)."""

    def link_for(self, cluster_id: int) -> Any:
        """The LINKED link to ``cluster_id`` with its data channel, or the contract's error."""
        ...

    def run_ops(self, link: LinkView, ops: Any, *, write: bool, kind: str, step_of: Any = None,
                nbytes: Optional[int] = None) -> None:
        """Move ``ops`` over ``link`` as one task with the sync_kv_timeout deadline."""
        ...

    def pull(self, key: Any, cache: Any, *, kind: str, src_blocks: Optional[Sequence[int]] = None,
             dst_blocks: Optional[Sequence[int]] = None, src_layer_range: Optional[range] = None,
             dst_layer_range: Optional[range] = None, tnpl: int = 2) -> None:
        """The general pull (every check, every path)."""
        ...

    def push(self, key: Any, cache: Any, *, kind: str, src_blocks: Optional[Sequence[int]] = None,
             dst_blocks: Optional[Sequence[int]] = None, src_layer_range: Optional[range] = None,
             dst_layer_range: Optional[range] = None, tnpl: int = 2) -> None:
        """The general push (every check, every path)."""
        ...

    def local_outcome(self, rec: Any, exc: Optional[LLMException], kind: str) -> LLMException:
        """The error of a transfer whose ops failed or whose local cache went meanwhile."""
        ...

    def ops_failed(self, link: LinkView, exc: TransportError, kind: str, task: Any = None) -> LLMException:
        """The contract's error for a transport failure of ``kind`` over ``link`` (the link's and the
        task's bookkeeping done)."""
        ...

    def next_task_id(self) -> int:
        """A new transfer task id."""
        ...

    @property
    def timeout_s(self) -> float:
        """The sync_kv_timeout deadline of a blocking transfer, in seconds."""
        ...


class SmallTransfers:
    """pull_blocks / push_blocks with a BlocksCacheKey, no tag and a few int blocks (issue 21): the
    same steps, checks, errors and outcomes as the transfer engine's pull() / push(), with what only
    depends on the shape of the call (the peer's cache id and layout, the placement rules, the tensor
    ranges, the per-tensor regions) kept per (direction, link, local cache, model id, layer ranges,
    tnpl) and valid while the peer's tables, the local record and its regions are the same
    objects/versions."""

    def __init__(self, *, transfers: BlockingTransfers, port: ControlPort, memory: "MemoryManager",
                 tasks: "Lifecycle", hooks: Hooks, layouts: Layouts, busy: BusyTable,
                 notices: OwnerNotices) -> None:
        self._transfers = transfers
        self._lm = port
        self._memory = memory
        self._tasks = tasks
        self._hooks = hooks
        self._layouts = layouts
        self._busy = busy
        self._notices = notices
        self._plans: dict[tuple, QuickPlan] = {}  # the small-transfer path's per-shape plans
        # the last small pull / push with a one-call plan: (key, cache, src range, dst range, tnpl, plan)
        self._memo_pull: Optional[tuple] = None
        self._memo_push: Optional[tuple] = None

    def forget(self, link: LinkView) -> None:
        """The link is down: its plans go."""
        for pk in [pk for pk, plan in list(self._plans.items()) if plan.link is link]:
            self._plans.pop(pk, None)

    def _quick_plan(self, push: bool, link: LinkView, rec: Any, key: Any, src_layer_range: Any, dst_layer_range: Any,
                    tnpl: int) -> Optional["QuickPlan"]:
        tables = link.tables
        # ranges by (start, stop, step): range(0, 2, 2) == range(0, 1), but only one passes the checks
        pk = (push, id(link), rec.cache_id, key.model_id,
              None if src_layer_range is None else (src_layer_range.start, src_layer_range.stop, src_layer_range.step),
              None if dst_layer_range is None else (dst_layer_range.start, dst_layer_range.stop, dst_layer_range.step),
              tnpl)
        plan = self._plans.get(pk)
        if (plan is not None and plan.link is link and plan.tables is tables and plan.rec is rec
                and plan.regions is rec.regions and plan.cv == tables.cache_table_version
                and plan.rv == tables.regions_version):
            return plan
        # the steps of pull() / push() up to the planner, in their order (so their errors)
        _, local = self._layouts.local_layout(rec.cache_id)
        cache_id, _ = self._layouts.resolve_remote(link, key)
        remote = self._layouts.remote_layout(link, cache_id)
        kind = "push_blocks" if push else "pull_blocks"
        self._layouts.check_placements(link, remote_cache_id=cache_id, local_rec=rec,
                                       local_is="src" if push else "dst", kind=kind, remote_is_blocks=remote.is_blocks)
        src, dst = (local, remote) if push else (remote, local)
        if not src.is_blocks and not push:
            return None  # a contiguous remote cache: pull() plans it
        src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
        dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
        # the planner's checks of the two layouts (block 0 exists in any cache): raises as pull/push would
        plan_blocks(src=src, dst=dst, src_blocks=[0], dst_blocks=[0], src_tensors=src_tensors,
                    dst_tensors=dst_tensors, local="src" if push else "dst")
        plan = QuickPlan(link, tables, rec, cache_id, src, dst, src_tensors, dst_tensors, push)
        plan.fast = fast_for(link, plan, self._transfers.timeout_s)
        if len(self._plans) > 4096:
            self._plans.clear()
        self._plans[pk] = plan
        return plan

    def _run_fast(self, link: LinkView, plan: "QuickPlan", rec: Any, src_blocks: Any, dst_blocks: Any,
                  kind: str) -> bool:
        """The planned shape's bytes in one call of the channel's own path (the shm plugin's C
        function, the tcp and ucx plugins' few-ops paths; issue 21), under the link's transfer lock as
        ``TransferEngine.run_ops``; True when done.  A transfer the channel started and that failed
        raises the contract's error, as the ops path would (its task made and ended then).

        Taken only while nobody listens to task events and no hook wraps transfers (the task's
        create / start / succeeded are then counted at once, as ``run_ops`` leaves them). False,
        with nothing counted and the lock released, when the channel did not do it (a table changed
        since the plan, a block the planner decides, the owner holding its lock, an error): the
        caller then takes the ops path, which does the transfer or reports the error as it would."""
        fast = plan.fast   # another thread may replace it (see below)
        if (fast is None or link.channel is not plan.chan or not self._hooks.runs_transfers_directly()
                or not self._tasks.quiet()):
            return False
        self._busy.acquire(link)
        try:
            try:
                moved = fast(src_blocks, dst_blocks)
            except TransportError as exc:
                # started and failed: the task, the errors and the owner's notice of the ops path
                task = self._tasks.create(self._transfers.next_task_id(), kind=kind, peer=link.peer_cluster_id)
                task.fire("start", bytes=len(dst_blocks) * plan.per_block)
                err = self._transfers.local_outcome(rec, self._transfers.ops_failed(link, exc, kind, task), kind)
                if plan.push:
                    self._notices.push_done(link, plan.cache_id, dst_blocks, plan.dst_tensors, failed=True)
                raise err from None
            if moved >= 0:
                self._tasks.count_quiet(_TASK_DONE)
                if plan.push:
                    self._lm.record_transfer(link, written=moved)
                else:
                    self._lm.record_transfer(link, read=moved)
                    if not rec.live:   # unregistered while the bytes moved: the caller's cache is gone
                        raise self._transfers.local_outcome(rec, None, kind)
        finally:
            link.transfer_lock.release()
        if moved < 0:
            plan.fast = fast_for(link, plan, self._transfers.timeout_s)   # on the tables of now (None: not this shape); no lock held
            return False
        return True

    def _memo_plan(self, memo: Optional[tuple], key: Any, cache: Any, src_layer_range: Any, dst_layer_range: Any,
                   tnpl: int) -> Optional["QuickPlan"]:
        """The plan of the last small transfer in this direction when this call names the same key,
        cache and range objects (immutable, and held by the memo: identity stands for equality) and
        that plan is still what :meth:`_quick_plan` would return (same live record and regions; the
        link still the cluster's and LINKED, same tables and versions, same channel); else None."""
        if (memo is None or memo[0] is not key or memo[1] is not cache or memo[2] is not src_layer_range
                or memo[3] is not dst_layer_range or memo[4] != tnpl):
            return None
        plan: QuickPlan = memo[5]
        rec, link = plan.rec, plan.link
        tables = link.tables
        if (self._memory.get(cache.cache_id) is rec and rec.live and rec.regions is plan.regions
                and link.linked and tables is plan.tables
                and tables.cache_table_version == plan.cv and tables.regions_version == plan.rv
                and plan.fast is not None and link.channel is plan.chan
                and self._lm.get(key.cluster_id) is link):
            return plan
        return None

    def pull_blocks_quick(self, key: Any, cache: Any, src_blocks: Any, dst_blocks: Any, src_layer_range: Any,
                          dst_layer_range: Any, tnpl: int) -> None:
        """:meth:`pull` of kind ``pull_blocks`` for a ``BlocksCacheKey`` without a tag; the caller
        checked the arguments (lists of ints, equal non-zero lengths)."""
        plan = self._memo_plan(self._memo_pull, key, cache, src_layer_range, dst_layer_range, tnpl)
        if plan is not None and self._run_fast(plan.link, plan, plan.rec, src_blocks, dst_blocks, "pull_blocks"):
            self._notices.queue(plan.link, (READ, plan.cache_id, tuple(src_blocks)))
            return
        rec = self._memory.get(cache.cache_id)
        plan = None
        if rec is not None and rec.live:
            link = self._transfers.link_for(key.cluster_id)
            plan = self._quick_plan(False, link, rec, key, src_layer_range, dst_layer_range, tnpl)
            if plan is not None and plan.fast is not None:
                self._memo_pull = (key, cache, src_layer_range, dst_layer_range, tnpl, plan)
        if plan is None or rec is None:   # (a plan is made only for a live record)
            self._transfers.pull(key, cache, kind="pull_blocks", src_blocks=src_blocks, dst_blocks=dst_blocks,
                      src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)
            return
        if plan.fast is not None and self._run_fast(link, plan, rec, src_blocks, dst_blocks, "pull_blocks"):
            self._notices.queue(link, (READ, plan.cache_id, tuple(src_blocks)))
            return
        ops, nbytes = plan.ops(src_blocks, dst_blocks)
        self._busy.acquire(link)
        try:
            try:
                self._transfers.run_ops(link, ops, write=False, kind="pull_blocks", nbytes=nbytes)
            except LLMException as exc:
                raise self._transfers.local_outcome(rec, exc, "pull_blocks") from None
            if not rec.live:   # unregistered while the ops ran: the caller's cache is gone
                raise self._transfers.local_outcome(rec, None, "pull_blocks")
        finally:
            link.transfer_lock.release()
        self._notices.queue(link, (READ, plan.cache_id, tuple(src_blocks)))

    def push_blocks_quick(self, key: Any, cache: Any, src_blocks: Any, dst_blocks: Any, src_layer_range: Any,
                          dst_layer_range: Any, tnpl: int) -> None:
        """:meth:`push` of kind ``push_blocks`` for a ``BlocksCacheKey`` without a tag; the caller
        checked the arguments (lists of ints, equal non-zero lengths, non-empty layer ranges)."""
        plan = self._memo_plan(self._memo_push, key, cache, src_layer_range, dst_layer_range, tnpl)
        if plan is not None and self._run_fast(plan.link, plan, plan.rec, src_blocks, dst_blocks, "push_blocks"):
            self._notices.push_done(plan.link, plan.cache_id, dst_blocks, plan.dst_tensors, failed=False)
            return
        rec = self._memory.get(cache.cache_id)
        plan = None
        if rec is not None and rec.live:
            link = self._transfers.link_for(key.cluster_id)
            plan = self._quick_plan(True, link, rec, key, src_layer_range, dst_layer_range, tnpl)
            if plan is not None and plan.fast is not None:
                self._memo_push = (key, cache, src_layer_range, dst_layer_range, tnpl, plan)
        if plan is None:
            self._transfers.push(key, cache, kind="push_blocks", src_blocks=src_blocks, dst_blocks=dst_blocks,
                      src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)
            return
        if plan.fast is not None and self._run_fast(link, plan, rec, src_blocks, dst_blocks, "push_blocks"):
            self._notices.push_done(link, plan.cache_id, dst_blocks, plan.dst_tensors, failed=False)
            return
        ops, nbytes = plan.ops(src_blocks, dst_blocks)
        dt = plan.dst_tensors
        self._busy.acquire(link)
        try:
            try:
                self._transfers.run_ops(link, ops, write=True, kind="push_blocks", nbytes=nbytes)
            except LLMException as exc:
                err = self._transfers.local_outcome(rec, exc, "push_blocks")
                self._notices.push_done(link, plan.cache_id, dst_blocks, dt, failed=True)
                raise err from None
        finally:
            link.transfer_lock.release()
        self._notices.push_done(link, plan.cache_id, dst_blocks, dt, failed=False)
