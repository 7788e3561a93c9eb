"""The connector's worker side: the llmdd engine of one vLLM worker process, its KV registration,
its pull thread and the freeing of handed-over blocks (module docstring of ``connector``)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from typing import Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults

import llmdd.plugin
from llmdd import (BlockFence, BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist,
                   LLMException, LLMRole, LLMStatusCode)

from .config import ENGINE_DEFAULTS, LINK_ATTEMPTS, MODEL_ID, ConnectorSettings, layout_of, rank_cluster_id
from .lease import Leases, Renewer, units_of
from .metadata import LlmddConnectorMetadata, LlmddHandshake, RecvJob
from .tp import MAX_TP, heads_of, plan, readers, serves

__all__ = ["WorkerSide", "TagFrees", "PHASES", "PULL_LOG", "breakdown", "worker_cpus", "threads_started_on",
           "link_failure", "cluster_info", "read_tag", "parse_tag", "piece_fence"]

_log = logging.getLogger("vllm.llmdd_vllm")


def worker_cpus() -> Optional[set]:
    """Every CPU some thread of this process may run on (``/proc/self/task``), or None where that
    cannot be read.  vLLM's CPU worker binds its OpenMP threads one core each
    (``VLLM_CPU_OMP_THREADS_BIND=auto``), the main thread included: the union is the set of cores
    vLLM gave this worker."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    cpus: set = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except (OSError, ValueError):
            continue                    # a thread that ended meanwhile
    return cpus or None


@contextlib.contextmanager
def threads_started_on(cpus: Optional[set]):
    """Threads started inside this block (llmdd's I/O loop, its transfer and registrar threads, the
    connector's pull thread; they start theirs in turn) may run on ``cpus``; the calling thread's
    own affinity is restored after.  vLLM pins the worker's main thread to one core (the first
    OpenMP thread's), and a thread inherits its creator's affinity: without this every llmdd
    thread of every instance on a host shares that one core with the main threads, which spin
    between engine steps while a request waits for a transfer or holds blocks for one (issue 20:
    a starved prefill worker did not answer a link handshake or a read_done in time)."""
    mine = None
    if cpus:
        try:
            mine = os.sched_getaffinity(0)
            if cpus <= mine:
                mine = None
            else:
                os.sched_setaffinity(0, cpus)
        except OSError as exc:
            _log.info("llmdd_vllm: llmdd threads keep the worker thread's CPUs: %s", exc)
            mine = None
    try:
        yield
    finally:
        if mine is not None:
            os.sched_setaffinity(0, mine)


class TagFrees:
    """llmdd plugin on the prefill worker: "peer finished reading" events carrying a tag
    (:func:`read_tag`), as ``("read", tag, ok)``, and decoders' notes (lease.py), as ``("note", notes)``."""

    def __init__(self, sink: "queue.SimpleQueue") -> None:
        self.sink = sink

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        if event.trigger == "peer_read":
            tag = event.info.get("tag")
            if isinstance(tag, str):
                self.sink.put(("read", tag, event.error is None))
        elif event.trigger == "peer_note":
            notes = event.info.get("notes")
            if isinstance(notes, list):
                self.sink.put(("note", notes))


#: the phases of one pull's breakdown (``counters()["pull_log"]``), in order: the scheduler made the
#: job -> the worker's step hook queued it -> the pull thread took it -> planned -> linked (the
#: link check, or linking) -> ``pull_blocks_async`` returned -> llmdd's callback (the bytes are here
#: and the owner acknowledged the read tag) -> vLLM collected it (``get_finished``)
PHASES = ("to_worker_s", "queue_s", "plan_s", "link_s", "submit_s", "transfer_s", "report_s")
#: the pulls ``counters()`` keeps the breakdown of (the newest)
PULL_LOG = 256


class _Pull:
    """One request's pull on one decode rank: its pieces still running and their outcome."""

    def __init__(self, job: RecvJob, pieces: int, t0: float, queued: float, planned: float) -> None:
        self.job, self.pieces, self.left, self.t0 = job, pieces, pieces, t0
        self.ok = True
        self.units = 0
        # the breakdown's timestamps (time.monotonic(), one clock for every process on a host);
        # with several pieces: the first piece's link and submit, the last callback
        self.at = {"created": job.created_s or queued, "queued": queued, "taken": t0, "planned": planned}


