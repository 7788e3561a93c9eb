"""``LlmddConnector``: vLLM's v1 KV-connector interface on llmdd (disaggregated prefill/decode).

Loaded by vLLM with ``kv_transfer_config={"kv_connector": "LlmddConnector",
"kv_connector_module_path": "llmdd_vllm", "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}``.

The protocol is the one vLLM's NixlConnector and its P/D proxies use:

* a prefill request carries ``SamplingParams(max_tokens=1, extra_args={"kv_transfer_params":
  {"do_remote_decode": True}})``; when it finishes, the prefill instance keeps its blocks (delayed
  free) and its ``RequestOutput.kv_transfer_params`` says where they are (host, port, llmdd
  cluster id, block ids, layout);
* the decode request for the same prompt carries those params unchanged; the decode instance
  reports the prompt's tokens as external from ``get_num_new_matched_tokens``, links to the
  prefill instance on first use and pulls the blocks with llmdd's non-blocking pull (from its own
  thread: vLLM's scheduler loop never waits for a link or a transfer), then reports completion
  or failure from ``get_transfer_results`` (with ``kv_load_failure_policy="recompute"`` vLLM then
  recomputes the prompt);
* every pull is tagged with the prefill-side request id: the prefill worker frees the request's
  blocks when llmdd delivers that tag in "peer finished reading"; a timeout
  (``free_timeout_s``) frees them only when no decoder ever reads.

Two objects are built per instance by vLLM: the scheduler-side connector (in the engine-core
process) and one worker-side connector per worker process, which owns the llmdd engine and the
registration of vLLM's KV tensors.  They talk through vLLM's metadata objects only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import hashlib
import logging
import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import llmdd
import llmdd.plugin
from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException,
                   LLMRole, LLMStatusCode)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# a child of vLLM's logger: vLLM's logging configuration shows these lines with its own
_log = logging.getLogger("vllm.llmdd_vllm")


class _ToVllmLog(logging.Handler):
    """Hands the records of llmdd's loggers (``llmdd.*``: the library configures no logging, its
    ``llmdd`` logger carries a NullHandler only) to vLLM's logger ``vllm.llmdd``, whose handlers
    (vLLM's logging configuration) write them with vLLM's own lines."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm.llmdd")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def _route_llmdd_log() -> None:
    """Once per process: llmdd's log into vLLM's (a link failure's ``llmdd.link.failed`` line with
    its reason, engine and link transitions).  llmdd's logger follows vLLM's level unless the
    application set one."""
    lib = logging.getLogger("llmdd")
    if any(isinstance(h, _ToVllmLog) for h in lib.handlers):
        return
    if lib.level == logging.NOTSET:
        lib.setLevel(logging.getLogger("vllm").getEffectiveLevel())
    lib.addHandler(_ToVllmLog())

#: keys of ``kv_connector_extra_config`` and their defaults (docs/vllm.md lists them)
DEFAULTS: dict = {
    "host": "127.0.0.1",        # the address the prefill worker listens on and announces
    "port": 0,                  # its llmdd listen port (0: any free port, announced to the scheduler)
    "local_host": None,         # decode side: this host's address for its own data endpoints (cross-host
                                # tcp: the address the prefill host reaches; default loopback)
    "cluster_id": None,         # the llmdd cluster id of this instance (default: from vLLM's engine_id)
    "transport": None,          # force "shm" or "tcp" (default: llmdd's automatic choice)
    "sync_kv_timeout_ms": 5000,  # deadline of one transfer step (llmdd sync_kv_timeout)
    "link_timeout_ms": 30000,   # deadline of linking to a prefill instance (attempts of a third each)
    "free_timeout_s": 480,      # prefill side: free unread blocks after this (NixlConnector's
                                # VLLM_NIXL_ABORT_REQUEST_TIMEOUT default)
    "llmdd_options": {},        # further llmdd engine options, passed to init as given (over ENGINE_DEFAULTS)
}
#: llmdd engine options the connector sets unless llmdd_options overrides them: vLLM's workers are
#: busy processes (and a loaded host may deschedule them for seconds), so a link is declared lost
#: after 30 s of silence instead of llmdd's 5 s; a killed peer is still seen at once (its sockets close)
ENGINE_DEFAULTS: dict = {"llmdd.peer_timeout_ms": "30000", "llmdd.keepalive_interval_ms": "2000"}
#: the parameters a decode request needs from the prefill instance (all set by request_finished)
_REQUIRED = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port", "remote_cluster_id",
             "llmdd_layout")
_MODEL_ID = 0
LINK_ATTEMPTS = 3
_MAX_TAG = 256


