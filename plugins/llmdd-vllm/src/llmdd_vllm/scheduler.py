"""The connector's scheduler side: decides per request, from vLLM's scheduler loop, what is pulled
and what is handed over (it never waits for a link or a transfer)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .config import MAX_REQUEST_ID, REQUIRED, ConnectorSettings, compat_mismatch
from .lease import MAX_LEASE_S, Generations
from .metadata import LlmddConnectorMetadata, LlmddHandshake, RecvJob

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

_log = logging.getLogger("vllm.llmdd_vllm")


class SchedulerSide:
    """The scheduler-side half (engine-core process): which requests load remote blocks, which hand theirs over."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.s = settings
        self.handshake: Optional[LlmddHandshake] = None
        self.ranks: list = []           # per tensor-parallel rank of this instance: [host, port, cluster id]
        self.compat: dict = dict(settings.compat)
        self.recv: list = []
        self.send: dict = {}
        self.refused: set = set()       # compatibility messages already logged
        self.epochs: list = []          # per tensor-parallel rank: the fence epoch of its registration
        self.gens = Generations()       # prefill: the fence generation of each block (lease.py)
        self.pulling: set = set()       # decode: requests whose pull is queued or running
        self.aborts: list = []          # decode: requests aborted while pulling (told to the workers)

    def set_handshake(self, metadata: dict) -> None:
        metas = {int(r): m for r, m in metadata.items() if isinstance(m, LlmddHandshake)}
        if sorted(metas) != list(range(self.s.tp_size)):
            _log.warning("llmdd_vllm: handshake metadata from tensor-parallel ranks %s of %d: this instance hands "
                         "no blocks over", sorted(metas), self.s.tp_size)
            return
        self.handshake = metas[0]
        self.ranks = [[metas[r].host, metas[r].port, metas[r].cluster_id] for r in range(self.s.tp_size)]
        self.epochs = [int(metas[r].fence_epoch) for r in range(self.s.tp_size)]
        self.compat["layout"] = metas[0].layout

    @staticmethod
    def _remote(request: "Request") -> Optional[dict]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        return params

    def _valid(self, request: "Request", params: dict) -> bool:
        """Bound what the prefill instance (via the client) sent against this request."""
        if not all(k in params for k in REQUIRED):
            _log.warning("llmdd_vllm: request %s has do_remote_prefill without %s: computed locally",
                         request.request_id, [k for k in REQUIRED if k not in params])
            return False
        blocks = params["remote_block_ids"]
        # one list (NixlConnector sends one per KV cache group; single-group layouts only)
        if isinstance(blocks, (list, tuple)) and len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
            blocks = blocks[0]
        need = math.ceil(request.num_prompt_tokens / self.s.block_size)
        why = compat_mismatch(self.compat, params["llmdd_compat"])
        if why is not None:
            if why not in self.refused and len(self.refused) < 64:
                self.refused.add(why)
                _log.warning("llmdd_vllm: request %s: the prefill instance is not compatible (%s): computed locally",
                             request.request_id, why)
            return False
        ranks = params["llmdd_ranks"]
        ok = (isinstance(blocks, (list, tuple)) and len(blocks) >= need
              and _fence_ok(params["llmdd_fence"], len(blocks), params["llmdd_compat"]["tp"])
              and isinstance(params["llmdd_lease_s"], (int, float)) and not isinstance(params["llmdd_lease_s"], bool)
              and 0 < params["llmdd_lease_s"] <= MAX_LEASE_S
              and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2 ** 32 for b in blocks)
              and isinstance(params["remote_port"], int) and 0 < params["remote_port"] < 65536
              and isinstance(params["remote_cluster_id"], int) and 0 <= params["remote_cluster_id"] < 2 ** 64
              and isinstance(params["remote_request_id"], str)
              and len(params["remote_request_id"].encode()) <= MAX_REQUEST_ID
              and isinstance(params["remote_host"], str)
              and isinstance(ranks, (list, tuple)) and len(ranks) == params["llmdd_compat"]["tp"]
              and all(_endpoint(r) for r in ranks))
        if not ok:
            _log.warning("llmdd_vllm: request %s has malformed kv_transfer_params (%d prompt blocks needed): "
                         "computed locally", request.request_id, need)
        return ok

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = self._remote(request)
        if params is None or not self.s.consumer or not self._valid(request, params):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = self._remote(request)
        if params is None or not self.s.consumer:
            return
        params["do_remote_prefill"] = False            # one transfer per request
        if num_external_tokens <= 0:
            return                                      # all local (prefix cache): the owner frees by timeout
        bs = self.s.block_size
        n_prompt = request.num_prompt_tokens
        first = (n_prompt - num_external_tokens) // bs  # local prefix hits are block aligned
        need = math.ceil(n_prompt / bs)
        local = list(blocks.get_block_ids()[0])
        remote = params["remote_block_ids"]
        if len(remote) == 1 and isinstance(remote[0], (list, tuple)):
            remote = remote[0]
        fence = params["llmdd_fence"]
        self.recv.append(RecvJob(req_id=request.request_id, remote_request_id=params["remote_request_id"],
                                 ranks=[tuple(r) for r in params["llmdd_ranks"]], src=list(remote[first:need]),
                                 dst=local[first:need], layout=params["llmdd_layout"],
                                 fence_epochs=list(fence["epochs"]), gens=list(fence["gens"][first:need]),
                                 lease_s=float(params["llmdd_lease_s"]), created_s=time.monotonic()))
        self.pulling.add(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = LlmddConnectorMetadata(recv=self.recv, send=self.send, abort=self.aborts)
        self.recv, self.send, self.aborts = [], {}, []
        return meta

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """vLLM's aggregate of the workers' results, before it frees the blocks of ``finished_sending``:
        every rank fenced those blocks once (the generations advance), and ``finished_recving`` pulls ended."""
        self.gens.given_back(output.finished_sending or ())
        self.pulling.difference_update(output.finished_recving or ())

    def _decode_finished(self, request: "Request") -> None:
        """A decode request finished: aborted while its pull was queued or running, its prefill
        instance is told (the workers send an abort note) and gives its blocks back at once."""
        if request.request_id in self.pulling:
            self.pulling.discard(request.request_id)
            self.aborts.append(request.request_id)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        from vllm.v1.request import RequestStatus

        if self.s.consumer:
            self._decode_finished(request)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.s.producer:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None                          # aborted: nothing to hand over
        if not block_ids or self.handshake is None:
            return False, None
        if len(request.request_id.encode()) > MAX_REQUEST_ID:
            _log.warning("llmdd_vllm: request id %r longer than %d bytes: its blocks are not handed over",
                         request.request_id[:40], MAX_REQUEST_ID)
            return False, None
        lease_s = float(self.s.opts["lease_s"])
        self.send[request.request_id] = (lease_s, list(block_ids))
        gens = self.gens.handed_over(request.request_id, block_ids)
        hs = self.handshake
        return True, dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=list(block_ids),
                          remote_engine_id=self.s.engine_id,
                          remote_request_id=request.request_id, remote_host=hs.host, remote_port=hs.port,
                          remote_cluster_id=hs.cluster_id, remote_num_tokens=request.num_computed_tokens,
                          llmdd_layout=hs.layout, llmdd_ranks=[list(r) for r in self.ranks],
                          llmdd_compat=dict(self.compat),
                          llmdd_fence={"epochs": list(self.epochs), "gens": gens}, llmdd_lease_s=lease_s)


def _fence_ok(fence, blocks: int, p_tp) -> bool:
    """The prefill's fence record, bounded: one epoch per prefill rank, one generation per block."""
    def u63(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63
    return (isinstance(fence, dict) and isinstance(fence.get("epochs"), (list, tuple))
            and isinstance(fence.get("gens"), (list, tuple)) and len(fence["epochs"]) == p_tp
            and len(fence["gens"]) == blocks and all(u63(e) and e > 0 for e in fence["epochs"])
            and all(u63(g) for g in fence["gens"]))


def _endpoint(r) -> bool:
    """One prefill rank's endpoint in kv_transfer_params: [host, port, cluster id], bounded."""
    return (isinstance(r, (list, tuple)) and len(r) == 3 and isinstance(r[0], str) and 0 < len(r[0]) <= 255
            and isinstance(r[1], int) and not isinstance(r[1], bool) and 0 < r[1] < 65536
            and isinstance(r[2], int) and not isinstance(r[2], bool) and 0 <= r[2] < 2 ** 63)
