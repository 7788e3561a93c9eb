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
    fence_epoch: int = 0        # the epoch of this rank's llmdd registration of the KV cache (lease.py)


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
    fence_epochs: list = dataclasses.field(default_factory=list)   # per prefill rank (lease.py)
    gens: list = dataclasses.field(default_factory=list)           # per block of src: its generation
    lease_s: float = 30.0       # the prefill's lease: renewed every third of it while queued or running
    created_s: float = 0.0      # time.monotonic() when the scheduler made the job (the pull's breakdown)


@dataclasses.dataclass
class LlmddConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step."""

    recv: list = dataclasses.field(default_factory=list)            # RecvJob
    send: dict = dataclasses.field(default_factory=dict)            # req_id -> (lease s, vLLM block ids)
    abort: list = dataclasses.field(default_factory=list)           # decode requests aborted while pulling
