"""The connector's worker side: the llmdd engine of one vLLM worker process, its KV registration,
its pull thread and the freeing of handed-over blocks (module docstring of ``connector``)."""

from __future__ import annotations

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
from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException,
                   LLMRole, LLMStatusCode)

from .config import ENGINE_DEFAULTS, LINK_ATTEMPTS, MODEL_ID, ConnectorSettings, layout_of
from .metadata import LlmddConnectorMetadata, LlmddHandshake, RecvJob

__all__ = ["WorkerSide", "TagFrees", "worker_cpus", "threads_started_on", "link_failure", "cluster_info"]

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
    """llmdd plugin on the prefill worker: "peer finished reading" events carrying a tag."""

    def __init__(self, sink: "queue.SimpleQueue") -> None:
        self.sink = sink

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        if event.trigger == "peer_read":
            tag = event.info.get("tag")
            if isinstance(tag, str):
                self.sink.put((tag, event.error is None))


class WorkerSide:
    """The worker-side half (one per worker process): owns the llmdd engine, registers vLLM's KV tensors,
    pulls on its own thread and frees handed-over blocks when their reader is done."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.s = settings
        self.dd: Optional[LLMDataDist] = None
        self.cache = None
        self.layout = ""
        self.block_bytes = 0            # bytes of one block, all layers
        self.handshake: Optional[LlmddHandshake] = None
        self.lock = threading.Lock()
        self.tags: "queue.SimpleQueue" = queue.SimpleQueue()
        self.done: "queue.SimpleQueue" = queue.SimpleQueue()      # (req_id, ok, nbytes, seconds)
        self.jobs: "queue.Queue" = queue.Queue()
        self.sending: dict = {}         # req_id -> deadline (monotonic)
        self.read: dict = {}            # tag -> first seen (monotonic), for sends not yet known
        self.linked: dict = {}          # cluster id -> (host, port)
        # counters (int, float seconds), transports (dict), and identity / last-error fields (or None)
        self.stats: dict[str, Any] = {
            "requests_pulled": 0, "blocks_pulled": 0, "bytes_pulled": 0, "pull_failures": 0,
            "pull_seconds": 0.0, "links": 0, "link_failures": 0, "freed_by_tag": 0,
            "failed_reads_seen": 0, "pull_retries": 0, "freed_by_timeout": 0, "pending_sends": 0,
            "transports": {}, "cluster_id": None, "listen": None, "max_submit_s": 0.0,
            "last_link_error": None, "llmdd_cpus": None}
        self.thread: Optional[threading.Thread] = None
        self.closed = False

    # ------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict) -> None:
        tensors, self.layout = layout_of(kv_caches)
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ValueError(f"LlmddConnector: KV layer {name} is on {t.device}: llmdd has no device-memory "
                                 "path yet, only CPU KV caches can be registered (docs/vllm.md, limits)")
            if not t.is_contiguous():
                raise ValueError(f"LlmddConnector: KV layer {name} is not contiguous")
        num_blocks = int(tensors[0].shape[0])
        per_block = int(tensors[0][0].numel() * tensors[0].element_size())
        self.block_bytes = per_block * len(tensors)
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
            self._start_engine(role, options, num_blocks, per_block, tensors)
        self.stats["llmdd_cpus"] = sorted(cpus) if cpus else None
        _log.info("llmdd_vllm: registered %d KV layers x %d blocks (%s), cluster %d, listen %s, llmdd threads on CPUs %s "
                  "(the worker thread's: %s)", len(tensors), num_blocks, self.layout, opts["cluster_id"],
                  self.stats["listen"], self.stats["llmdd_cpus"],
                  sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)

    def _start_engine(self, role, options: dict, num_blocks: int, per_block: int, tensors: list) -> None:
        opts = self.s.opts
        dd = LLMDataDist(role, int(opts["cluster_id"]))
        if self.s.producer:
            dd.add_plugin(TagFrees(self.tags), name="llmdd_vllm_tag_frees")
        dd.init(options)
        # vLLM's CPU backend: one tensor per layer, every layer a view of one shared buffer; each
        # view is one tensor of the blocks cache, registered in place as raw bytes per block
        views = [t.view(num_blocks, -1).view(torch.uint8) for t in tensors]
        desc = CacheDesc(len(views), [num_blocks, per_block], DataType.DT_UINT8)
        key = BlocksCacheKey(int(opts["cluster_id"]), MODEL_ID) if self.s.producer else None
        try:
            self.cache = dd.cache_manager.register_blocks_cache(desc, views, key)
        except LLMException:
            dd.finalize()
            raise
        self.dd = dd
        port = dd.statistics()["listen"][1] if self.s.producer else 0
        self.handshake = LlmddHandshake(host=opts["host"], port=int(port), cluster_id=int(opts["cluster_id"]),
                                        layout=self.layout)
        self.stats.update(cluster_id=int(opts["cluster_id"]), listen=[opts["host"], int(port)])
        if self.s.consumer:
            self.thread = threading.Thread(target=self._run, name="llmdd-vllm-pulls", daemon=True)
            self.thread.start()

    # ------------------------------------------------------------ per step (vLLM's model-runner thread)
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not isinstance(meta, LlmddConnectorMetadata):
            return
        now = time.monotonic()
        with self.lock:
            for req_id, timeout_s in meta.send.items():
                self.sending[req_id] = now + timeout_s
        for job in meta.recv:
            self.jobs.put(job)

    def transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        while True:
            try:
                req_id, ok, nbytes, nblocks, took = self.done.get_nowait()
            except queue.Empty:
                break
            out.finished_recving.add(req_id)
            with self.lock:
                if ok:
                    self.stats["requests_pulled"] += 1
                    self.stats["blocks_pulled"] += nblocks
                    self.stats["bytes_pulled"] += nbytes
                    self.stats["pull_seconds"] += took
                else:
                    self.stats["pull_failures"] += 1
            if not ok:
                out.failed_recving.add(req_id)
        now = time.monotonic()
        with self.lock:
            while True:
                try:
                    tag, ok = self.tags.get_nowait()
                except queue.Empty:
                    break
                if ok:
                    self.read.setdefault(tag, now)
                else:
                    # a failed read: the decoder may retry it, so the blocks stay (the timeout frees
                    # them if it never reads them)
                    self.stats["failed_reads_seen"] += 1
            for req_id in list(self.sending):
                if self.read.pop(req_id, None) is not None:
                    self.stats["freed_by_tag"] += 1
                elif now >= self.sending[req_id]:
                    self.stats["freed_by_timeout"] += 1
                else:
                    continue
                del self.sending[req_id]
                out.finished_sending.add(req_id)
            # a tag of no request of ours (a stale or foreign reader): forget it after the timeout
            horizon = float(self.s.opts["free_timeout_s"])
            for tag in [t for t, at in self.read.items() if now - at > horizon]:
                del self.read[tag]
            self.stats["pending_sends"] = len(self.sending)
        return out

    # ------------------------------------------------------------ the pull thread
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self._pull(job)
            except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, never raised
                _log.warning("llmdd_vllm: pull of %s failed: %s", job.req_id, exc)
                self.done.put((job.req_id, False, 0, 0, 0.0))

    def _engine(self) -> LLMDataDist:
        """The running engine (the pull thread starts after register_kv_caches set it)."""
        dd = self.dd
        if dd is None:
            raise RuntimeError("llmdd_vllm: no llmdd engine (KV caches not registered yet, or shut down)")
        return dd

    def _ensure_link(self, job: RecvJob) -> None:
        dd = self._engine()
        have = self.linked.get(job.cluster_id)
        if have is not None:
            state = dd.statistics()["links"].get(job.cluster_id, {}).get("state")
            if have == (job.host, job.port) and state == "linked":
                return
            self._unlink(job.cluster_id, *have)
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
            ret, rets = dd.link_clusters([cluster_info(job.cluster_id, job.host, job.port, self.s.opts["local_host"])], left_ms)
            took = time.monotonic() - t0
            status = rets[0] if rets else ret
            if status == LLMStatusCode.LLM_SUCCESS:
                _log.info("llmdd_vllm: linked to cluster %d at %s:%d in %.3f s (attempt %d)", job.cluster_id,
                          job.host, job.port, took, attempt)
                break
            why = link_failure(dd.statistics(), job.cluster_id)
            with self.lock:
                self.stats["link_failures"] += 1
                self.stats["last_link_error"] = why
            last = (attempt >= LINK_ATTEMPTS or time.monotonic() + 0.1 >= deadline
                    or status == LLMStatusCode.LLM_PARAM_INVALID)
            _log.warning("llmdd_vllm: link attempt %d/%d to cluster %d at %s:%d: %s after %.2f s of %d ms: %s%s",
                         attempt, LINK_ATTEMPTS, job.cluster_id, job.host, job.port, status.name, took, left_ms,
                         why, "" if last else "; retrying")
            if last:
                raise LLMException(f"link to cluster {job.cluster_id} at {job.host}:{job.port}: {status.name} "
                                   f"after {attempt} attempt(s) ({why})", status_code=status)
            self._unlink(job.cluster_id, job.host, job.port)
        self.linked[job.cluster_id] = (job.host, job.port)
        transport = dd.statistics()["links"].get(job.cluster_id, {}).get("transport")
        with self.lock:
            self.stats["links"] += 1
            self.stats["transports"][str(job.cluster_id)] = transport

    def _unlink(self, cluster_id: int, host: str, port: int) -> None:
        self.linked.pop(cluster_id, None)
        try:
            self._engine().unlink_clusters([cluster_info(cluster_id, host, port, self.s.opts["local_host"])], 1000, force=True)
        except LLMException as exc:
            _log.info("llmdd_vllm: unlink of cluster %d: %s", cluster_id, exc)

    def _pull(self, job: RecvJob) -> None:
        if job.layout != self.layout:
            raise ValueError(f"remote KV layout {job.layout} differs from the local {self.layout}")
        if len(job.src) != len(job.dst) or not job.dst:
            raise ValueError(f"{len(job.src)} remote blocks for {len(job.dst)} local ones")
        self._ensure_link(job)
        t0 = time.monotonic()
        nbytes, nblocks = len(job.dst) * self.block_bytes, len(job.dst)

        def done(status) -> None:
            ok = status == LLMStatusCode.LLM_SUCCESS
            if not ok and not job.retried and status in (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK):
                # the link went down under this pull (queued or running): relink and pull once more
                _log.info("llmdd_vllm: pull of %s ended %s: relinking, one retry", job.req_id, status.name)
                job.retried = True
                with self.lock:
                    self.stats["pull_retries"] += 1
                self.jobs.put(job)
                return
            if not ok:
                _log.warning("llmdd_vllm: pull of %s from cluster %d ended %s", job.req_id, job.cluster_id,
                             getattr(status, "name", status))
            self.done.put((job.req_id, ok, nbytes if ok else 0, nblocks if ok else 0, time.monotonic() - t0))

        try:
            self._engine().cache_manager.pull_blocks_async(BlocksCacheKey(job.cluster_id, MODEL_ID), self.cache,
                                                    job.src, job.dst, tag=job.remote_request_id, callback=done)
        except LLMException as exc:
            if exc.status_code in (LLMStatusCode.LLM_NOT_YET_LINK, LLMStatusCode.LLM_LINK_FAILED):
                self.linked.pop(job.cluster_id, None)
            raise
        took = time.monotonic() - t0
        with self.lock:
            self.stats["max_submit_s"] = max(self.stats["max_submit_s"], took)

    # ------------------------------------------------------------ introspection, teardown
    def counters(self) -> dict:
        with self.lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.stats.items()}
        dd = self.dd
        if dd is not None:
            links = dd.statistics()["links"]
            out["llmdd_bytes_read"] = sum(int(v.get("bytes_read", 0)) for v in links.values())
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
        if self.dd is not None:
            try:
                self.dd.finalize()
            except LLMException as exc:
                _log.info("llmdd_vllm: finalize: %s", exc)
            self.dd = None


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
