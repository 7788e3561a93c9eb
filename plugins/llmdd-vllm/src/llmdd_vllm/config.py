"""The connector's configuration: ``kv_connector_extra_config`` keys and their checks, the llmdd engine
options it sets, what one instance's two sides share (:class:`ConnectorSettings`), and the KV layout
fingerprint both instances must agree on."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any, Optional

from .lease import MAX_LEASE_S
from .tp import MAX_TP

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["DEFAULTS", "ENGINE_DEFAULTS", "REQUIRED", "MODEL_ID", "LINK_ATTEMPTS", "MAX_TAG", "MAX_REQUEST_ID",
           "ConnectorSettings", "options", "layout_of", "compat_of", "compat_mismatch", "rank_cluster_id"]

#: keys of ``kv_connector_extra_config`` and their defaults (docs/vllm.md lists them)
DEFAULTS: dict = {
    "host": "127.0.0.1",        # the address the prefill worker listens on and announces
    "port": 0,                  # its llmdd listen port (0: any free port, announced to the scheduler)
    "local_host": None,         # decode side: this host's address for its own data endpoints (cross-host
                                # tcp: the address the prefill host reaches; default loopback)
    "cluster_id": None,         # the llmdd cluster id of this instance (default: from vLLM's engine_id)
    "transport": None,          # force "shm" or "tcp" (default: llmdd's automatic choice)
    "sync_kv_timeout_ms": 30000,  # deadline of one transfer step (llmdd sync_kv_timeout): as long as the
                                # peer timeout below, since both wait on a busy vLLM worker (docs/vllm.md)
    "link_timeout_ms": 30000,   # deadline of linking to a prefill instance (attempts of a third each)
    "lease_s": 30,              # prefill side: a handed-over request's blocks are held this long
                                # unless its decoder renews the lease (lease.py)
    "llmdd_options": {},        # further llmdd engine options, passed to init as given (over ENGINE_DEFAULTS)
}
#: llmdd engine options the connector sets unless llmdd_options overrides them: vLLM's workers are
#: busy processes (and a loaded host may deschedule them for seconds), so a link is declared lost
#: after 30 s of silence instead of llmdd's 5 s; a killed peer is still seen at once (its sockets close)
ENGINE_DEFAULTS: dict = {"llmdd.peer_timeout_ms": "30000", "llmdd.keepalive_interval_ms": "2000"}
#: the parameters a decode request needs from the prefill instance (all set by request_finished)
REQUIRED = ("remote_block_ids", "remote_request_id", "remote_host", "remote_port", "remote_cluster_id",
             "llmdd_layout", "llmdd_ranks", "llmdd_compat", "llmdd_fence", "llmdd_lease_s")
MODEL_ID = 0
LINK_ATTEMPTS = 3
MAX_TAG = 256
#: the longest prefill request id accepted (the read tag adds the reader's rank and count)
MAX_REQUEST_ID = 200


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What the scheduler side and the worker side of one instance read of its configuration."""

    opts: dict                  # kv_connector_extra_config over DEFAULTS, checked (options())
    producer: bool              # kv_role kv_producer or kv_both: serves its blocks
    consumer: bool              # kv_role kv_consumer or kv_both: pulls blocks
    block_size: int             # vLLM's tokens per block
    engine_id: Any              # vLLM's kv_transfer_config.engine_id
    tp_size: int                # tensor_parallel_size of this instance
    compat: dict                # what a peer instance must match (compat_of); tp is compared by plan


def options(vllm_config: "VllmConfig") -> dict:
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
    lease = out["lease_s"]
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0 < lease <= MAX_LEASE_S:
        raise ValueError(f"LlmddConnector: lease_s must be a number of seconds in (0, {MAX_LEASE_S:g}], not {lease!r}")
    if out["cluster_id"] is None:
        digest = hashlib.sha256(str(vllm_config.kv_transfer_config.engine_id).encode()).digest()
        out["cluster_id"] = int.from_bytes(digest[:8], "little") >> 1
    return out


def layout_of(kv_caches: dict) -> tuple[list, int, str]:
    """The tensors of vLLM's KV cache in layer order, the KV heads of this rank and a fingerprint
    of one unit (one head of one block, all layers): equal on both sides or a pull would move
    bytes of another shape.  vLLM's CPU layout per layer: ``[blocks, heads, block_size, 2*head_size]``."""
    names = list(kv_caches)
    first = kv_caches[names[0]]
    shapes = {tuple(t.shape) for t in kv_caches.values()}
    dtypes = {t.dtype for t in kv_caches.values()}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"LlmddConnector: every KV layer must have one shape and dtype, got {shapes} {dtypes}")
    if len(first.shape) != 4:
        raise ValueError(f"LlmddConnector: a KV layer of shape {tuple(first.shape)}: expected vLLM's CPU layout "
                         "[blocks, kv heads, block size, 2 x head size]")
    unit = "x".join(str(d) for d in first.shape[2:])
    return ([kv_caches[n] for n in names], int(first.shape[1]),
            f"{len(names)}L:{unit}:{str(first.dtype).replace('torch.', '')}")


def compat_of(vllm_config: "VllmConfig") -> dict:
    """What both instances must agree on before KV moves between them (the weights themselves are
    not compared: two checkpoints of one architecture and shape pass)."""
    import llmdd

    mc = vllm_config.model_config
    return {"model": list(getattr(mc.hf_config, "architectures", None) or [type(mc.hf_config).__name__]),
            "layers": int(mc.get_num_layers(vllm_config.parallel_config)),
            "kv_heads": int(mc.get_total_num_kv_heads()), "head_size": int(mc.get_head_size()),
            "dtype": str(mc.dtype).replace("torch.", ""),
            "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "block_size": int(vllm_config.cache_config.block_size), "llmdd": llmdd.__version__}


def compat_mismatch(local: dict, remote) -> Optional[str]:
    """None when a peer's compat record (``remote``, from its kv_transfer_params) matches ``local``;
    else a message naming both sides' values."""
    if not isinstance(remote, dict) or len(remote) > 64:
        return f"no compatibility record from the prefill instance (got {type(remote).__name__})"

    def show(v: Any) -> str:
        r = repr(v)
        return r if len(r) <= 80 else r[:77] + "..."

    diff = [f"{show(k)[1:-1] if isinstance(k, str) else show(k)}: prefill {show(remote.get(k))}, decode {show(local.get(k))}"
            for k in sorted(set(local) | set(remote), key=str) if k != "tp" and remote.get(k) != local.get(k)]
    p_tp, d_tp = remote.get("tp"), local.get("tp")
    if not (isinstance(p_tp, int) and not isinstance(p_tp, bool) and 0 < p_tp <= MAX_TP
            and isinstance(d_tp, int) and (p_tp % d_tp == 0 or d_tp % p_tp == 0)):
        diff.append(f"tensor_parallel_size: prefill {show(p_tp)}, decode {show(d_tp)} (one must divide the other)")
    return "; ".join(diff) or None


def rank_cluster_id(base: int, rank: int) -> int:
    """The llmdd cluster id of tensor-parallel rank ``rank`` of an instance whose id is ``base``."""
    return (int(base) + int(rank)) % (1 << 63)
