"""The data plane: resolves keys against the peer's tables, plans ops, runs tasks.

Every pull, push and async transfer is a task of the task lifecycle
(CREATED -> [WAITING] -> RUNNING -> COMPLETED | FAILED | TIMED_OUT | CANCELLED). A
byte-moving step has the deadline ``sync_kv_timeout`` counted from its start; a
blocking call returns by that deadline whatever the peer does, because the
transport's completion promise says no byte lands after ``wait`` reported an error.

No hook, log line or Python object per block: the planner builds numpy op arrays,
the transport moves them, and one event is emitted per task transition (per layer
for layer-wise transfers).

:class:`TransferEngine` runs a pull, push or async transfer from the call to moved bytes; its
parts, each a module of one concept built here with its typed dependencies: the cache layouts
and placement rules (:mod:`~llmdd._data.layouts`), which links its transfers hold
(:mod:`~llmdd._data.busy`), the batched notices to owners (:mod:`~llmdd._data.notices`), the
plans of small block transfers that ``pull`` / ``push`` try first (:mod:`~llmdd._data.prepared`),
this engine as the owner of its caches (:mod:`~llmdd._data.owner`) and the async tasks
(:mod:`~llmdd._data.tasks`).
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from llmdd._base.status import TransportError
from llmdd._seam.errors import Cancelled, PeerGone, Refused, TransportTimeout
from llmdd._base.lazy import np
from llmdd._base.log import get_logger
from llmdd._data.planner import CacheLayout, plan_blocks, plan_cache, plan_contiguous_to_blocks, plan_to_addresses, tensor_range
from llmdd._base.options import EngineOptions
from llmdd._extension.manager import Hooks
from llmdd._protocol.port import ControlPort, DataNotice, LinkView, RequestOp
from llmdd._protocol import messages as m
from llmdd._runtime.runtime import Executor, PoolFull, Threads
from llmdd._runtime.threads import SYSTEM
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._data.busy import BusyTable
from llmdd._data.fence import BlockFence, FencedPulls, check_args
from llmdd._data.layouts import Layouts, RemoteKey
from llmdd._data.notices import READ, OwnerNotices, block_spans
from llmdd._data.owner import OwnerSide
from llmdd._data.prepared import PREPARED_MAX_BLOCKS, PreparedPlan, PreparedPlans
from llmdd._data.tasks import AsyncPull, AsyncTransfer, TransferTimedOut
from llmdd._base.types import (
    BlocksCacheKey, Cache, CacheKey, KvCache, LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig,
    cache_key_index,
)

if TYPE_CHECKING:
    from llmdd._lifecycle.machines import Lifecycle, Tracked
    from llmdd._memory.manager import CacheRecord, MemoryManager
    from llmdd._base.profiles import ChipProfile

__all__ = ["TransferEngine", "AsyncTransfer"]

_log = get_logger("llmdd.transfer")
S = LLMStatusCode

#: a tag as it travels (at most messages.MAX_TAG_BYTES): its bytes, and whether it was given as str
Tag = tuple
#: a local cache a transfer reads or fills (the v2 ``Cache`` or the v1 ``KvCache``: its cache id is what counts)
LocalCache = Union[Cache, KvCache]
#: one ``transfer_cache_async`` destination: raw addresses or a peer's cache key
AsyncConfig = Union[TransferConfig, TransferWithCacheKeyConfig]
#: workers running non-blocking pulls (per engine), and how many may be waiting or running at once
ASYNC_PULL_WORKERS = 4
#: the task triggers of a blocking transfer that succeeded (run_ops: start, transfer_succeeded)
_TASK_DONE = ("start", "transfer_succeeded")
MAX_ASYNC_PULLS = 4096


def _err(msg: str, code: LLMStatusCode) -> LLMException:
    return LLMException(msg, status_code=code)


def _one_slot(layout: CacheLayout, *, whole: bool) -> CacheLayout:
    """A blocks cache seen as a cache of one batch slot, as upstream's cache table describes it
    (batch size 1): the slot is one block on the sending side (``whole`` False: what a
    cache-to-cache step copies) or the whole tensor (``whole`` True: the room it may fill).
    A non-blocks layout is returned as is."""
    if not layout.is_blocks:
        return layout
    size = layout.tensor_size if whole else layout.unit_size
    return CacheLayout(cache_id=layout.cache_id, region_ids=layout.region_ids, tensor_size=size, units=1,
                       is_blocks=False)


class TransferEngine:
    """Pulls and pushes of one engine."""

    def __init__(self, *, port: ControlPort, memory: "MemoryManager", tasks: "Lifecycle", hooks: Hooks,
                 options: EngineOptions, profile: "ChipProfile", runtime: Threads = SYSTEM) -> None:
        self._lm = port
        self.runtime = runtime
        self._clock = runtime.monotonic   # every deadline's clock
        self._memory = memory
        self._tasks = tasks
        self._hooks = hooks
        self._options = options
        self._profile = profile
        self.timeout_s = options.sync_kv_timeout_ms / 1000.0
        self._ids = itertools.count(1)
        self.layouts = Layouts(port=port, memory=memory, options=options, timeout_s=self.timeout_s,
                               clock=runtime.monotonic)
        self._busy = BusyTable(port=port, timeout_s=self.timeout_s)
        self._notices = OwnerNotices(port=port, timeout_s=self.timeout_s, runtime=runtime)
        self.prepared = PreparedPlans(port=port, memory=memory, layouts=self.layouts, busy=self._busy,
                                      timeout_s=self.timeout_s)
        self._async: set = set()
        self._pulls_lock = threading.Lock()   # the non-blocking pulls' accounting (a leaf)
        self._closed = False
        self._pull_pool: Optional[Executor] = None   # the workers of non-blocking pulls, started on first use
        self._async_pulls = 0         # non-blocking pulls waiting or running (under _pulls_lock)
        self.owner = OwnerSide(port=port, memory=memory, options=options, profile=profile)
        self.fenced = FencedPulls(port, self.timeout_s, clock=runtime.monotonic)   # fenced pulls' check after the copy (llmdd._data.fence)

    # ------------------------------------------------------------------ the DataService side of the port
    # what peers ask of this engine as the owner of its caches is llmdd._data.owner's
    def serve(self, link: LinkView, op: RequestOp, args: dict) -> tuple[int, dict]:
        """A peer's data request (llmdd._protocol.port.DataService)."""
        return self.owner.serve(link, op, args)

    def serve_tagged(self, link: LinkView, message: m.TaggedDone) -> tuple[int, dict]:
        """A peer's tagged transfer on one of this engine's caches ended (acknowledged by the reply)."""
        return self.owner.serve_tagged(link, message)

    def on_notice(self, link: LinkView, message: DataNotice) -> None:
        """A one-way notice of the peer's data plane (refused ones answered with an Error message)."""
        self.owner.on_notice(link, message)

    # ------------------------------------------------------------------ layouts (Layouts)
    def local_layout(self, cache_id: int) -> tuple["CacheRecord", CacheLayout]:
        return self.layouts.local_layout(cache_id)

    def remote_layout(self, link: LinkView, cache_id: int) -> CacheLayout:
        return self.layouts.remote_layout(link, cache_id)

    # ------------------------------------------------------------------ running a task
    def link_for(self, cluster_id: int) -> LinkView:
        """The LINKED link to ``cluster_id`` with its data channel, or the contract's error."""
        link = self._lm.require(cluster_id)
        if link.channel is None:
            raise _err(f"link to cluster {cluster_id} has no data channel", S.LLM_NOT_YET_LINK)
        return link

    # ------------------------------------------------------------------ a link's transfers (BusyTable)
    def claim_links(self, links: list) -> None:
        """An async task takes ``links`` (all or none): LLM_LINK_BUSY while another task or an unlink has one."""
        self._busy.claim_links(links)

    def release_links(self, links: list) -> None:
        self._busy.release_links(links)

    def quiesce(self, link: LinkView, unlink: Callable[[], None]) -> bool:
        """llmdd._protocol.port.DataService: True when no transfer ran on ``link`` and ``unlink()`` took it out
        of use before any could start; False while one runs (the unlink answers LLM_LINK_BUSY)."""
        return self._busy.quiesce(link, unlink)

    def run_ops(self, link: LinkView, ops: np.ndarray, *, write: bool, kind: str, step_of: Optional["Tracked"] = None,
                nbytes: Optional[int] = None) -> None:
        """Move ``ops`` over ``link`` as one task with the sync_kv_timeout deadline (``nbytes``: the
        ops' total length when the caller knows it).  With ``step_of`` the ops are one step of that
        running task: its owner fires the task's transitions, this only raises (a timeout as
        :class:`TransferTimedOut`)."""
        if nbytes is None:
            n_ops = len(ops)
            nbytes = (sum(ops["length"].tolist()) if n_ops <= 8 else int(ops["length"].sum())) if n_ops else 0
        own_task = step_of is None
        if step_of is None:
            task = self._tasks.create(next(self._ids), kind=kind, peer=link.peer_cluster_id)
            task.fire("start", bytes=nbytes)
        else:
            task = step_of
        try:
            if len(ops):
                if self._hooks.runs_transfers_directly():
                    self._move(link, ops, write)
                else:
                    self._hooks.run_transfer(task, functools.partial(self._move, link, ops, write))
        except TransportError as exc:
            raise self.ops_failed(link, exc, kind, task if own_task else None) from None
        except BaseException as exc:
            if own_task:   # a hook that raised after the task ended: the table absorbs it
                task.offer("transfer_failed", error=exc)
            raise
        if write:
            self._lm.record_transfer(link, written=nbytes)
        else:
            self._lm.record_transfer(link, read=nbytes)
        if own_task:
            task.fire("transfer_succeeded", bytes=nbytes)

    def next_task_id(self) -> int:
        """A new transfer task id (tasks of this engine are numbered from 1)."""
        return next(self._ids)

    def ops_failed(self, link: LinkView, exc: TransportError, kind: str,
                   task: Optional["Tracked"] = None) -> LLMException:
        """What a transport failure of ``kind`` over ``link`` means, done and returned as the contract's
        error to raise: the link's failed-transfer count, ``task``'s end (when the caller owns one),
        and for a timeout, a lost peer or an untrustworthy channel the link's failure."""
        self._lm.record_transfer(link, failed=True)
        if isinstance(exc, TransportTimeout):
            if task is not None:
                task.fire("deadline_expired", error=exc)
            self._lm.transfer_timed_out(link, exc)
            return TransferTimedOut(f"{kind} to cluster {link.peer_cluster_id} timed out: {exc}; the link must be "
                                    "relinked", status_code=S.LLM_TIMEOUT)
        if task is not None:
            task.fire("transfer_failed", error=exc)
        if isinstance(exc, (PeerGone, Cancelled)):
            if isinstance(exc, PeerGone):
                self._lm.fail_link(link, exc)
                code = S.LLM_LINK_FAILED
            elif not link.in_use:
                # cancelled because the link went down under it (peer lost, force unlink, finalize):
                # report why the link is gone, not a generic failure
                code = link.failure_status or S.LLM_LINK_FAILED
            else:
                code = exc.status_code
            return _err(f"{kind} with cluster {link.peer_cluster_id} failed: {exc}", code)
        if isinstance(exc, Refused):
            return _err(f"{kind} refused by cluster {link.peer_cluster_id}: {exc}", exc.status_code)
        # Corrupt & co: the data channel can no longer be trusted
        self._lm.fail_link(link, exc, status=exc.status_code)
        return _err(f"{kind} with cluster {link.peer_cluster_id} failed: {exc}; the link must be relinked",
                    exc.status_code)

    def _move(self, link: LinkView, ops: np.ndarray, write: bool) -> None:
        """One step's bytes over ``link``'s data channel, by the sync_kv_timeout deadline."""
        deadline = self._clock() + self.timeout_s
        channel = link.channel
        if channel is None:
            raise PeerGone("the link has no data channel any more")
        completion = (channel.write if write else channel.read)(ops, deadline=deadline)
        # the seam's batch contract (llmdd/_seam/abc.py): refusals and failures are the completion's
        # error, and the transport finishes the batch by its deadline (TransportTimeout, drained), so a
        # wait without a limit of ours returns by then; no deadline arithmetic or cancel here
        completion.wait()
        if completion.error is not None:
            raise completion.error

    # ------------------------------------------------------------------ prepared transfers (PreparedPlans)
    def _run_prepared(self, plan: PreparedPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                      kind: str) -> bool:
        """The planned shape's bytes in one call of the channel's prepared transfer (the seam's
        ``Channel.prepare``), in the link's turn as :meth:`run_ops`, then the owner's notice (a pull's
        queued read-done, a push's push-done); True when done.  A transfer the channel started and
        that failed raises the contract's error, as the ops path would (its task made and ended then).

        Taken only while nobody listens to task events and no hook wraps transfers (the task's
        create / start / succeeded are then counted at once, as ``run_ops`` leaves them).  False,
        with nothing counted, when there is no prepared transfer or it did not do the transfer (a
        table changed since it was made, a block the planner decides, the owner holding its lock):
        the caller then runs the plan's ops (:meth:`_run_plan_ops`), which do the transfer or report
        the error as they would."""
        prepared = plan.prepared   # another thread may replace it (below)
        if prepared is None or not self._hooks.runs_transfers_directly() or not self._tasks.quiet():
            return False
        link, rec = plan.link, plan.rec
        with plan.turn:
            try:
                moved = prepared(src_blocks, dst_blocks)
            except TransportError as exc:
                # started and failed: the task, the errors and the owner's notice of the ops path
                task = self._tasks.create(next(self._ids), kind=kind, peer=link.peer_cluster_id)
                task.fire("start", bytes=len(dst_blocks) * plan.per_block)
                err = self.local_outcome(rec, self.ops_failed(link, exc, kind, task), kind)
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
                        raise self.local_outcome(rec, None, kind)
        if moved < 0:
            self.prepared.prepare(plan)   # on the tables of now (None: not this shape); no lock held
            return False
        if plan.push:
            self._notices.push_done(link, plan.cache_id, dst_blocks, plan.dst_tensors, failed=False)
        else:
            self._notices.queue(link, (READ, plan.cache_id, tuple(src_blocks)))
        return True

    def _run_plan_ops(self, plan: PreparedPlan, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                      kind: str) -> None:
        """A small pull or push by its plan's ops (no prepared transfer did it), then the owner's notice."""
        ops, nbytes = plan.ops(src_blocks, dst_blocks)
        if plan.push:
            self._write(plan.link, plan.rec, ops, kind, plan.cache_id, dst_blocks, plan.dst_tensors, nbytes=nbytes)
        else:
            self._read(plan.link, plan.rec, ops, kind, nbytes=nbytes)
            self._notices.queue(plan.link, (READ, plan.cache_id, tuple(src_blocks)))

    # ------------------------------------------------------------------ pulls
    def pull(self, key: RemoteKey, cache: LocalCache, *, kind: str, batch_index: int = 0, size: int = -1,
             src_blocks: Optional[Sequence[int]] = None, dst_blocks: Optional[Sequence[int]] = None,
             src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
             tnpl: int = 2, tag: Optional[Tag] = None, fence: Optional[BlockFence] = None) -> None:
        if (tag is None and fence is None and src_blocks and dst_blocks and len(dst_blocks) <= PREPARED_MAX_BLOCKS
                and kind == "pull_blocks" and type(key) is BlocksCacheKey):
            plan = self.prepared.lookup(False, key, cache, src_layer_range, dst_layer_range, tnpl)
            if plan is not None:
                if not self._run_prepared(plan, src_blocks, dst_blocks, kind):
                    self._run_plan_ops(plan, src_blocks, dst_blocks, kind)
                return
        rec, dst = self.local_layout(cache.cache_id)
        link = self.link_for(key.cluster_id)
        reserved = None
        if isinstance(key, CacheKey):
            index = cache_key_index(key)
            try:
                status, result = self._lm.request(link, RequestOp.RESERVE_KEY,
                                                  {"id": int(index[0]), "model_id": int(index[1])},
                                                  deadline=self._clock() + self.timeout_s)
            except LLMException as exc:
                # the owner may still reserve the key after we gave up: tell it to put the key back
                self._lm.notify(link, m.ReleaseKey(id=int(index[0]), model_id=int(index[1])))
                if exc.status_code is S.LLM_TIMEOUT:  # the owner did not answer within sync_kv_timeout:
                    self._lm.record_transfer(link, failed=True)   # the link is unusable until relinked
                    self._lm.transfer_timed_out(link, exc)
                raise
            if status != 0:
                raise _err(f"cache key {key} does not exist on cluster {key.cluster_id}",
                           S.LLM_KV_CACHE_NOT_EXIST if status == S.LLM_KV_CACHE_NOT_EXIST.value else S.LLM_FAILED)
            cache_id, src_unit = int(result["cache_id"]), int(result["batch_index"])
            reserved = index
        else:
            cache_id, src_unit = self.layouts.resolve_remote(link, key)
        pulled = False
        src_tensors = None
        try:
            src = self.remote_layout(link, cache_id)   # unknown there: no cache to tell about it
            spans: tuple = ()
            try:
                self.layouts.check_placements(link, remote_cache_id=cache_id, local_rec=rec, local_is="dst", kind=kind,
                                       remote_is_blocks=src.is_blocks)
                src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
                dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
                if kind == "pull_cache":
                    ops = plan_cache(src=src, dst=dst, src_tensors=src_tensors, dst_tensors=dst_tensors,
                                     src_unit=src_unit, dst_unit=batch_index, size=size, local="dst")
                elif src.is_blocks:
                    if isinstance(key, BlocksCacheKey) or src_blocks:
                        ops = plan_blocks(src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
                                          src_tensors=src_tensors, dst_tensors=dst_tensors, local="dst")
                    else:
                        raise _err("src_blocks must be given to pull from a blocks cache", S.LLM_PARAM_INVALID)
                else:
                    ops = plan_contiguous_to_blocks(src=src, dst=dst, src_unit=src_unit, dst_blocks=dst_blocks,
                                                    src_tensors=src_tensors, dst_tensors=dst_tensors, local="dst")
                spans = block_spans(src_blocks) if src_blocks else ()   # inside the owner's cache: planned
                check = None if fence is None else check_args(cache_id, src_blocks, fence, blocks=src.is_blocks)
            except LLMException as exc:
                # the owner's cache is known but nothing was read (a refused plan): a tagged pull still
                # ends with one failure event for its tag (best effort)
                if tag is not None:
                    self._tag_notice(link, "read_done", cache_id, spans, tag, exc)
                raise
            self._read(link, rec, ops, kind, tag=tag, cache_id=cache_id, spans=spans, fence=check)
            pulled = True
        finally:
            if reserved is not None:
                if pulled:
                    if src_tensors is None:   # pulled is set only after the ranges were planned
                        raise _err("internal error: a completed pull without its tensor range", S.LLM_FAILED)
                    # acknowledged, so that when pull_cache returns the owner's key table is final
                    # (a layer-wise pull leaves the key for the remaining layers, a full one removes it)
                    try:
                        self._lm.request(link, RequestOp.CONSUME_KEY, {
                            "id": int(reserved[0]), "model_id": int(reserved[1]), "cache_id": int(cache_id),
                            "tensors": [src_tensors.start, src_tensors.stop]},
                            deadline=self._clock() + self.timeout_s)
                    except LLMException as exc:  # the bytes are here; the owner will learn on relink
                        _log.warning("llmdd.transfer.consume_key_failed", peer=link.peer_cluster_id,
                                     error=str(exc))
                else:
                    self._lm.notify(link, m.ReleaseKey(id=int(reserved[0]), model_id=int(reserved[1])))
        if pulled and tag is None:   # a tagged pull's notice was delivered (acknowledged) above
            self._notices.queue(link, (READ, cache_id, tuple(src_blocks) if src_blocks else None))

    def _read(self, link: LinkView, rec: "CacheRecord", ops: np.ndarray, kind: str, *, nbytes: Optional[int] = None,
              tag: Optional[Tag] = None, cache_id: int = 0, spans: tuple = (), fence: Optional[dict] = None) -> None:
        """A pull's ops in the link's turn; its local cache gone meanwhile: ``LLM_KV_CACHE_NOT_EXIST``.
        A tagged pull's one notice (success or failure, with ``cache_id`` and ``spans``) goes to the
        owner in the turn, so tags reach it in the order their transfers completed; acknowledged
        before this returns (a failure's best effort).  A fenced pull (``fence``: its check's
        arguments) is checked with the owner after the copy, before its success is reported."""
        turned = False
        try:
            with self._busy.turn(link):
                turned = True
                err: Optional[LLMException] = None
                try:
                    self.run_ops(link, ops, write=False, kind=kind, nbytes=nbytes)
                except LLMException as exc:
                    err = self.local_outcome(rec, exc, kind)
                if err is None and not rec.live:   # unregistered while the ops ran: the caller's cache is gone
                    err = self.local_outcome(rec, None, kind)
                if err is None and fence is not None:   # the owner still holds the generations read
                    err = self.fenced.failure(link, fence)
                if tag is not None:   # the one notice of a tagged pull, its outcome's
                    self._tag_notice(link, "read_done", cache_id, spans, tag, err)
                if err is not None:
                    raise err
        except LLMException as exc:
            if not turned and tag is not None:   # no turn (a busy or lost link): nothing was read
                self._tag_notice(link, "read_done", cache_id, spans, tag, exc)
            raise

    def notify_owner(self, key: BlocksCacheKey, notes: list) -> None:
        """Short notes to the owner of ``key``'s cache (its ``peer_note`` event), acknowledged."""
        link = self.link_for(key.cluster_id)
        cache_id, _ = self.layouts.resolve_remote(link, key)
        self.fenced.notify(link, cache_id, notes)

    # ------------------------------------------------------------------ pushes
    def push(self, key: RemoteKey, cache: LocalCache, *, kind: str, src_batch_index: int = 0,
             src_blocks: Optional[Sequence[int]] = None, dst_blocks: Optional[Sequence[int]] = None,
             src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
             tnpl: int = 2, tag: Optional[Tag] = None) -> None:
        if (tag is None and src_blocks and dst_blocks and len(dst_blocks) <= PREPARED_MAX_BLOCKS
                and kind == "push_blocks" and type(key) is BlocksCacheKey):
            plan = self.prepared.lookup(True, key, cache, src_layer_range, dst_layer_range, tnpl)
            if plan is not None:
                if not self._run_prepared(plan, src_blocks, dst_blocks, kind):
                    self._run_plan_ops(plan, src_blocks, dst_blocks, kind)
                return
        rec, src = self.local_layout(cache.cache_id)
        link = self.link_for(key.cluster_id)
        cache_id, dst_unit = self.layouts.resolve_remote(link, key)
        dst = self.remote_layout(link, cache_id)   # unknown there: no cache to tell about it
        spans: tuple = ()
        dst_tensors = None
        try:
            self.layouts.check_placements(link, remote_cache_id=cache_id, local_rec=rec, local_is="src", kind=kind,
                                   remote_is_blocks=dst.is_blocks)
            src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
            dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
            if kind == "push_cache":
                ops = plan_cache(src=src, dst=dst, src_tensors=src_tensors, dst_tensors=dst_tensors,
                                 src_unit=src_batch_index, dst_unit=dst_unit, size=-1, local="src")
            else:
                ops = plan_blocks(src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
                                  src_tensors=src_tensors, dst_tensors=dst_tensors, local="src")
            spans = block_spans(dst_blocks) if dst_blocks else ()   # inside the owner's cache: planned
        except LLMException as exc:
            # the owner's cache is known but nothing was written (a refused plan): a tagged push still
            # ends with one failure event for its tag (best effort)
            if tag is not None:
                self._tag_notice(link, "push_done", cache_id, spans, tag, exc, tensors=dst_tensors)
            raise
        self._write(link, rec, ops, kind, cache_id, dst_blocks, dst_tensors, tag=tag, spans=spans)

    def _write(self, link: LinkView, rec: "CacheRecord", ops: np.ndarray, kind: str, cache_id: int,
               dst_blocks: Optional[Sequence[int]], dst_tensors: range, *, nbytes: Optional[int] = None,
               tag: Optional[Tag] = None, spans: tuple = ()) -> None:
        """A push's ops in the link's turn, then the owner's notice: an untagged push's batched
        push-done (failed or not), a tagged push's one acknowledged notice sent in the turn (see
        :meth:`_read`)."""
        turned = False
        try:
            with self._busy.turn(link):
                turned = True
                try:
                    self.run_ops(link, ops, write=True, kind=kind, nbytes=nbytes)
                except LLMException as exc:
                    err = self.local_outcome(rec, exc, kind)
                    if tag is not None:
                        self._tag_notice(link, "push_done", cache_id, spans, tag, err, tensors=dst_tensors)
                    else:
                        self._notices.push_done(link, cache_id, dst_blocks, dst_tensors, failed=True)
                    raise err from None
                if tag is not None:
                    self._tag_notice(link, "push_done", cache_id, spans, tag, None, tensors=dst_tensors)
        except LLMException as exc:
            if not turned and tag is not None:   # no turn (a busy or lost link): nothing was written
                self._tag_notice(link, "push_done", cache_id, spans, tag, exc, tensors=dst_tensors)
            raise
        if tag is None:
            self._notices.push_done(link, cache_id, dst_blocks, dst_tensors, failed=False)

    # ------------------------------------------------------------------ transfers by cache id (the C++ API)
    def move(self, *, write: bool, blocks: bool, local_id: int, cluster_id: int, remote_id: int,
             local_unit: int = 0, remote_unit: int = 0, size: int = -1,
             local_blocks: Optional[Sequence[int]] = None, remote_blocks: Optional[Sequence[int]] = None,
             src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
             tnpl: int = 2) -> None:
        """A pull (``write`` False) or push between local cache ``local_id`` and the peer's cache
        ``remote_id``, named by id as the C++ API names caches, planned as the call asks (``blocks``:
        a block transfer, else a batch-slot one) over the geometry of both caches' tables (upstream's
        "mix" caches, :meth:`CacheLayout.as_kind`).  A small block transfer takes its plan
        (:meth:`PreparedPlans.lookup_by_id`) as :meth:`pull` / :meth:`push` do; the rest the same
        steps, checks, errors and owner notices."""
        kind = ("push_blocks" if write else "pull_blocks") if blocks else ("push_cache" if write else "pull_cache")
        sb, db = (local_blocks, remote_blocks) if write else (remote_blocks, local_blocks)
        if blocks and sb and db and len(db) <= PREPARED_MAX_BLOCKS:
            plan = self.prepared.lookup_by_id(write, cluster_id, local_id, remote_id, src_layer_range,
                                              dst_layer_range, tnpl)
            if plan is not None:
                if not self._run_prepared(plan, sb, db, kind):
                    self._run_plan_ops(plan, sb, db, kind)
                return
        rec, local = self.local_layout(local_id)
        link = self.link_for(cluster_id)
        remote = self._fresh_remote_layout(link, remote_id)
        self.layouts.check_placements(link, remote_cache_id=remote_id, local_rec=rec,
                                      local_is="src" if write else "dst", kind=kind,
                                      remote_is_blocks=True if blocks else remote.is_blocks)
        local, remote = local.as_kind(blocks), remote.as_kind(blocks)
        src, dst = (local, remote) if write else (remote, local)
        src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
        dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
        side = "src" if write else "dst"
        if blocks:
            ops = plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=src_tensors,
                              dst_tensors=dst_tensors, local=side)
        else:
            su, du = (local_unit, remote_unit) if write else (remote_unit, local_unit)
            ops = plan_cache(src=src, dst=dst, src_tensors=src_tensors, dst_tensors=dst_tensors, src_unit=su,
                             dst_unit=du, size=size, local=side)
        if write:
            self._write(link, rec, ops, kind, remote_id, remote_blocks, dst_tensors)
        else:
            self._read(link, rec, ops, kind)
            self._notices.queue(link, (READ, int(remote_id), tuple(remote_blocks) if remote_blocks else None))

    def _fresh_remote_layout(self, link: LinkView, cache_id: int) -> CacheLayout:
        """The peer's cache ``cache_id`` from its announced tables.  A cache the peer made after the
        link reaches this side in an update that may still be on its way: on a miss, one round trip
        with the peer (its answer follows every update it sent before) and a second look."""
        try:
            return self.remote_layout(link, cache_id)
        except LLMException as exc:
            if exc.status_code is not S.LLM_KV_CACHE_NOT_EXIST:
                raise
        self._lm.request(link, RequestOp.ENGINE_INFO, {}, deadline=self._clock() + self.timeout_s)
        return self.remote_layout(link, cache_id)

    @staticmethod
    def local_outcome(rec: "CacheRecord", exc: Optional[LLMException], kind: str) -> LLMException:
        """The error of a transfer whose ops failed (``exc``) or that ran while its local cache went.

        A local cache unregistered (or deallocated) while the transfer ran ends it with
        ``LLM_KV_CACHE_NOT_EXIST``, the status of any call naming a cache that does not exist: the
        caller may register again and retry (the link is fine).  Registration removal drains the
        transports' ops on that memory first, so no byte lands once the call has returned."""
        if rec.live:
            assert exc is not None
            return exc
        return _err(f"{kind}: local cache {rec.cache_id} was unregistered while the transfer ran",
                    S.LLM_KV_CACHE_NOT_EXIST)

    def _tag_notice(self, link: LinkView, op: str, cache_id: int, spans: tuple, tag: Tag, error: Optional[LLMException],
                    *, tensors: Optional[range] = None) -> None:
        """Tell the owner that a tagged transfer ended, and wait for its acknowledgement.

        The owner fires its "peer finished reading" (``read_done``) or "peer finished writing"
        (``push_done``) cache event with the tag once per transfer: on success with the spans, on
        failure with the error.  No acknowledgement within sync_kv_timeout: the link is unusable
        (as any timed-out step) and a successful transfer reports ``LLM_TIMEOUT``, since the owner
        may not have learnt it; a failure's notice is best effort (the link may be what failed)."""
        self._notices.flush_link(link)   # the untagged transfers' notices before this one (the owner sees them first)
        entry = m.TransferDone(cache_id=int(cache_id), block_spans=tuple(spans),
                               tensors=None if tensors is None else m.Span(start=tensors.start, stop=tensors.stop),
                               failed=error is not None, status=int(error.status_code.value) if error is not None else 0,
                               tag=tag[0], tag_str=tag[1])
        try:
            status, result = self._lm.ask(link, m.TaggedDone(request_id=0, push=op == "push_done", entry=entry),
                                          deadline=self._clock() + self.timeout_s)
        except LLMException as exc:
            if error is not None:
                return
            if exc.status_code is S.LLM_TIMEOUT:
                self._lm.record_transfer(link, failed=True)
                self._lm.transfer_timed_out(link, exc)
            raise _err(f"the transfer completed but cluster {link.peer_cluster_id} did not acknowledge its tag: "
                       f"{exc}", exc.status_code) from None
        if status != 0 and error is None:
            raise _err(f"cluster {link.peer_cluster_id} refused the tag of the transfer: "
                       f"{result.get('error', status)}", S.LLM_PARAM_INVALID)

    # ------------------------------------------------------------------ layer-wise async transfer
    def transfer_async(self, cache: LocalCache, synchronizer: LayerSynchronizer, configs: Sequence[AsyncConfig], *,
                       src_block_indices: Optional[Sequence[int]], dst_block_indices: Optional[Sequence[int]],
                       dst_block_memory_size: Optional[int]) -> "AsyncTransfer":
        rec, src = self.local_layout(cache.cache_id)
        task = AsyncTransfer(self, rec, src, synchronizer, list(configs), src_block_indices,
                             dst_block_indices, dst_block_memory_size,
                             task=self._tasks.create(next(self._ids), kind="transfer_cache_async",
                                                     configs=len(configs)))
        self._async.add(task)
        task.start()
        return task

    def plan_async_config(self, link: LinkView, src: CacheLayout, config: AsyncConfig, layer: int, *,
                          src_blocks, dst_blocks, dst_block_size) -> np.ndarray:
        """Ops of one layer of one config (2 tensors per layer, as upstream hard-codes)."""
        src_tensors = range(layer * 2, layer * 2 + 2)
        if isinstance(config, TransferWithCacheKeyConfig):
            dst_layer = config.dst_layer_range.start + (layer - config.src_layer_range.start)
            dst_tensors = range(dst_layer * 2, dst_layer * 2 + 2)
            cache_id, dst_unit = self.layouts.resolve_remote(link, config.cache_key)
            dst = self.remote_layout(link, cache_id)
            # The path follows the block lists alone, as upstream's layer-wise job decides it:
            # no dst blocks -> cache to cache, dst blocks only -> cache to blocks, both -> blocks.
            if not dst_blocks:
                src_unit = 0 if isinstance(config.cache_key, BlocksCacheKey) else config.src_batch_index
                return plan_cache(src=_one_slot(src, whole=False), dst=_one_slot(dst, whole=True),
                                  src_tensors=src_tensors, dst_tensors=dst_tensors,
                                  src_unit=src_unit, dst_unit=dst_unit, local="src")
            if src_blocks:
                return plan_blocks(src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
                                   src_tensors=src_tensors, dst_tensors=dst_tensors, local="src")
            return plan_contiguous_to_blocks(src=_one_slot(src, whole=True), dst=dst,
                                             src_unit=config.src_batch_index, dst_blocks=dst_blocks,
                                             src_tensors=src_tensors, dst_tensors=dst_tensors, local="src")
        # TransferConfig: raw destination addresses, two per transferred layer
        layers = config.src_layer_range or range(0, src.num_tensors // 2)
        pos = layer - layers.start
        dst_spans = []
        for addr in config.dst_addrs[pos * 2: pos * 2 + 2]:
            region = link.tables.find_region(addr, 1)
            if region is None:
                raise _err(f"destination address {addr:#x} is not registered on cluster {link.peer_cluster_id}",
                           S.LLM_PARAM_INVALID)
            dst_spans.append((region.region_id, addr - region.addr, region.size))
        if not dst_blocks:  # cache to raw addresses whatever the source kind (upstream's rule)
            src, src_blocks, dst_blocks = _one_slot(src, whole=False), None, None
        return plan_to_addresses(src=src, src_tensors=src_tensors, dst=dst_spans, src_unit=config.src_batch_index,
                                 src_blocks=src_blocks, dst_blocks=dst_blocks,
                                 dst_block_size=dst_block_size, local="src")

    def on_link_down(self, link: LinkView) -> None:
        """The link failed or closed (llmdd._protocol.port.DataService): forget what its peer reserved,
        queued or was refused; its async tasks end."""
        self.prepared.forget(link)
        for task in list(self._async):
            task.link_down(link)
        self._notices.forget(link)
        self.owner.link_down(link)

    # ------------------------------------------------------------------ non-blocking pulls
    def submit_pull(self, cluster_id: int, run: Callable[[], None],
                    callback: Optional[Callable[[LLMStatusCode], None]], *, kind: str) -> "AsyncPull":
        """Queue ``run`` (a blocking pull) on the engine's pull workers as a task of ``kind`` (CREATED
        until a worker starts it); raises at once when the cluster is not linked or too many pulls
        are waiting."""
        link = self.link_for(cluster_id)
        with self._pulls_lock:
            if self._closed:
                raise _err("the engine is finalized", S.LLM_ENGINE_FINALIZED)
            pending = self._async_pulls
            if pending >= MAX_ASYNC_PULLS:
                raise _err(f"{pending} non-blocking pulls are in flight (at most {MAX_ASYNC_PULLS})", S.LLM_LINK_BUSY)
            if self._pull_pool is None:
                self._pull_pool = self.runtime.make_pool(ASYNC_PULL_WORKERS, "llmdd-pull")
            task = AsyncPull(self, link, run, callback,
                             task=self._tasks.create(next(self._ids), kind=kind, peer=link.peer_cluster_id))
            self._async.add(task)
            self._async_pulls += 1
            pool = self._pull_pool
        try:
            pool.submit(task)
        except PoolFull as exc:   # no worker could be started (a pids limit) or finalize closed the pool
            task.refuse(S.LLM_FAILED, f"no worker for the non-blocking pull: {exc}")
        return task

    def task_ended(self, task: Union[AsyncPull, AsyncTransfer]) -> None:
        """A task of :mod:`llmdd._data.tasks` ended (or never started): it is no longer counted."""
        with self._pulls_lock:
            if task in self._async:
                self._async.discard(task)
                if isinstance(task, AsyncPull):
                    self._async_pulls -= 1

    def close(self) -> None:
        for task in list(self._async):
            task.cancel()
        pool, self._pull_pool = self._pull_pool, None
        if pool is not None:
            pool.close(timeout=None)   # the queued pulls run (each ends at once: cancelled above)
        with self._pulls_lock:
            self._closed = True
        self._notices.close()
