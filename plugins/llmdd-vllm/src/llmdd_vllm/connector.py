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
  blocks when llmdd delivers that tag in "peer finished reading", when the decoder aborts the
  request (an abort note), or when their lease (``lease_s``, renewed by the decoder while its pull
  is queued or running) expires; it fences them first, and every pull is fenced, so a read that
  comes too late fails and is recomputed (``lease`` module docstring).

Two objects are built per instance by vLLM: the scheduler-side connector (in the engine-core
process) and one worker-side connector per worker process, which owns the llmdd engine and the
registration of vLLM's KV tensors.  They talk through vLLM's metadata objects only.
"""

from __future__ import annotations

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

from .config import DEFAULTS, ConnectorSettings, compat_of, options
from .logs import route_llmdd_log
from .metadata import LlmddConnectorMetadata, LlmddHandshake
from .scheduler import SchedulerSide
from .tp import check_tp
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LlmddConnector", "LlmddConnectorMetadata", "LlmddHandshake", "DEFAULTS", "worker_counters"]


class LlmddConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector moving prompt KV blocks through llmdd (see the module docstring)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_llmdd_log()
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise ValueError("LlmddConnector does not support pipeline parallelism: pipeline_parallel_size must be 1 "
                             f"(got {par.pipeline_parallel_size}); tensor parallelism is supported (docs/vllm.md)")
        kv_role = vllm_config.kv_transfer_config.kv_role
        compat = compat_of(vllm_config)
        check_tp(par.tensor_parallel_size, compat["kv_heads"])
        self._settings = ConnectorSettings(opts=options(vllm_config),
                                           producer=kv_role in ("kv_producer", "kv_both"),
                                           consumer=kv_role in ("kv_consumer", "kv_both"),
                                           block_size=vllm_config.cache_config.block_size,
                                           engine_id=vllm_config.kv_transfer_config.engine_id,
                                           tp_size=int(par.tensor_parallel_size),
                                           compat={**compat, "tp": int(par.tensor_parallel_size)})
        self._sched: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self._settings)
        else:
            self._worker = WorkerSide(self._settings)

    def _scheduler_side(self) -> SchedulerSide:
        if self._sched is None:   # vLLM calls the scheduler-side methods on a SCHEDULER-role connector only
            raise RuntimeError("LlmddConnector: a scheduler-side call on a worker-role connector")
        return self._sched

    def _worker_side(self) -> WorkerSide:
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

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler_side().update_connector_output(connector_output)

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
        w, t0 = self._worker_side(), time.perf_counter()
        try:
            w.start_load_kv(self._get_connector_metadata())
        finally:
            w.hook_time(t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None        # whole-request loads, completed before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return None        # the decoder pulls; nothing is pushed

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w, t0 = self._worker_side(), time.perf_counter()
        try:
            return w.transfer_results(finished_req_ids)
        finally:
            w.hook_time(t0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def counters(self) -> dict:
        """The worker's counters (``worker_counters`` reads them through ``LLM.collective_rpc``)."""
        return {} if self._worker is None else self._worker.counters()


def worker_counters(worker: Any = None) -> dict:
    """The worker-side connector's counters, for ``LLM.collective_rpc(worker_counters)``."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    conn = get_kv_transfer_group()
    return conn.counters() if isinstance(conn, LlmddConnector) else {}
