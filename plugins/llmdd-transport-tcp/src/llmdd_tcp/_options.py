"""The tcp transport's options (``llmdd.tcp.*``, and the engine's connection caps) and their defaults."""

from __future__ import annotations

from typing import Any

# options (engine options pass through; unknown keys such as "llm.RdmaTrafficClass" are ignored)
OPT_STREAMS = "llmdd.tcp.streams"
OPT_INLINE = "llmdd.tcp.inline_max_bytes"
OPT_SPLIT = "llmdd.tcp.split_min_bytes"
OPT_SEGMENT = "llmdd.tcp.segment_bytes"
OPT_SERVER_SEND_TIMEOUT = "llmdd.tcp.server_send_timeout"
OPT_PENDING_TIMEOUT = "llmdd.tcp.pending_timeout_ms"
OPT_SERVER_WORKERS = "llmdd.tcp.server_workers"
OPT_LINGER = "llmdd.tcp.linger_ms"
OPT_NATIVE = "llmdd.tcp.native"   # auto | on | off: the C hot path (llmdd_tcp._tcpfast) for this transport
OPT_SPIN = "llmdd.tcp.spin_us"   # polled without sleeping before a wait expected to be short (both sides)
OPT_MAX_PENDING = "llmdd.max_pending_connections"            # the engine's keys: one policy for every port
OPT_MAX_PENDING_PER_ADDRESS = "llmdd.max_pending_per_address"
DEFAULTS: dict[str, Any] = {OPT_STREAMS: 2, OPT_INLINE: 256 * 1024, OPT_SPLIT: 4 * 1024 * 1024,
             OPT_SEGMENT: 64 * 1024 * 1024, OPT_SERVER_SEND_TIMEOUT: 60.0, OPT_PENDING_TIMEOUT: 10000,
             OPT_SERVER_WORKERS: 8, OPT_LINGER: 50, OPT_SPIN: 150, OPT_NATIVE: "auto", OPT_MAX_PENDING: 64, OPT_MAX_PENDING_PER_ADDRESS: 8}