def _worker_cpus() -> Optional[set]:
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
def _threads_started_on(cpus: Optional[set]):
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


def _options(vllm_config: "VllmConfig") -> dict:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"LlmddConnector: unknown kv_connector_extra_config keys {unknown}; "
                         f"known: {sorted(DEFAULTS)}")
    out = {**DEFAULTS, **extra}
    if out["transport"] not in (None, "shm", "tcp"):
        raise ValueError(f"LlmddConnector: transport must be 'shm', 'tcp' or unset, not {out['transport']!r}")
    for key in ("port", "sync_kv_timeout_ms", "link_timeout_ms"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 0:
            raise ValueError(f"LlmddConnector: {key} must be a non-negative integer, not {out[key]!r}")
    if not isinstance(out["free_timeout_s"], (int, float)) or out["free_timeout_s"] <= 0:
        raise ValueError(f"LlmddConnector: free_timeout_s must be a positive number, not {out['free_timeout_s']!r}")
    if out["cluster_id"] is None:
        digest = hashlib.sha256(str(vllm_config.kv_transfer_config.engine_id).encode()).digest()
        out["cluster_id"] = int.from_bytes(digest[:8], "little") >> 1
    return out


# ------------------------------------------------------------------------------------- metadata
@dataclasses.dataclass
class LlmddHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start: where this worker's llmdd engine listens."""

    host: str
    port: int
    cluster_id: int
    layout: str


@dataclasses.dataclass
class RecvJob:
    """One decode request's pull: remote blocks ``src`` into local blocks ``dst``."""

    req_id: str
    remote_request_id: str
    cluster_id: int
    host: str
    port: int
    src: list
    dst: list
    layout: str
    retried: bool = False


@dataclasses.dataclass
class LlmddConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step."""

    recv: list = dataclasses.field(default_factory=list)            # RecvJob
    send: dict = dataclasses.field(default_factory=dict)            # req_id -> free timeout (s)


def _layout_of(kv_caches: dict) -> tuple[list, str]:
    """The tensors of vLLM's KV cache in layer order and a fingerprint of their per-block layout
    (equal on both sides or a pull would move bytes of another shape)."""
    names = list(kv_caches)
    first = kv_caches[names[0]]
    shapes = {tuple(t.shape) for t in kv_caches.values()}
    dtypes = {t.dtype for t in kv_caches.values()}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"LlmddConnector: every KV layer must have one shape and dtype, got {shapes} {dtypes}")
    block_shape = "x".join(str(d) for d in first.shape[1:])
    return [kv_caches[n] for n in names], f"{len(names)}L:{block_shape}:{str(first.dtype).replace('torch.', '')}"


# ------------------------------------------------------------------------------------- connector
class LlmddConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector moving prompt KV blocks through llmdd (see the module docstring)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _route_llmdd_log()
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise ValueError("LlmddConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only "
                             f"(got {par.tensor_parallel_size}, {par.pipeline_parallel_size}); see docs/vllm.md")
        self._opts = _options(vllm_config)
        kv_role = vllm_config.kv_transfer_config.kv_role
        self._producer = kv_role in ("kv_producer", "kv_both")
        self._consumer = kv_role in ("kv_consumer", "kv_both")
        self._block_size = vllm_config.cache_config.block_size
        self._sched: Optional[_SchedulerSide] = None
        self._worker: Optional[_WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self)

    def _scheduler_side(self) -> "_SchedulerSide":
        if self._sched is None:   # vLLM calls the scheduler-side methods on a SCHEDULER-role connector only
            raise RuntimeError("LlmddConnector: a scheduler-side call on a worker-role connector")
        return self._sched

    def _worker_side(self) -> "_WorkerSide":
        if self._worker is None:   # vLLM calls the worker-side methods on a WORKER-role connector only
            raise RuntimeError("LlmddConnector: a worker-side call on a scheduler-role connector")
        return self._worker

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler_side().request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # the request's own blocks are transferred (not a hash-addressed store): every group
        return self._kv_cache_config.transfer_group_ids

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self._scheduler_side().set_handshake(metadata)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return None if self._worker is None else self._worker.handshake

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None        # whole-request loads, completed before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return None        # the decoder pulls; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker_side().transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        res = self._worker_side().transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def counters(self) -> dict:
        """The worker's counters (``worker_counters`` reads them through ``LLM.collective_rpc``)."""
        return {} if self._worker is None else self._worker.counters()


# ------------------------------------------------------------------------------------- scheduler
class _SchedulerSide:
    def __init__(self, conn: LlmddConnector) -> None:
        self.c = conn
        self.handshake: Optional[LlmddHandshake] = None
        self.recv: list = []
        self.send: dict = {}

    def set_handshake(self, metadata: dict) -> None:
        metas = [m for m in metadata.values() if isinstance(m, LlmddHandshake)]
        if metas:
            self.handshake = metas[0]

    @staticmethod
    def _remote(request: "Request") -> Optional[dict]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        return params

    def _valid(self, request: "Request", params: dict) -> bool:
        """Bound what the prefill instance (via the client) sent against this request."""
        if not all(k in params for k in _REQUIRED):
            _log.warning("llmdd_vllm: request %s has do_remote_prefill without %s: computed locally",
                         request.request_id, [k for k in _REQUIRED if k not in params])
            return False
        blocks = params["remote_block_ids"]
        # one list (NixlConnector sends one per KV cache group; single-group layouts only)
        if isinstance(blocks, (list, tuple)) and len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
            blocks = blocks[0]
        need = math.ceil(request.num_prompt_tokens / self.c._block_size)
        ok = (isinstance(blocks, (list, tuple)) and len(blocks) >= need
              and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2 ** 32 for b in blocks)
              and isinstance(params["remote_port"], int) and 0 < params["remote_port"] < 65536
              and isinstance(params["remote_cluster_id"], int) and 0 <= params["remote_cluster_id"] < 2 ** 64
              and isinstance(params["remote_request_id"], str)
              and len(params["remote_request_id"].encode()) <= _MAX_TAG
              and isinstance(params["remote_host"], str))
        if not ok:
            _log.warning("llmdd_vllm: request %s has malformed kv_transfer_params (%d prompt blocks needed): "
                         "computed locally", request.request_id, need)
        return ok

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None or not self.c._consumer or not self._valid(request, params):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = self._remote(request)
        if params is None or not self.c._consumer:
            return
        params["do_remote_prefill"] = False            # one transfer per request
        if num_external_tokens <= 0:
            return                                      # all local (prefix cache): the owner frees by timeout
        bs = self.c._block_size
        n_prompt = request.num_prompt_tokens
        first = (n_prompt - num_external_tokens) // bs  # local prefix hits are block aligned
        need = math.ceil(n_prompt / bs)
        local = list(blocks.get_block_ids()[0])
        remote = params["remote_block_ids"]
        if len(remote) == 1 and isinstance(remote[0], (list, tuple)):
            remote = remote[0]
        self.recv.append(RecvJob(req_id=request.request_id, remote_request_id=params["remote_request_id"],
                                 cluster_id=params["remote_cluster_id"], host=params["remote_host"],
                                 port=params["remote_port"], src=list(remote[first:need]),
                                 dst=local[first:need], layout=params["llmdd_layout"]))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = LlmddConnectorMetadata(recv=self.recv, send=self.send)
        self.recv, self.send = [], {}
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.c._producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None                          # aborted: nothing to hand over
        if not block_ids or self.handshake is None:
            return False, None
        self.send[request.request_id] = float(self.c._opts["free_timeout_s"])
        hs = self.handshake
        return True, dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=list(block_ids),
                          remote_engine_id=self.c._kv_transfer_config.engine_id,
                          remote_request_id=request.request_id, remote_host=hs.host, remote_port=hs.port,
                          remote_cluster_id=hs.cluster_id, remote_num_tokens=request.num_computed_tokens,
                          llmdd_layout=hs.layout)


