"""The data plane: resolves keys against the peer's tables, plans ops, runs tasks.

Every pull, push and async transfer is a task of the task lifecycle
(CREATED -> [WAITING] -> RUNNING -> COMPLETED | FAILED | TIMED_OUT | CANCELLED). A
byte-moving step has the deadline ``sync_kv_timeout`` counted from its start; a
blocking call returns by that deadline whatever the peer does, because the
transport's completion promise says no byte lands after ``wait`` reported an error.

No hook, log line or Python object per block: the planner builds numpy op arrays,
the transport moves them, and one event is emitted per task transition (per layer
for layer-wise transfers).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
import itertools
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from llmdd._seam import ops as _ops
from llmdd._base.status import TransportError
from llmdd._seam.errors import Cancelled, PeerGone, Refused, TransportTimeout
from llmdd._base.enums import Placement
from llmdd._base.lazy import np, when_numpy_loaded
from llmdd._base.log import get_logger
from llmdd._data.planner import CacheLayout, plan_blocks, plan_cache, plan_contiguous_to_blocks, plan_to_addresses, tensor_range
from llmdd._base.options import EngineOptions
from llmdd._extension.manager import Hooks
from llmdd._data.port import ControlPort, DataNotice, RequestOp
from llmdd._control.protocol import messages as m
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._data.owner import OwnerSide, device_pool_bytes
from llmdd._data.tasks import AsyncPull, AsyncTransfer, TransferTimedOut
from llmdd._base.types import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, cache_key_index

if TYPE_CHECKING:
    from llmdd._lifecycle.machines import Lifecycle
    from llmdd._memory.manager import CacheRecord, MemoryManager
    from llmdd._base.profiles import ChipProfile

__all__ = ["TransferEngine", "AsyncTransfer"]

_log = get_logger("llmdd.transfer")
S = LLMStatusCode

_READ_DONE_FLUSH_S = 0.002

#: a tag as it travels (at most messages.MAX_TAG_BYTES): its bytes, and whether it was given as str
Tag = tuple
#: workers running non-blocking pulls (per engine), and how many may be waiting or running at once
ASYNC_PULL_WORKERS = 4
MAX_ASYNC_PULLS = 4096


def _err(msg: str, code: LLMStatusCode) -> LLMException:
    return LLMException(msg, status_code=code)


def _spans(blocks: Any) -> tuple:
    """Block indices as sorted disjoint spans (for the owner's "peer finished reading" event)."""
    if isinstance(blocks, (list, tuple)) and len(blocks) <= 16:
        # a few blocks (the latency path): plain Python beats numpy's fixed per-call costs
        out: list[list[int]] = []
        for b in sorted(set(map(int, blocks))):
            if out and out[-1][1] == b:
                out[-1][1] = b + 1
            else:
                out.append([b, b + 1])
        return tuple(m.Span(start=a, stop=b) for a, b in out)
    arr = np.unique(np.asarray(blocks, dtype=np.int64))
    if not len(arr):
        return ()
    breaks = np.flatnonzero(np.diff(arr) != 1)
    starts = np.concatenate(([arr[0]], arr[breaks + 1]))
    stops = np.concatenate((arr[breaks], [arr[-1]])) + 1
    return tuple(m.Span(start=int(a), stop=int(b)) for a, b in zip(starts, stops))


def _bounds(blocks: Any) -> tuple:
    """Block indices as the flat ``(start, stop, ...)`` bounds of sorted disjoint spans (a ReadDone entry)."""
    if isinstance(blocks, (list, tuple)) and len(blocks) <= 16:
        return tuple(x for s in _spans(blocks) for x in (s.start, s.stop))
    arr = np.unique(np.asarray(blocks, dtype=np.int64))
    if not len(arr):
        return ()
    breaks = np.flatnonzero(np.diff(arr) != 1)
    out = np.empty(2 * (len(breaks) + 1), dtype=np.int64)
    out[0::2] = np.concatenate(([arr[0]], arr[breaks + 1]))
    out[1::2] = np.concatenate((arr[breaks], [arr[-1]])) + 1
    return tuple(out.tolist())


#: the kinds of queued owner notices, and the most of one kind sent in one message
_READ, _PUSH = 0, 1
MAX_NOTICE_BATCH = m.MAX_NOTICE_BATCH


def _push_done(cache_id: int, dst_blocks: Any, start: int, stop: int, failed: bool) -> m.TransferDone:
    return m.TransferDone(cache_id=cache_id, block_spans=_spans(dst_blocks) if dst_blocks else (),
                          tensors=m.Span(start=start, stop=stop), failed=failed)


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


class _QuickPlan:
    """What a small pull_blocks / push_blocks of one shape needs besides its block lists."""

    __slots__ = ("link", "tables", "cv", "rv", "rec", "regions", "cache_id", "src", "dst", "src_tensors",
                 "dst_tensors", "push", "pairs", "bs", "su", "du", "per_block", "fast", "chan")

    def __init__(self, link: Any, tables: Any, rec: CacheRecord, cache_id: int, src: CacheLayout, dst: CacheLayout,
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


#: the task triggers of a blocking transfer that succeeded (run_ops: start, transfer_succeeded)
_TASK_DONE = ("start", "transfer_succeeded")


def _fast_for(link: Any, plan: _QuickPlan) -> Any:
    """The link's channel's one-call path for ``plan``'s shape, or None (a channel without one: tcp,
    ucx, a fault-injecting wrapper; or one that cannot take the shape)."""
    channel = link.channel
    plan.chan = channel
    make = getattr(channel, "quick_plan", None)
    if make is None:
        return None
    return make(plan.pairs, plan.bs, plan.su, plan.du, plan.push)


class TransferEngine:
    """Pulls and pushes of one engine."""

    def __init__(self, *, port: ControlPort, memory: "MemoryManager", tasks: "Lifecycle", hooks: Hooks,
                 options: EngineOptions, profile: "ChipProfile") -> None:
        self._lm = port
        self._memory = memory
        self._tasks = tasks
        self._hooks = hooks
        self._options = options
        self._profile = profile
        self.timeout_s = options.sync_kv_timeout_ms / 1000.0
        self._ids = itertools.count(1)
        self._layouts: dict[tuple[int, int], tuple[int, CacheLayout]] = {}
        self._local_layouts: dict[int, tuple[Any, tuple, CacheLayout]] = {}
        self._blocks_refs: dict[int, Any] = {}  # model_id -> KeyRef of its blocks key (immutable)
        self._plans: dict[tuple, _QuickPlan] = {}  # the small-transfer path's per-shape plans
        # the last small pull / push with a one-call plan: (key, cache, src range, dst range, tnpl, plan)
        self._memo_pull: Optional[tuple] = None
        self._memo_push: Optional[tuple] = None
        self._read_done: dict[int, list] = {}   # id(link) -> [link, queued notice, ...]
        self._sending: dict[int, int] = {}       # id(link) -> batches of its notices the flusher is sending
        # the condition's lock, named so the per-call _queue_notice enters it without the
        # Condition's Python-level __enter__/__exit__ (two interpreter calls per small transfer)
        self._read_done_mutex = threading.RLock()
        self._read_done_lock = threading.Condition(self._read_done_mutex)
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop, name="llmdd-readdone", daemon=True)
        self._flusher.start()
        self._async: set = set()
        self._busy_lock = threading.Lock()
        self._async_busy: dict[int, int] = {}   # id(link) -> layer-wise async tasks holding it
        self._closing: set[int] = set()         # id(link) of links quiesced for an unlink
        self._pull_pool: Any = None   # the workers of non-blocking pulls, started on first use
        self._async_pulls = 0         # non-blocking pulls waiting or running (under _read_done_lock)
        self.owner = OwnerSide(port=port, memory=memory, options=options, profile=profile)

    # ------------------------------------------------------------------ the DataService side of the port
    # what peers ask of this engine as the owner of its caches is llmdd._data.owner's
    def serve(self, link: Any, op: RequestOp, args: dict) -> tuple[int, dict]:
        """A peer's data request (llmdd._data.port.DataService)."""
        return self.owner.serve(link, op, args)

    def serve_tagged(self, link: Any, message: m.TaggedDone) -> tuple[int, dict]:
        """A peer's tagged transfer on one of this engine's caches ended (acknowledged by the reply)."""
        return self.owner.serve_tagged(link, message)

    def on_notice(self, link: Any, message: DataNotice) -> None:
        """A one-way notice of the peer's data plane (refused ones answered with an Error message)."""
        self.owner.on_notice(link, message)

    # ------------------------------------------------------------------ layouts
    def local_layout(self, cache_id: int) -> tuple[Any, CacheLayout]:
        rec = self._memory.get(cache_id)
        if rec is None or not rec.live:
            raise _err(f"local cache {cache_id} does not exist", S.LLM_KV_CACHE_NOT_EXIST)
        # cached per cache: valid while the engine holds the same record with the same regions
        # tuple (re-registration makes a new record, a region change a new tuple)
        hit = self._local_layouts.get(cache_id)
        if hit is not None and hit[0] is rec and hit[1] is rec.regions:
            return rec, hit[2]
        regions = sorted(rec.regions, key=lambda r: r.tensor_index)
        layout = CacheLayout(cache_id=cache_id, region_ids=tuple(r.region_id for r in regions),
                             tensor_size=rec.tensor_size, units=rec.rows, is_blocks=rec.is_blocks)
        if len(self._local_layouts) > 4096:
            self._local_layouts.clear()
        self._local_layouts[cache_id] = (rec, rec.regions, layout)
        return rec, layout

    def remote_layout(self, link: Any, cache_id: int) -> CacheLayout:
        version = link.tables.cache_table_version * 1_000_003 + link.tables.regions_version
        key = (id(link), cache_id)
        hit = self._layouts.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        entry = link.tables.cache(cache_id)
        if entry is None:
            raise _err(f"cache {cache_id} does not exist on cluster {link.peer_cluster_id}",
                       S.LLM_KV_CACHE_NOT_EXIST)
        region_ids = []
        for addr in entry.addrs:
            region = link.tables.find_region(addr, entry.tensor_size)
            # a region the owner does not grant (remote-accessible mode) reads as absent, so the
            # answer does not reveal that such a cache exists (reliability.md S6)
            if region is None or region.addr != addr or not region.remote_accessible:
                raise _err(f"cache {cache_id} of cluster {link.peer_cluster_id} is not registered for remote "
                           f"access", S.LLM_KV_CACHE_NOT_EXIST)
            region_ids.append(region.region_id)
        units = int(entry.shape[0]) if entry.shape else 1
        layout = CacheLayout(cache_id=cache_id, region_ids=tuple(region_ids), tensor_size=entry.tensor_size,
                             units=max(units, 1), is_blocks=entry.is_blocks)
        if len(self._layouts) > 4096:
            self._layouts.clear()
        self._layouts[key] = (version, layout)
        return layout

    def _resolve_remote(self, link: Any, key: Any) -> tuple[int, int]:
        """(cache_id, batch_index) of a remote key without the owner's help (ids and blocks keys)."""
        if isinstance(key, CacheKeyByIdAndIndex):
            return key.cache_id, key.batch_index
        if isinstance(key, BlocksCacheKey):
            ref = self._blocks_refs.get(key.model_id)
            if ref is None:
                ref = m.KeyRef.for_blocks(key.model_id)
                if len(self._blocks_refs) > 4096:
                    self._blocks_refs.clear()
                self._blocks_refs[key.model_id] = ref
            entry = link.tables.lookup_key(ref)
            if entry is None:
                raise _err(f"no blocks cache with model_id {key.model_id} on cluster {link.peer_cluster_id}",
                           S.LLM_KV_CACHE_NOT_EXIST)
            return entry.cache_id, 0
        raise TypeError(f"unsupported key type {type(key)}")

    # ------------------------------------------------------------------ running a task
    def _link_for(self, cluster_id: int) -> Any:
        link = self._lm.require(cluster_id)
        if link.channel is None:
            raise _err(f"link to cluster {cluster_id} has no data channel", S.LLM_NOT_YET_LINK)
        return link

    # ------------------------------------------------------------------ a link's transfers
    # A link carries one blocking transfer at a time (its transfer_lock) and none while a layer-wise
    # async task holds it.  Which async tasks hold which link, and which links are being unlinked,
    # is this engine's table (under _busy_lock), so that "busy" is decided in one place: an async
    # task claims all its links at once or none, and once an unlink has quiesced a link no transfer
    # starts on it.
    def claim_links(self, links: list) -> None:
        """An async task takes ``links`` (all or none): LLM_LINK_BUSY while another task or an unlink has one."""
        with self._busy_lock:
            for link in links:
                if self._async_busy.get(id(link)) or id(link) in self._closing:
                    raise _err(f"an async transfer is already running on the link to cluster "
                               f"{link.peer_cluster_id}", S.LLM_LINK_BUSY)
            for link in links:
                self._async_busy[id(link)] = self._async_busy.get(id(link), 0) + 1

    def release_links(self, links: list) -> None:
        with self._busy_lock:
            for link in links:
                left = self._async_busy.get(id(link), 0) - 1
                if left > 0:
                    self._async_busy[id(link)] = left
                else:
                    self._async_busy.pop(id(link), None)

    def quiesce(self, link: Any) -> bool:
        """llmdd._data.port.DataService: True when no transfer runs on ``link``, and from then on none starts
        on it (the control plane unlinks it next); False while one runs (the unlink answers LLM_LINK_BUSY)."""
        with self._busy_lock:
            if self._async_busy.get(id(link)) or not link.transfer_lock.acquire(timeout=0):
                return False
            self._closing.add(id(link))
        link.transfer_lock.release()
        return True

    def _acquire(self, link: Any) -> None:
        if self._async_busy.get(id(link)):
            raise _err(f"an async transfer is running on the link to cluster {link.peer_cluster_id}",
                       S.LLM_LINK_BUSY)
        if not link.transfer_lock.acquire(timeout=self.timeout_s):
            raise _err(f"the link to cluster {link.peer_cluster_id} stayed busy for {self.timeout_s:.3f} s",
                       S.LLM_LINK_BUSY)
        if id(link) in self._closing and link.linked:
            link.transfer_lock.release()   # quiesced for an unlink that has not fired yet: as if UNLINKING
            raise _err(f"link to cluster {link.peer_cluster_id} is unlinking", S.LLM_PROCESSING_LINK)
        if not link.linked:
            link.transfer_lock.release()
            if self._lm.get(link.peer_cluster_id) in (link, None):
                # failed or unlinking: its status; unlinked: LLM_NOT_YET_LINK, as a call made now
                self._lm.require(link.peer_cluster_id)
            # relinked while this call waited: it was planned on the link that went (and it never
            # returns without holding that link's lock)
            raise _err(f"the link to cluster {link.peer_cluster_id} went down while this transfer waited for it",
                       getattr(link, "failure_status", None) or S.LLM_LINK_FAILED)

    def run_ops(self, link: Any, ops: np.ndarray, *, write: bool, kind: str, step_of: Any = None,
                nbytes: Optional[int] = None) -> None:
        """Move ``ops`` over ``link`` as one task with the sync_kv_timeout deadline (``nbytes``: the
        ops' total length when the caller knows it).  With ``step_of`` the ops are one step of that
        running task: its owner fires the task's transitions, this only raises (a timeout as
        :class:`TransferTimedOut`)."""
        if nbytes is None:
            n_ops = len(ops)
            nbytes = (sum(ops["length"].tolist()) if n_ops <= 8 else int(ops["length"].sum())) if n_ops else 0
        own_task = step_of is None
        if own_task:
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
        except TransportTimeout as exc:
            self._lm.record_transfer(link, failed=True)
            if own_task:
                task.fire("deadline_expired", error=exc)
            self._lm.transfer_timed_out(link, exc)
            raise TransferTimedOut(f"{kind} to cluster {link.peer_cluster_id} timed out: {exc}; the link must be "
                                   "relinked", status_code=S.LLM_TIMEOUT) from None
        except (PeerGone, Cancelled) as exc:
            self._lm.record_transfer(link, failed=True)
            if own_task:
                task.fire("transfer_failed", error=exc)
            if isinstance(exc, PeerGone):
                self._lm.fail_link(link, exc)
                code = S.LLM_LINK_FAILED
            elif not link.linked:
                # cancelled because the link went down under it (peer lost, force unlink, finalize):
                # report why the link is gone, not a generic failure
                code = getattr(link, "failure_status", None) or S.LLM_LINK_FAILED
            else:
                code = exc.status_code
            raise _err(f"{kind} with cluster {link.peer_cluster_id} failed: {exc}", code) from None
        except Refused as exc:
            self._lm.record_transfer(link, failed=True)
            if own_task:
                task.fire("transfer_failed", error=exc)
            raise _err(f"{kind} refused by cluster {link.peer_cluster_id}: {exc}", exc.status_code) from None
        except TransportError as exc:  # Corrupt & co: the data channel can no longer be trusted
            self._lm.record_transfer(link, failed=True)
            if own_task:
                task.fire("transfer_failed", error=exc)
            self._lm.fail_link(link, exc, status=exc.status_code)
            raise _err(f"{kind} with cluster {link.peer_cluster_id} failed: {exc}; the link must be relinked",
                       exc.status_code) from None
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

    def _move(self, link: Any, ops: np.ndarray, write: bool) -> None:
        """One step's bytes over ``link``'s data channel, by the sync_kv_timeout deadline."""
        deadline = time.monotonic() + self.timeout_s
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

    # ------------------------------------------------------------------ the small-transfer path
    # pull_blocks / push_blocks with a BlocksCacheKey, no tag and a few int blocks (issue 21): the
    # same steps, checks, errors and outcomes as pull() / push(), with what only depends on the
    # shape of the call (the peer's cache id and layout, the placement rules, the tensor ranges, the
    # per-tensor regions) kept per (direction, link, local cache, model id, layer ranges, tnpl) and
    # valid while the peer's tables, the local record and its regions are the same objects/versions.
    def _quick_plan(self, push: bool, link: Any, rec: Any, key: Any, src_layer_range: Any, dst_layer_range: Any,
                    tnpl: int) -> Optional["_QuickPlan"]:
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
        _, local = self.local_layout(rec.cache_id)
        cache_id, _ = self._resolve_remote(link, key)
        remote = self.remote_layout(link, cache_id)
        kind = "push_blocks" if push else "pull_blocks"
        self._check_placements(link, remote_cache_id=cache_id, local_rec=rec, local_is="src" if push else "dst",
                               kind=kind, remote_is_blocks=remote.is_blocks)
        src, dst = (local, remote) if push else (remote, local)
        if not src.is_blocks and not push:
            return None  # a contiguous remote cache: pull() plans it
        src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
        dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
        # the planner's checks of the two layouts (block 0 exists in any cache): raises as pull/push would
        plan_blocks(src=src, dst=dst, src_blocks=[0], dst_blocks=[0], src_tensors=src_tensors,
                    dst_tensors=dst_tensors, local="src" if push else "dst")
        plan = _QuickPlan(link, tables, rec, cache_id, src, dst, src_tensors, dst_tensors, push)
        plan.fast = _fast_for(link, plan)
        if len(self._plans) > 4096:
            self._plans.clear()
        self._plans[pk] = plan
        return plan

    def _run_fast(self, link: Any, plan: "_QuickPlan", rec: Any, src_blocks: Any, dst_blocks: Any,
                  kind: str) -> bool:
        """The planned shape's bytes in one call of the channel's own path (the shm plugin's C
        function; issue 21), under the link's transfer lock as :meth:`run_ops`; True when done.

        Taken only while nobody listens to task events and no hook wraps transfers (the task's
        create / start / succeeded are then counted at once, as :meth:`run_ops` leaves them). False,
        with nothing counted and the lock released, when the channel did not do it (a table changed
        since the plan, a block the planner decides, the owner holding its lock, an error): the
        caller then takes the ops path, which does the transfer or reports the error as it would."""
        fast = plan.fast   # another thread may replace it (see below)
        if (fast is None or link.channel is not plan.chan or not self._hooks.runs_transfers_directly()
                or not self._tasks.quiet()):
            return False
        self._acquire(link)
        try:
            moved = fast(src_blocks, dst_blocks)
            if moved >= 0:
                self._tasks.count_quiet(_TASK_DONE)
                if plan.push:
                    self._lm.record_transfer(link, written=moved)
                else:
                    self._lm.record_transfer(link, read=moved)
                    if not rec.live:   # unregistered while the bytes moved: the caller's cache is gone
                        raise self._local_outcome(rec, None, kind)
        finally:
            link.transfer_lock.release()
        if moved < 0:
            plan.fast = _fast_for(link, plan)   # on the tables of now (None: not this shape); no lock held
            return False
        return True

    def _memo_plan(self, memo: Optional[tuple], key: Any, cache: Any, src_layer_range: Any, dst_layer_range: Any,
                   tnpl: int) -> Optional["_QuickPlan"]:
        """The plan of the last small transfer in this direction when this call names the same key,
        cache and range objects (immutable, and held by the memo: identity stands for equality) and
        that plan is still what :meth:`_quick_plan` would return (same live record and regions; the
        link still the cluster's and LINKED, same tables and versions, same channel); else None."""
        if (memo is None or memo[0] is not key or memo[1] is not cache or memo[2] is not src_layer_range
                or memo[3] is not dst_layer_range or memo[4] != tnpl):
            return None
        plan: _QuickPlan = memo[5]
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
            self._queue_notice(plan.link, (_READ, plan.cache_id, tuple(src_blocks)))
            return
        rec = self._memory.get(cache.cache_id)
        plan = None
        if rec is not None and rec.live:
            link = self._link_for(key.cluster_id)
            plan = self._quick_plan(False, link, rec, key, src_layer_range, dst_layer_range, tnpl)
            if plan is not None and plan.fast is not None:
                self._memo_pull = (key, cache, src_layer_range, dst_layer_range, tnpl, plan)
        if plan is None or rec is None:   # (a plan is made only for a live record)
            self.pull(key, cache, kind="pull_blocks", src_blocks=src_blocks, dst_blocks=dst_blocks,
                      src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)
            return
        if plan.fast is not None and self._run_fast(link, plan, rec, src_blocks, dst_blocks, "pull_blocks"):
            self._queue_notice(link, (_READ, plan.cache_id, tuple(src_blocks)))
            return
        ops, nbytes = plan.ops(src_blocks, dst_blocks)
        self._acquire(link)
        try:
            try:
                self.run_ops(link, ops, write=False, kind="pull_blocks", nbytes=nbytes)
            except LLMException as exc:
                raise self._local_outcome(rec, exc, "pull_blocks") from None
            if not rec.live:   # unregistered while the ops ran: the caller's cache is gone
                raise self._local_outcome(rec, None, "pull_blocks")
        finally:
            link.transfer_lock.release()
        self._queue_notice(link, (_READ, plan.cache_id, tuple(src_blocks)))

    def push_blocks_quick(self, key: Any, cache: Any, src_blocks: Any, dst_blocks: Any, src_layer_range: Any,
                          dst_layer_range: Any, tnpl: int) -> None:
        """:meth:`push` of kind ``push_blocks`` for a ``BlocksCacheKey`` without a tag; the caller
        checked the arguments (lists of ints, equal non-zero lengths, non-empty layer ranges)."""
        plan = self._memo_plan(self._memo_push, key, cache, src_layer_range, dst_layer_range, tnpl)
        if plan is not None and self._run_fast(plan.link, plan, plan.rec, src_blocks, dst_blocks, "push_blocks"):
            self._push_notice(plan.link, plan.cache_id, dst_blocks, plan.dst_tensors, failed=False)
            return
        rec = self._memory.get(cache.cache_id)
        plan = None
        if rec is not None and rec.live:
            link = self._link_for(key.cluster_id)
            plan = self._quick_plan(True, link, rec, key, src_layer_range, dst_layer_range, tnpl)
            if plan is not None and plan.fast is not None:
                self._memo_push = (key, cache, src_layer_range, dst_layer_range, tnpl, plan)
        if plan is None:
            self.push(key, cache, kind="push_blocks", src_blocks=src_blocks, dst_blocks=dst_blocks,
                      src_layer_range=src_layer_range, dst_layer_range=dst_layer_range, tnpl=tnpl)
            return
        if plan.fast is not None and self._run_fast(link, plan, rec, src_blocks, dst_blocks, "push_blocks"):
            self._push_notice(link, plan.cache_id, dst_blocks, plan.dst_tensors, failed=False)
            return
        ops, nbytes = plan.ops(src_blocks, dst_blocks)
        dt = plan.dst_tensors
        self._acquire(link)
        try:
            try:
                self.run_ops(link, ops, write=True, kind="push_blocks", nbytes=nbytes)
            except LLMException as exc:
                err = self._local_outcome(rec, exc, "push_blocks")
                self._push_notice(link, plan.cache_id, dst_blocks, dt, failed=True)
                raise err from None
        finally:
            link.transfer_lock.release()
        self._push_notice(link, plan.cache_id, dst_blocks, dt, failed=False)

    # ------------------------------------------------------------------ pulls
    def pull(self, key: Any, cache: Any, *, kind: str, batch_index: int = 0, size: int = -1,
             src_blocks: Optional[Sequence[int]] = None, dst_blocks: Optional[Sequence[int]] = None,
             src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
             tnpl: int = 2, tag: Optional[Tag] = None) -> None:
        rec, dst = self.local_layout(cache.cache_id)
        link = self._link_for(key.cluster_id)
        reserved = None
        if isinstance(key, CacheKey):
            index = cache_key_index(key)
            try:
                status, result = self._lm.request(link, RequestOp.RESERVE_KEY,
                                                  {"id": int(index[0]), "model_id": int(index[1])},
                                                  deadline=time.monotonic() + self.timeout_s)
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
            cache_id, src_unit = self._resolve_remote(link, key)
        pulled = False
        src_tensors = None
        try:
            src = self.remote_layout(link, cache_id)   # unknown there: no cache to tell about it
            spans: tuple = ()
            try:
                self._check_placements(link, remote_cache_id=cache_id, local_rec=rec, local_is="dst", kind=kind,
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
                spans = _spans(src_blocks) if src_blocks else ()   # inside the owner's cache: planned
                self._acquire(link)
            except LLMException as exc:
                # the owner's cache is known but nothing was read (a refused plan, a busy or lost
                # link): a tagged pull still ends with one failure event for its tag (best effort)
                if tag is not None:
                    self._tag_notice(link, "read_done", cache_id, spans, tag, exc)
                raise
            try:
                try:
                    self.run_ops(link, ops, write=False, kind=kind)
                except LLMException as exc:
                    err = self._local_outcome(rec, exc, kind)
                    if tag is not None:
                        self._tag_notice(link, "read_done", cache_id, spans, tag, err)
                    raise err from None
                if not rec.live:   # unregistered while the ops ran: the caller's cache is gone
                    err = self._local_outcome(rec, None, kind)
                    if tag is not None:
                        self._tag_notice(link, "read_done", cache_id, spans, tag, err)
                    raise err
                if tag is not None:
                    # sent while this link's transfers are serialised, so tags reach the owner in the
                    # order their transfers completed; acknowledged before the call returns
                    self._tag_notice(link, "read_done", cache_id, spans, tag, None)
            finally:
                link.transfer_lock.release()
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
                            deadline=time.monotonic() + self.timeout_s)
                    except LLMException as exc:  # the bytes are here; the owner will learn on relink
                        _log.warning("llmdd.transfer.consume_key_failed", peer=link.peer_cluster_id,
                                     error=str(exc))
                else:
                    self._lm.notify(link, m.ReleaseKey(id=int(reserved[0]), model_id=int(reserved[1])))
        if pulled and tag is None:   # a tagged pull's notice was delivered (acknowledged) above
            self._queue_read_done(link, cache_id, tuple(src_blocks) if src_blocks else None)

    # ------------------------------------------------------------------ pushes
    def push(self, key: Any, cache: Any, *, kind: str, src_batch_index: int = 0,
             src_blocks: Optional[Sequence[int]] = None, dst_blocks: Optional[Sequence[int]] = None,
             src_layer_range: Optional[range] = None, dst_layer_range: Optional[range] = None,
             tnpl: int = 2, tag: Optional[Tag] = None) -> None:
        rec, src = self.local_layout(cache.cache_id)
        link = self._link_for(key.cluster_id)
        cache_id, dst_unit = self._resolve_remote(link, key)
        dst = self.remote_layout(link, cache_id)   # unknown there: no cache to tell about it
        spans: tuple = ()
        dst_tensors = None
        try:
            self._check_placements(link, remote_cache_id=cache_id, local_rec=rec, local_is="src", kind=kind,
                                   remote_is_blocks=dst.is_blocks)
            src_tensors = tensor_range(src_layer_range, src.num_tensors, tnpl)
            dst_tensors = tensor_range(dst_layer_range, dst.num_tensors, tnpl)
            if kind == "push_cache":
                ops = plan_cache(src=src, dst=dst, src_tensors=src_tensors, dst_tensors=dst_tensors,
                                 src_unit=src_batch_index, dst_unit=dst_unit, size=-1, local="src")
            else:
                ops = plan_blocks(src=src, dst=dst, src_blocks=src_blocks, dst_blocks=dst_blocks,
                                  src_tensors=src_tensors, dst_tensors=dst_tensors, local="src")
            spans = _spans(dst_blocks) if dst_blocks else ()   # inside the owner's cache: planned
            self._acquire(link)
        except LLMException as exc:
            # the owner's cache is known but nothing was written (a refused plan, a busy or lost
            # link): a tagged push still ends with one failure event for its tag (best effort)
            if tag is not None:
                self._tag_notice(link, "push_done", cache_id, spans, tag, exc, tensors=dst_tensors)
            raise
        try:
            try:
                self.run_ops(link, ops, write=True, kind=kind)
            except LLMException as exc:
                err = self._local_outcome(rec, exc, kind)
                if tag is not None:
                    self._tag_notice(link, "push_done", cache_id, spans, tag, err, tensors=dst_tensors)
                else:
                    self._push_notice(link, cache_id, dst_blocks, dst_tensors, failed=True)
                raise err from None
            if tag is not None:
                self._tag_notice(link, "push_done", cache_id, spans, tag, None, tensors=dst_tensors)
        finally:
            link.transfer_lock.release()
        if tag is None:
            self._push_notice(link, cache_id, dst_blocks, dst_tensors, failed=False)

    @staticmethod
    def _local_outcome(rec: Any, exc: Optional[LLMException], kind: str) -> LLMException:
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

    def _tag_notice(self, link: Any, op: str, cache_id: int, spans: tuple, tag: Tag, error: Optional[LLMException],
                    *, tensors: Optional[range] = None) -> None:
        """Tell the owner that a tagged transfer ended, and wait for its acknowledgement.

        The owner fires its "peer finished reading" (``read_done``) or "peer finished writing"
        (``push_done``) cache event with the tag once per transfer: on success with the spans, on
        failure with the error.  No acknowledgement within sync_kv_timeout: the link is unusable
        (as any timed-out step) and a successful transfer reports ``LLM_TIMEOUT``, since the owner
        may not have learnt it; a failure's notice is best effort (the link may be what failed)."""
        self._flush_link(link)   # the untagged transfers' notices before this one (the owner sees them first)
        entry = m.TransferDone(cache_id=int(cache_id), block_spans=tuple(spans),
                               tensors=None if tensors is None else m.Span(start=tensors.start, stop=tensors.stop),
                               failed=error is not None, status=int(error.status_code.value) if error is not None else 0,
                               tag=tag[0], tag_str=tag[1])
        try:
            status, result = self._lm.ask(link, m.TaggedDone(request_id=0, push=op == "push_done", entry=entry),
                                          deadline=time.monotonic() + self.timeout_s)
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

    def _push_notice(self, link: Any, cache_id: int, dst_blocks: Any, dst_tensors: range, *, failed: bool) -> None:
        """Queue an untagged push's "push done" notice (best effort, sent by the flusher)."""
        blocks = tuple(dst_blocks) if dst_blocks else None  # a copy: the caller may reuse its list
        self._queue_notice(link, (_PUSH, int(cache_id), blocks, dst_tensors.start, dst_tensors.stop, failed))

    # ------------------------------------------------------------------ layer-wise async transfer
    def transfer_async(self, cache: Any, synchronizer: Any, configs: Sequence[Any], *,
                       src_block_indices: Optional[Sequence[int]], dst_block_indices: Optional[Sequence[int]],
                       dst_block_memory_size: Optional[int]) -> "AsyncTransfer":
        rec, src = self.local_layout(cache.cache_id)
        task = AsyncTransfer(self, rec, src, synchronizer, list(configs), src_block_indices,
                             dst_block_indices, dst_block_memory_size)
        self._async.add(task)
        task.start()
        return task

    def plan_async_config(self, link: Any, src: CacheLayout, config: Any, layer: int, *,
                          src_blocks, dst_blocks, dst_block_size) -> np.ndarray:
        """Ops of one layer of one config (2 tensors per layer, as upstream hard-codes)."""
        src_tensors = range(layer * 2, layer * 2 + 2)
        if hasattr(config, "cache_key"):  # TransferWithCacheKeyConfig
            dst_layer = config.dst_layer_range.start + (layer - config.src_layer_range.start)
            dst_tensors = range(dst_layer * 2, dst_layer * 2 + 2)
            cache_id, dst_unit = self._resolve_remote(link, config.cache_key)
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

    # ------------------------------------------------------------------ device memory rules
    MIN_HOST_SIDE_DEVICE_POOL = 100 * 1024 * 1024

    def _peer_device_pool_bytes(self, link: Any) -> int:
        info = getattr(link, "engine_info", None)
        if info is None:
            status, info = self._lm.request(link, RequestOp.ENGINE_INFO, {},
                                            deadline=time.monotonic() + self.timeout_s)
            if status != 0:
                raise _err(f"cluster {link.peer_cluster_id} did not describe its memory pools", S.LLM_FAILED)
            link.engine_info = info
        return int(info.get("device_pool_bytes", 0))

    def _check_placements(self, link: Any, *, remote_cache_id: int, local_rec: Any, local_is: str, kind: str,
                          remote_is_blocks: bool) -> None:
        """The contract's D2D/D2H/H2D rules, checked before a byte moves.

        * host -> device ``pull_blocks`` only between two blocks caches;
        * D2H and H2D transfers need a device memory pool of at least 100 MB on the side that holds
          the host cache (that side stages the copy on an NPU; llmdd keeps the rule so that code
          tested here keeps working on hardware).
        """
        entry = link.tables.cache(remote_cache_id)
        if entry is None:
            return
        local_place, remote_place = local_rec.placement, Placement(entry.placement)
        src_place, dst_place = (remote_place, local_place) if local_is == "dst" else (local_place, remote_place)
        if src_place == dst_place:
            return
        if (kind == "pull_blocks" and src_place == Placement.HOST and dst_place == Placement.DEVICE
                and not remote_is_blocks):
            raise _err("pull_blocks from a host cache into a device cache needs both to be blocks caches",
                       S.LLM_PARAM_INVALID)
        host_is_local = local_place == Placement.HOST
        pool = device_pool_bytes(self._options) if host_is_local else self._peer_device_pool_bytes(link)
        if pool < self.MIN_HOST_SIDE_DEVICE_POOL:
            where = "this engine" if host_is_local else f"cluster {link.peer_cluster_id}"
            raise _err(f"{'D2H' if dst_place == Placement.HOST else 'H2D'} transfer: {where} holds the host cache "
                       f"and needs a device memory pool (mem_pool_cfg) of at least 100 MB, it has {pool} bytes",
                       S.LLM_PARAM_INVALID)

    def on_link_down(self, link: Any) -> None:
        """The link failed or closed (llmdd._data.port.DataService): forget what its peer reserved,
        queued or was refused; its async tasks end."""
        for pk in [pk for pk, plan in list(self._plans.items()) if plan.link is link]:
            self._plans.pop(pk, None)
        for task in list(self._async):
            task.link_down(link)
        with self._busy_lock:
            self._closing.discard(id(link))
        with self._read_done_lock:
            self._read_done.pop(id(link), None)
        self.owner.link_down(link)

    # ------------------------------------------------------------------ batched owner notices
    # A successful untagged pull's "read done" and an untagged push's "push done" are queued per link
    # as plain tuples, and the flusher thread builds and sends them every _READ_DONE_FLUSH_S, in
    # queue order: consecutive read-done entries as one ReadDone message, consecutive push notices as
    # one PushDone message (the owner fires one event per pull or push either way).
    def _queue_read_done(self, link: Any, cache_id: int, src_blocks: Any) -> None:
        self._queue_notice(link, (_READ, cache_id, src_blocks))

    def _queue_notice(self, link: Any, item: tuple) -> None:
        with self._read_done_mutex:   # == self._read_done_lock (its lock)
            wake = not self._read_done  # the flusher sleeps only while the queue is empty
            queued = self._read_done.get(id(link))
            if queued is None:
                self._read_done[id(link)] = [link, item]
            else:
                queued.append(item)
            if wake:
                self._read_done_lock.notify()

    def _flush_loop(self) -> None:
        sending = self._sending
        while True:
            with self._read_done_lock:
                while not self._read_done and not self._closed:
                    self._read_done_lock.wait()
                if not self._closed:
                    self._read_done_lock.wait(_READ_DONE_FLUSH_S)
                batches, self._read_done = self._read_done, {}
                closed = self._closed
                for lid in batches:
                    sending[lid] = sending.get(lid, 0) + 1
            try:
                for items in batches.values():
                    self._send_notices_safely(items[0], items[1:])
            finally:
                with self._read_done_lock:
                    for lid in batches:
                        left = sending[lid] - 1
                        if left:
                            sending[lid] = left
                        else:
                            del sending[lid]
                    self._read_done_lock.notify_all()   # _flush_link may wait for this batch
            if closed:  # what was queued before close has been sent (best effort): done
                return

    def _flush_link(self, link: Any) -> None:
        """Send ``link``'s queued notices now, after any batch of them the flusher is sending, so that
        what follows on the link (a tagged transfer's acknowledged notice) reaches the owner after
        them.  Waits at most sync_kv_timeout for the flusher; holds no lock while sending."""
        lid = id(link)
        deadline = time.monotonic() + self.timeout_s
        with self._read_done_lock:
            items = self._read_done.pop(lid, None)
            while self._sending.get(lid):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._read_done_lock.wait(left)
        if items is not None:
            self._send_notices_safely(link, items[1:])

    def _send_notices_safely(self, link: Any, items: list) -> None:
        try:
            self._send_notices(link, items)
        except Exception as exc:  # noqa: BLE001 - best effort: a notice must not kill the flusher
            _log.warning("llmdd.transfer.notice_failed", peer=link.peer_cluster_id, error=repr(exc))

    def _send_notices(self, link: Any, items: list) -> None:
        i, n = 0, len(items)
        while i < n:
            kind = items[i][0]
            j = i
            while j < n and j - i < MAX_NOTICE_BATCH and items[j][0] == kind:
                j += 1
            run = items[i:j]
            if kind == _READ:
                self._lm.notify(link, m.ReadDone(entries=tuple(
                    m.ReadDoneEntry(cache_id=cache_id, key=None, block_bounds=_bounds(blocks) if blocks else ())
                    for _, cache_id, blocks in run)))
            else:
                self._lm.notify(link, m.PushDone(entries=tuple(_push_done(*item[1:]) for item in run)))
            i = j

    # ------------------------------------------------------------------ non-blocking pulls
    def submit_pull(self, cluster_id: int, run: Any, callback: Any) -> "AsyncPull":
        """Queue ``run`` (a blocking pull) on the engine's pull workers; raises at once when the
        cluster is not linked or too many pulls are waiting."""
        link = self._link_for(cluster_id)
        with self._read_done_lock:
            if self._closed:
                raise _err("the engine is finalized", S.LLM_ENGINE_FINALIZED)
            pending = self._async_pulls
            if pending >= MAX_ASYNC_PULLS:
                raise _err(f"{pending} non-blocking pulls are in flight (at most {MAX_ASYNC_PULLS})", S.LLM_LINK_BUSY)
            if self._pull_pool is None:
                self._pull_pool = ThreadPoolExecutor(max_workers=ASYNC_PULL_WORKERS, thread_name_prefix="llmdd-pull")
            task = AsyncPull(self, link, run, callback)
            self._async.add(task)
            self._async_pulls += 1
            pool = self._pull_pool
        pool.submit(task)
        return task

    def _async_pull_ended(self, task: "AsyncPull") -> None:
        with self._read_done_lock:
            self._async.discard(task)
            self._async_pulls -= 1

    def close(self) -> None:
        for task in list(self._async):
            task.cancel()
        pool, self._pull_pool = self._pull_pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=False)
        with self._read_done_lock:
            self._closed = True
            self._read_done_lock.notify_all()
        self._flusher.join(timeout=2.0)
