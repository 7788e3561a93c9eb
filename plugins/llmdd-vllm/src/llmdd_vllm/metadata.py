"""The metadata vLLM carries between the connector's sides: the worker's handshake, the
scheduler's per-step jobs."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

__all__ = ["LlmddHandshake", "RecvJob", "LlmddConnectorMetadata"]


@dataclasses.dataclass
class LlmddHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start: where this worker's llmdd engine listens."""

    host: str
    port: int
    cluster_id: int
    layout: str                 # one unit (one head of one block, all layers): config.layout_of
    tp_rank: int = 0


@dataclasses.dataclass
class RecvJob:
    """One decode request's pull: remote blocks ``src`` into local blocks ``dst``; each worker
    rank reads its heads from the prefill ranks holding them (tp.plan)."""

    req_id: str
    remote_request_id: str
    ranks: list                 # per prefill tensor-parallel rank: (host, port, llmdd cluster id)
    src: list
    dst: list
    layout: str
    created_s: float = 0.0      # time.monotonic() when the scheduler made the job (the pull's breakdown)


@dataclasses.dataclass
class LlmddConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step."""

    recv: list = dataclasses.field(default_factory=list)            # RecvJob
    send: dict = dataclasses.field(default_factory=dict)            # req_id -> free timeout (s)
