"""The ucx transport's options: their names, their defaults, and the UCX environment they map to."""

from __future__ import annotations

from typing import Any, Mapping

OPT_TLS = "llmdd.ucx.tls"                       # -> UCX_TLS for this endpoint's UCX context
OPT_DEVICES = "llmdd.ucx.devices"               # -> NIXL UCX backend "ucx_devices" (UCX_NET_DEVICES)
OPT_CHUNK_BYTES = "llmdd.ucx.chunk_bytes"
OPT_CHUNK_DESCS = "llmdd.ucx.chunk_descs"
OPT_INFLIGHT = "llmdd.ucx.inflight"
OPT_CONTROL_TIMEOUT = "llmdd.ucx.control_timeout"
OPT_DRAIN_TIMEOUT = "llmdd.ucx.drain_timeout"
OPT_SPIN_US = "llmdd.ucx.spin_us"
OPT_PROGRESS_THREAD = "llmdd.ucx.progress_thread"  # 1: NIXL's own progress thread (busy-polls on cma/shm)
OPT_NOTIF_IDLE_MS = "llmdd.ucx.notif_idle_ms"      # the notification loop's longest idle sleep
OPT_THREADS = "llmdd.ucx.threads"               # posting threads (and UCX workers) of a split batch; 1: no split
OPT_SPLIT_MIN = "llmdd.ucx.split_min_bytes"     # a batch of at least this many bytes is split across them
OPT_TRAFFIC_CLASS = "llm.RdmaTrafficClass"      # -> UCX_IB_TRAFFIC_CLASS
OPT_SERVICE_LEVEL = "llm.RdmaServiceLevel"      # -> UCX_IB_SL
DEFAULTS: dict[str, Any] = {
    OPT_TLS: "", OPT_DEVICES: "", OPT_CHUNK_BYTES: 256 << 20, OPT_CHUNK_DESCS: 1 << 16,
    OPT_INFLIGHT: 4, OPT_CONTROL_TIMEOUT: 5.0, OPT_DRAIN_TIMEOUT: 60.0, OPT_SPIN_US: 50.0,
    OPT_PROGRESS_THREAD: 0, OPT_NOTIF_IDLE_MS: 20.0, OPT_THREADS: 2, OPT_SPLIT_MIN: 8 << 20,
}

#: the most posting threads an endpoint may have (llmdd.ucx.threads is clamped to 1..this)
THREADS_MAX = 16


def ucx_env(options: Mapping[str, Any]) -> dict:
    env = {}
    if options.get(OPT_TLS):
        env["UCX_TLS"] = str(options[OPT_TLS])
    tc = options.get(OPT_TRAFFIC_CLASS)
    if tc not in (None, ""):
        env["UCX_IB_TRAFFIC_CLASS"] = str(int(tc))
    sl = options.get(OPT_SERVICE_LEVEL)
    if sl not in (None, ""):
        env["UCX_IB_SL"] = str(int(sl))
    return env