class WorkerSide:
    """The worker-side half (one per worker process): owns the llmdd engine, registers vLLM's KV tensors,
    pulls on its own thread and frees handed-over blocks when their reader is done."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.s = settings
        self.dd: Optional[LLMDataDist] = None
        self.cache = None
        self.layout = ""
        self.block_bytes = 0            # bytes of one block (this rank's heads), all layers
        self.unit_bytes = 0             # bytes of one head of one block, all layers
        self.kv_heads = int(settings.compat["kv_heads"])
        self.local_heads = 0
        self.tp_rank = 0
        self.cluster_id = 0
        self.readers: dict = {}         # prefill side: req_id -> decode ranks whose read was acknowledged
        self.handshake: Optional[LlmddHandshake] = None
        self.lock = threading.Lock()
        self.tags: "queue.SimpleQueue" = queue.SimpleQueue()
        self.done: "queue.SimpleQueue" = queue.SimpleQueue()      # (req_id, ok, nbytes, blocks, seconds, timestamps)
        self.jobs: "queue.Queue" = queue.Queue()
        self.leases = Leases()          # prefill: the requests whose blocks this rank holds (lease.py)
        self.queued: dict = {}          # req_id -> when start_load_kv queued its job (monotonic)
        self.pull_log: "collections.deque" = collections.deque(maxlen=PULL_LOG)
        self.read: dict = {}            # req_id -> when its last reader was acknowledged (monotonic)
        self.unserved: dict = {}        # sends of a replica rank no decoder reads (tp.serves): req_id -> blocks
        self.renewer: Optional[Renewer] = None   # decode: lease renewals and abort notes (lease.py)
        self.aborted: set = set()       # decode: requests vLLM aborted before their pull started
        self.linked: dict = {}          # cluster id -> (host, port)
        # decode: one pull per prefill rank at a time (llmdd runs one transfer per link at a time;
        # queued here, a pull's sync_kv_timeout counts from its own start, not from the start of the
        # pulls queued before it on that link): the ranks with a pull running, and the pieces waiting
        self.running: set = set()       # cluster ids
        self.waiting: dict = {}         # cluster id -> deque of (_Pull, piece)
        # counters (int, float seconds), transports (dict), and identity / last-error fields (or None)
        self.stats: dict[str, Any] = {
            "requests_pulled": 0, "blocks_pulled": 0, "bytes_pulled": 0, "pull_failures": 0,
            "pull_seconds": 0.0, "links": 0, "link_failures": 0, "freed_by_tag": 0,
            "failed_reads_seen": 0, "pull_retries": 0, "freed_by_lease": 0, "freed_by_abort": 0, "pending_sends": 0,
            "fence_failures": 0, "aborted_pulls": 0, "pulls_started": 0, "given_back_at": None,
            "transports": {}, "cluster_id": None, "listen": None, "max_submit_s": 0.0,
            "last_link_error": None, "llmdd_cpus": None, "tp_rank": 0, "units_pulled": 0, "pieces_pulled": 0,
            "freed_unserved": 0, "step_hook_calls": 0, "step_hook_seconds": 0.0, "max_step_hook_s": 0.0,
            "pieces_waited": 0, "max_pieces_waiting": 0}
        self.thread: Optional[threading.Thread] = None
        self.closed = False

    # ------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tensors, local_heads, self.layout = layout_of(kv_caches)
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ValueError(f"LlmddConnector: KV layer {name} is on {t.device}: llmdd has no device-memory "
                                 "path yet, only CPU KV caches can be registered (docs/vllm.md, limits)")
            if not t.is_contiguous():
                raise ValueError(f"LlmddConnector: KV layer {name} is not contiguous")
        self.tp_rank = int(get_tensor_model_parallel_rank()) if self.s.tp_size > 1 else 0
        held = heads_of(self.tp_rank, self.s.tp_size, self.kv_heads)
        if local_heads != len(held):
            raise ValueError(f"LlmddConnector: rank {self.tp_rank} of {self.s.tp_size} holds {local_heads} KV heads, "
                             f"expected {len(held)} of {self.kv_heads}")
        self.local_heads = local_heads
        num_blocks = int(tensors[0].shape[0])
        per_block = int(tensors[0][0].numel() * tensors[0].element_size())
        self.block_bytes = per_block * len(tensors)
        self.unit_bytes = per_block // local_heads * len(tensors)
        opts = self.s.opts
        cfg = LLMConfig()
        cfg.enable_cache_manager = True
        cfg.sync_kv_timeout = int(opts["sync_kv_timeout_ms"])
        if self.s.producer:
            cfg.listen_ip_info = f"{opts['host']}:{opts['port']}"
        options = dict(cfg.generate_options())
        if opts["transport"]:
            options["llmdd.transport"] = opts["transport"]
        options.update(ENGINE_DEFAULTS)
        options.update({str(k): str(v) for k, v in dict(opts["llmdd_options"]).items()})
        role = LLMRole.MIX if (self.s.producer and self.s.consumer) else (
            LLMRole.PROMPT if self.s.producer else LLMRole.DECODER)
        cpus = worker_cpus()
        with threads_started_on(cpus):
            self._start_engine(role, options, num_blocks, per_block // local_heads, tensors)
        self.stats["llmdd_cpus"] = sorted(cpus) if cpus else None
        _log.info("llmdd_vllm: rank %d of %d: registered %d KV layers x %d blocks x %d heads (%s), cluster %d, listen %s, "
                  "llmdd threads on CPUs %s (the worker thread's: %s)", self.tp_rank, self.s.tp_size, len(tensors),
                  num_blocks, local_heads, self.layout, self.cluster_id,
                  self.stats["listen"], self.stats["llmdd_cpus"],
                  sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)

    def _start_engine(self, role, options: dict, num_blocks: int, per_unit: int, tensors: list) -> None:
        opts = self.s.opts
        self.cluster_id = rank_cluster_id(int(opts["cluster_id"]), self.tp_rank)
        dd = LLMDataDist(role, self.cluster_id)
        if self.s.producer:
            dd.add_plugin(TagFrees(self.tags), name="llmdd_vllm_tag_frees")
        dd.init(options)
        # vLLM's CPU backend: one tensor per layer ([blocks, heads, block_size, 2*head_size]), every
        # layer a view of one shared buffer; each is registered in place as one tensor of a blocks
        # cache whose unit is one head of one block (tp module docstring)
        units = num_blocks * self.local_heads
        views = [t.view(units, -1).view(torch.uint8) for t in tensors]
        desc = CacheDesc(len(views), [units, per_unit], DataType.DT_UINT8)
        key = BlocksCacheKey(self.cluster_id, MODEL_ID) if self.s.producer else None
        try:
            self.cache = dd.cache_manager.register_blocks_cache(desc, views, key)
        except LLMException:
            dd.finalize()
            raise
        self.dd = dd
        port = dd.statistics()["listen"][1] if self.s.producer else 0
        epoch = dd.cache_manager.block_fence(self.cache, [0]).epoch if self.s.producer else 0
        self.handshake = LlmddHandshake(host=opts["host"], port=int(port), cluster_id=self.cluster_id,
                                        layout=self.layout, tp_rank=self.tp_rank, fence_epoch=epoch)
        self.stats.update(cluster_id=self.cluster_id, listen=[opts["host"], int(port)], tp_rank=self.tp_rank)
        if self.s.consumer:
            self.renewer = Renewer(self._notify)
            self.renewer.start()
            self.thread = threading.Thread(target=self._run, name="llmdd-vllm-pulls", daemon=True)
            self.thread.start()

    # ------------------------------------------------------------ per step (vLLM's model-runner thread)
    def hook_time(self, t0: float) -> None:
        """Count one step hook call that started at ``time.perf_counter()`` ``t0`` (the ``step_hook_*``
        counters: what the connector's worker side costs vLLM's step loop)."""
        took = time.perf_counter() - t0
        with self.lock:
            self.stats["step_hook_calls"] += 1
            self.stats["step_hook_seconds"] += took
            if took > self.stats["max_step_hook_s"]:
                self.stats["max_step_hook_s"] = took

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, LlmddConnectorMetadata):
            return
        self._hold_sends(meta.send)
        self._track_pulls(meta.recv, meta.abort)
        now = time.monotonic()
        for job in meta.recv:
            self.queued[job.req_id] = now
            self.jobs.put(job)

    def transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        while True:
            try:
                req_id, ok, nbytes, nblocks, took, at = self.done.get_nowait()
            except queue.Empty:
                break
            out.finished_recving.add(req_id)
            at["reported"] = time.monotonic()
            with self.lock:
                if ok:
                    self.stats["requests_pulled"] += 1
                    self.stats["blocks_pulled"] += nblocks
                    self.stats["bytes_pulled"] += nbytes
                    self.stats["pull_seconds"] += took
                else:
                    self.stats["pull_failures"] += 1
                self.pull_log.append(breakdown(req_id, ok, nbytes, at))
            if not ok:
                out.failed_recving.add(req_id)
        out.finished_sending |= self._give_back()
        return out

    # ------------------------------------------------------------ leases and fences (lease.py)
    def _hold_sends(self, send: dict) -> None:
        """Prefill: requests handed over this step are held under their lease (a replica rank no
        decoder reads gives them back at the next results)."""
        if not send:
            return
        now = time.monotonic()
        serving = serves(self.tp_rank, self.s.tp_size, self.kv_heads)
        with self.lock:
            for req_id, (lease_s, blocks) in send.items():
                if serving:
                    self.leases.hold(req_id, blocks, lease_s, now)
                else:
                    self.unserved[req_id] = blocks

    def _track_pulls(self, recv: list, abort: list) -> None:
        """Decode: renew the leases of the pulls queued or running; tell the prefill of an aborted one."""
        renewer = self.renewer
        if renewer is None:
            return
        for job in recv:
            renewer.pulling(job.req_id, job.remote_request_id, [int(r[2]) for r in job.ranks], job.lease_s)
        for req_id in abort:
            if renewer.abort(req_id):
                with self.lock:
                    self.aborted.add(req_id)     # not started yet: the pull thread skips it

    def _notify(self, cluster_id: int, notes: list) -> None:
        self._engine().cache_manager.notify_owner(BlocksCacheKey(cluster_id, MODEL_ID), notes)

    def _give_back(self) -> set:
        """Prefill: the requests whose blocks go back to vLLM now (read acknowledged, aborted by the
        decoder, lease expired; a replica's at once), each fenced first (docs/vllm.md)."""
        now = time.monotonic()
        with self.lock:
            notes: list = []
            while True:
                try:
                    item = self.tags.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "note":
                    notes.extend(item[1])
                elif item[2]:
                    req, reader, n = parse_tag(item[1])
                    seen = self.readers.setdefault(req, (now, set()))[1]
                    seen.add(reader)
                    if len(seen) >= n:
                        self.read.setdefault(req, now)
                        del self.readers[req]
                else:
                    # a failed read: the decoder may retry it, so the blocks stay (the lease gives
                    # them back if it never reads them)
                    self.stats["failed_reads_seen"] += 1
            self.leases.on_notes(notes, now)
            due = self.leases.due(lambda r: self.read.pop(r, None) is not None, now)
            unserved, self.unserved = self.unserved, {}
            # a tag of no request of ours (a stale or foreign reader): forget it after a lease
            horizon = float(self.s.opts["lease_s"])
            for tag in [t for t, at in self.read.items() if now - at > horizon]:
                del self.read[tag]
            for req in [r for r, (at, _) in self.readers.items() if now - at > horizon]:
                del self.readers[req]
            self.stats["pending_sends"] = len(self.leases.held)
        back = [(r, b, "unserved") for r, b in unserved.items()] + due
        if not back:
            return set()
        blocks = sorted({b for _, bs, _ in back for b in bs})
        try:
            self._engine().cache_manager.fence_blocks(self.cache, units_of(blocks, self.local_heads))
        except (LLMException, RuntimeError) as exc:   # the engine is gone: no reader can reach the blocks
            _log.warning("llmdd_vllm: fencing %d blocks before their return failed: %s", len(blocks), exc)
        with self.lock:
            for _, _, why in back:
                self.stats["freed_unserved" if why == "unserved" else f"freed_by_{why}"] += 1
            self.stats["given_back_at"] = time.monotonic()     # CLOCK_MONOTONIC: comparable across processes
        return {r for r, _, _ in back}

    # ------------------------------------------------------------ the pull thread
    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            if isinstance(item, RecvJob):
                taken = time.monotonic()
                queued = self.queued.pop(item.req_id, taken)
                with self.lock:
                    skip = item.req_id in self.aborted
                    self.aborted.discard(item.req_id)
                    if skip:
                        self.stats["aborted_pulls"] += 1
                if skip:                            # aborted by vLLM before it started: nothing to read
                    self.done.put((item.req_id, False, 0, 0, 0.0, {"queued": queued, "taken": taken}))
                    continue
                try:
                    pieces = self._plan(item)
                except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, never raised
                    _log.warning("llmdd_vllm: pull of %s refused: %s", item.req_id, exc)
                    if self.renewer is not None:
                        self.renewer.ended(item.req_id)
                    self.done.put((item.req_id, False, 0, 0, 0.0, {"queued": queued, "taken": taken}))
                    continue
                with self.lock:
                    self.stats["pulls_started"] += 1
                state = _Pull(item, len(pieces), taken, queued, time.monotonic())
                for piece in pieces:
                    self._offer(state, piece)
            else:
                # ("retry", ...): a piece whose link went down, its one retry; ("next", ...): the next
                # piece waiting for its rank.  Either way this piece holds its rank's turn already
                kind, state, piece = item
                self._submit(state, piece, retried=kind == "retry")

    def _cluster(self, state: "_Pull", piece) -> int:
        return int(state.job.ranks[piece.rank][2])

    def _offer(self, state: "_Pull", piece) -> None:
        """Start ``piece`` now if no pull from its prefill rank is running, else queue it for its turn."""
        cluster = self._cluster(state, piece)
        with self.lock:
            if cluster in self.running:
                waiting = self.waiting.setdefault(cluster, collections.deque())
                waiting.append((state, piece))
                self.stats["pieces_waited"] += 1
                self.stats["max_pieces_waiting"] = max(self.stats["max_pieces_waiting"], len(waiting))
                return
            self.running.add(cluster)
        self._submit(state, piece, retried=False)

    def _turn_over(self, cluster: int) -> None:
        """The running pull from ``cluster`` ended: the next piece waiting for it goes to the pull thread."""
        with self.lock:
            waiting = self.waiting.get(cluster)
            nxt = waiting.popleft() if waiting else None
            if waiting is not None and not waiting:
                del self.waiting[cluster]
            if nxt is None:
                self.running.discard(cluster)
        if nxt is not None:
            self.jobs.put(("next", *nxt))

    def _plan(self, job: RecvJob) -> list:
        if job.layout != self.layout:
            raise ValueError(f"remote KV layout {job.layout} differs from the local {self.layout}")
        if len(job.src) != len(job.dst) or not job.dst:
            raise ValueError(f"{len(job.src)} remote blocks for {len(job.dst)} local ones")
        return plan(self.tp_rank, self.s.tp_size, len(job.ranks), self.kv_heads, job.src, job.dst)

    def _submit(self, state: "_Pull", piece, retried: bool) -> None:
        """Start one piece (one prefill rank's heads of the request); its end is counted in ``state``."""
        job = state.job
        host, port, cluster_id = job.ranks[piece.rank]
        p_tp = len(job.ranks)
        tag = read_tag(job.remote_request_id, self.tp_rank, readers(piece.rank, p_tp, self.s.tp_size, self.kv_heads))

        def done(status) -> None:
            ok = status == LLMStatusCode.LLM_SUCCESS
            if status == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                with self.lock:
                    self.stats["fence_failures"] += 1   # the prefill handed the blocks back first (lease.py)
            if not ok and not retried and status in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK):
                # the link went down under this pull (queued or running): relink and pull once more
                _log.info("llmdd_vllm: pull of %s from rank %d ended %s: relinking, one retry", job.req_id,
                          piece.rank, status.name)
                with self.lock:
                    self.stats["pull_retries"] += 1
                self.jobs.put(("retry", state, piece))     # keeps the rank's turn
                return
            if not ok:
                _log.warning("llmdd_vllm: pull of %s from cluster %d (rank %d) ended %s", job.req_id, cluster_id,
                             piece.rank, getattr(status, "name", status))
            self._piece_done(state, piece, ok)
            self._turn_over(self._cluster(state, piece))

        t0 = time.monotonic()
        try:
            self._ensure_link(cluster_id, host, port)
            state.at.setdefault("linked", time.monotonic())
            self._engine().cache_manager.pull_blocks_async(BlocksCacheKey(cluster_id, MODEL_ID), self.cache,
                                                           piece.src, piece.dst, tag=tag, callback=done,
                                                           fence=piece_fence(job, piece))
            state.at.setdefault("submitted", time.monotonic())
        except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, never raised
            if isinstance(exc, LLMException) and exc.status_code in (LLMStatusCode.LLM_NOT_YET_LINK,
                                                                     LLMStatusCode.LLM_LINK_FAILED):
                self.linked.pop(cluster_id, None)
            _log.warning("llmdd_vllm: pull of %s from rank %d failed: %s", job.req_id, piece.rank, exc)
            self._piece_done(state, piece, False)
            self._turn_over(self._cluster(state, piece))
            return
        took = time.monotonic() - t0
        with self.lock:
            self.stats["max_submit_s"] = max(self.stats["max_submit_s"], took)

    def _piece_done(self, state: "_Pull", piece, ok: bool) -> None:
        now = time.monotonic()
        with self.lock:
            state.left -= 1
            state.ok = state.ok and ok
            if ok:
                state.units += len(piece.dst)
            last = state.left == 0
            if last:
                self.aborted.discard(state.job.req_id)
                self.stats["pieces_pulled"] += state.pieces if state.ok else 0
                self.stats["units_pulled"] += state.units if state.ok else 0
        if last:
            job = state.job
            nbytes = state.units * self.unit_bytes if state.ok else 0
            if self.renewer is not None:
                self.renewer.ended(job.req_id)
            state.at["called_back"] = now
            self.done.put((job.req_id, state.ok, nbytes, len(job.dst) if state.ok else 0, now - state.t0,
                           state.at))

    def _engine(self) -> LLMDataDist:
        """The running engine (the pull thread starts after register_kv_caches set it)."""
        dd = self.dd
        if dd is None:
            raise RuntimeError("llmdd_vllm: no llmdd engine (KV caches not registered yet, or shut down)")
        return dd

    def _ensure_link(self, cluster_id: int, host: str, port: int) -> None:
        dd = self._engine()
        have = self.linked.get(cluster_id)
        if have is not None:
            state = dd.statistics()["links"].get(cluster_id, {}).get("state")
            if have == (host, port) and state == "linked":
                return
            self._unlink(cluster_id, *have)
        # a first link_clusters call may fail (seen under load, early or by its deadline, while the
        # next one succeeds): up to LINK_ATTEMPTS attempts of a third of link_timeout_ms each, then
        # the request is recomputed (a peer that is gone refuses each attempt at once)
        budget_ms = int(self.s.opts["link_timeout_ms"])
        attempt_ms = max(500, budget_ms // 3)
        deadline = time.monotonic() + budget_ms / 1000.0
        attempt = 0
        while True:
            attempt += 1
            left_ms = max(1, min(attempt_ms, int((deadline - time.monotonic()) * 1000)))
            t0 = time.monotonic()
            ret, rets = dd.link_clusters([cluster_info(cluster_id, host, port, self.s.opts["local_host"])], left_ms)
            took = time.monotonic() - t0
            status = rets[0] if rets else ret
            if status == LLMStatusCode.LLM_SUCCESS:
                _log.info("llmdd_vllm: linked to cluster %d at %s:%d in %.3f s (attempt %d)", cluster_id,
                          host, port, took, attempt)
                break
            why = link_failure(dd.statistics(), cluster_id)
            with self.lock:
                self.stats["link_failures"] += 1
                self.stats["last_link_error"] = why
            last = (attempt >= LINK_ATTEMPTS or time.monotonic() + 0.1 >= deadline
                    or status == LLMStatusCode.LLM_PARAM_INVALID)
            _log.warning("llmdd_vllm: link attempt %d/%d to cluster %d at %s:%d: %s after %.2f s of %d ms: %s%s",
                         attempt, LINK_ATTEMPTS, cluster_id, host, port, status.name, took, left_ms,
                         why, "" if last else "; retrying")
            if last:
                raise LLMException(f"link to cluster {cluster_id} at {host}:{port}: {status.name} "
                                   f"after {attempt} attempt(s) ({why})", status_code=status)
            self._unlink(cluster_id, host, port)
        self.linked[cluster_id] = (host, port)
        transport = dd.statistics()["links"].get(cluster_id, {}).get("transport")
        with self.lock:
            self.stats["links"] += 1
            self.stats["transports"][str(cluster_id)] = transport

    def _unlink(self, cluster_id: int, host: str, port: int) -> None:
        self.linked.pop(cluster_id, None)
        try:
            self._engine().unlink_clusters([cluster_info(cluster_id, host, port, self.s.opts["local_host"])], 1000,
                                           force=True)
        except LLMException as exc:
            _log.info("llmdd_vllm: unlink of cluster %d: %s", cluster_id, exc)

    # ------------------------------------------------------------ introspection, teardown
    def counters(self) -> dict:
        with self.lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.stats.items()}
        dd = self.dd
        if dd is not None:
            links = dd.statistics()["links"]
            out["llmdd_bytes_read"] = sum(int(v.get("bytes_read", 0)) for v in links.values())
        if self.renewer is not None:
            out.update(self.renewer.stats)
        with self.lock:
            out["pull_log"] = list(self.pull_log)
        out["block_bytes"] = self.block_bytes
        out["pid"] = os.getpid()
        out["layout"] = self.layout
        return out

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(10)
        if self.renewer is not None:
            self.renewer.close()
        if self.dd is not None:
            try:
                self.dd.finalize()
            except LLMException as exc:
                _log.info("llmdd_vllm: finalize: %s", exc)
            self.dd = None