# ------------------------------------------------------------------------------------- worker
class _TagFrees:
    """llmdd plugin on the prefill worker: "peer finished reading" events carrying a tag."""

    def __init__(self, sink: "queue.SimpleQueue") -> None:
        self.sink = sink

    @llmdd.plugin.hookimpl
    def llmdd_cache_transition(self, event) -> None:
        if event.trigger == "peer_read":
            tag = event.info.get("tag")
            if isinstance(tag, str):
                self.sink.put((tag, event.error is None))


class _WorkerSide:
    def __init__(self, conn: LlmddConnector) -> None:
        self.c = conn
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
        tensors, self.layout = _layout_of(kv_caches)
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ValueError(f"LlmddConnector: KV layer {name} is on {t.device}: llmdd has no device-memory "
                                 "path yet, only CPU KV caches can be registered (docs/vllm.md, limits)")
            if not t.is_contiguous():
                raise ValueError(f"LlmddConnector: KV layer {name} is not contiguous")
        num_blocks = int(tensors[0].shape[0])
        per_block = int(tensors[0][0].numel() * tensors[0].element_size())
        self.block_bytes = per_block * len(tensors)
        opts = self.c._opts
        cfg = LLMConfig()
        cfg.enable_cache_manager = True
        cfg.sync_kv_timeout = int(opts["sync_kv_timeout_ms"])
        if self.c._producer:
            cfg.listen_ip_info = f"{opts['host']}:{opts['port']}"
        options = dict(cfg.generate_options())
        if opts["transport"]:
            options["llmdd.transport"] = opts["transport"]
        options.update(ENGINE_DEFAULTS)
        options.update({str(k): str(v) for k, v in dict(opts["llmdd_options"]).items()})
        role = LLMRole.MIX if (self.c._producer and self.c._consumer) else (
            LLMRole.PROMPT if self.c._producer else LLMRole.DECODER)
        cpus = _worker_cpus()
        with _threads_started_on(cpus):
            self._start_engine(role, options, num_blocks, per_block, tensors)
        self.stats["llmdd_cpus"] = sorted(cpus) if cpus else None
        _log.info("llmdd_vllm: registered %d KV layers x %d blocks (%s), cluster %d, listen %s, llmdd threads on CPUs %s "
                  "(the worker thread's: %s)", len(tensors), num_blocks, self.layout, opts["cluster_id"],
                  self.stats["listen"], self.stats["llmdd_cpus"],
                  sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)

    def _start_engine(self, role, options: dict, num_blocks: int, per_block: int, tensors: list) -> None:
        opts = self.c._opts
        dd = LLMDataDist(role, int(opts["cluster_id"]))
        if self.c._producer:
            dd.add_plugin(_TagFrees(self.tags), name="llmdd_vllm_tag_frees")
        dd.init(options)
        # vLLM's CPU backend: one tensor per layer, every layer a view of one shared buffer; each
        # view is one tensor of the blocks cache, registered in place as raw bytes per block
        views = [t.view(num_blocks, -1).view(torch.uint8) for t in tensors]
        desc = CacheDesc(len(views), [num_blocks, per_block], DataType.DT_UINT8)
        key = BlocksCacheKey(int(opts["cluster_id"]), _MODEL_ID) if self.c._producer else None
        try:
            self.cache = dd.cache_manager.register_blocks_cache(desc, views, key)
        except LLMException:
            dd.finalize()
            raise
        self.dd = dd
        port = dd.statistics()["listen"][1] if self.c._producer else 0
        self.handshake = LlmddHandshake(host=opts["host"], port=int(port), cluster_id=int(opts["cluster_id"]),
                                        layout=self.layout)
        self.stats.update(cluster_id=int(opts["cluster_id"]), listen=[opts["host"], int(port)])
        if self.c._consumer:
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
            horizon = float(self.c._opts["free_timeout_s"])
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
        budget_ms = int(self.c._opts["link_timeout_ms"])
        attempt_ms = max(500, budget_ms // 3)
        deadline = time.monotonic() + budget_ms / 1000.0
        attempt = 0
        while True:
            attempt += 1
            left_ms = max(1, min(attempt_ms, int((deadline - time.monotonic()) * 1000)))
            t0 = time.monotonic()
            ret, rets = dd.link_clusters([_cluster_info(job.cluster_id, job.host, job.port, self.c._opts["local_host"])], left_ms)
            took = time.monotonic() - t0
            status = rets[0] if rets else ret
            if status == LLMStatusCode.LLM_SUCCESS:
                _log.info("llmdd_vllm: linked to cluster %d at %s:%d in %.3f s (attempt %d)", job.cluster_id,
                          job.host, job.port, took, attempt)
                break
            why = _link_failure(dd.statistics(), job.cluster_id)
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
            self._engine().unlink_clusters([_cluster_info(cluster_id, host, port, self.c._opts["local_host"])], 1000, force=True)
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
            self._engine().cache_manager.pull_blocks_async(BlocksCacheKey(job.cluster_id, _MODEL_ID), self.cache,
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


def _link_failure(stats: dict, cluster_id: int) -> str:
    """Why the last link_clusters to ``cluster_id`` failed: llmdd's record of the failed attempt
    (``statistics()["link_failures"]``), else the link's own last error."""
    failed = (stats.get("link_failures") or {}).get(cluster_id)
    if failed:
        return str(failed.get("error"))
    return str(stats["links"].get(cluster_id, {}).get("last_error") or "no reason recorded")


def _cluster_info(cluster_id: int, host: str, port: int, local_host: Optional[str]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info(local_host or "127.0.0.1", 0)
    info.append_remote_ip_info(host, port)
    return info


def worker_counters(worker: Any = None) -> dict:
    """The worker-side connector's counters, for ``LLM.collective_rpc(worker_counters)``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    conn = get_kv_transfer_group()
    return conn.counters() if isinstance(conn, LlmddConnector) else {}