def piece_fence(job: RecvJob, piece) -> BlockFence:
    """What one piece's pull expects of its prefill rank's blocks: the rank's registration epoch and,
    per source unit (blocks then heads, tp.plan's order), its block's generation."""
    per_block = len(piece.heads)
    return BlockFence(epoch=int(job.fence_epochs[piece.rank]),
                      generations=[int(g) for g in job.gens for _ in range(per_block)])


def breakdown(req_id: str, ok: bool, nbytes: int, at: dict) -> dict:
    """One pull's phases (:data:`PHASES`, seconds; None where a phase did not happen) from its timestamps."""
    order = ("created", "queued", "taken", "planned", "linked", "submitted", "called_back", "reported")
    out: dict = {"req_id": req_id, "ok": ok, "bytes": nbytes}
    for name, (a, b) in zip(PHASES, zip(order, order[1:])):
        out[name] = round(at[b] - at[a], 6) if a in at and b in at else None
    first = next((at[k] for k in order if k in at), None)
    out["total_s"] = round(at["reported"] - first, 6) if first is not None and "reported" in at else None
    return out


def link_failure(stats: dict, cluster_id: int) -> str:
    """Why the last link_clusters to ``cluster_id`` failed: llmdd's record of the failed attempt
    (``statistics()["link_failures"]``), else the link's own last error."""
    failed = (stats.get("link_failures") or {}).get(cluster_id)
    if failed:
        return str(failed.get("error"))
    return str(stats["links"].get(cluster_id, {}).get("last_error") or "no reason recorded")


def cluster_info(cluster_id: int, host: str, port: int, local_host: Optional[str]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(local_host or "127.0.0.1", 0)
    info.append_remote_ip_info(host, port)
    return info


def read_tag(remote_request_id: str, d_rank: int, readers: int) -> str:
    """The tag of decode rank ``d_rank``'s read of a request from one prefill rank that
    ``readers`` decode ranks read (the owner frees after that many acknowledged reads)."""
    return f"{remote_request_id}|{d_rank}/{readers}"


def parse_tag(tag: str) -> tuple:
    """(request id, reader rank, readers) of a :func:`read_tag`; a tag without the suffix is one reader's."""
    req, sep, tail = tag.rpartition("|")
    reader, slash, n = tail.partition("/")
    if sep and slash and reader.isdigit() and n.isdigit() and 0 < int(n) <= MAX_TP and int(reader) < MAX_TP:
        return req, int(reader), int(n)
    return tag, 0, 1
