"""The link options of one engine (keepalive, peer timeout, handshake deadline, TLS, connection
caps, the forced transport), read from the engine's options once and checked (docs/configuration.md)."""

from __future__ import annotations

import os
import ssl
from typing import Optional

import attrs

from llmdd._base.options import K_TLS_CA, K_TLS_CERT, K_TLS_INSECURE, K_TLS_KEY, K_TLS_SERVER_NAME, tls_config
from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["LinkSettings", "MAX_CLUSTERS_PER_CALL"]

S = LLMStatusCode

#: llmdd's own option keys (documented in docs/configuration.md)
OPT_TRANSPORT = "llmdd.transport"
OPT_SECRET = "llmdd.auth_secret"
OPT_TLS_CERT = K_TLS_CERT
OPT_TLS_KEY = K_TLS_KEY
OPT_TLS_CA = K_TLS_CA
OPT_TLS_INSECURE = K_TLS_INSECURE          # TLS with no CA is refused at init unless this says so
OPT_TLS_SERVER_NAME = K_TLS_SERVER_NAME    # the name a client checks the server's certificate against
OPT_KEEPALIVE_MS = "llmdd.keepalive_interval_ms"
OPT_PEER_TIMEOUT_MS = "llmdd.peer_timeout_ms"
OPT_DATA_HOST = "llmdd.data_host"
OPT_HANDSHAKE_MS = "llmdd.handshake_timeout_ms"
OPT_MAX_PENDING = "llmdd.max_pending_connections"
OPT_MAX_PENDING_PER_ADDRESS = "llmdd.max_pending_per_address"
OPT_IO_WORKERS = "llmdd.io_workers"

MAX_CLUSTERS_PER_CALL = 16


def _int_option(options, key: str, default: int, *, what: str) -> int:
    text = options.get(key)
    if text is None:
        return default
    try:
        return int(text)
    except (TypeError, ValueError):
        raise LLMException(f"option {key} must be {what}, got {text!r}", status_code=S.LLM_PARAM_INVALID) from None


def _ms_option(options, key: str, default: int) -> int:
    value = _int_option(options, key, default, what="an integer (milliseconds)")
    if value <= 0:
        raise LLMException(f"option {key} must be > 0, got {value}", status_code=S.LLM_PARAM_INVALID)
    return value


def _count_option(options, key: str, default: int) -> int:
    value = _int_option(options, key, default, what="an integer")
    if not 1 <= value <= 1 << 20:
        raise LLMException(f"option {key} must be in [1, {1 << 20}], got {value}", status_code=S.LLM_PARAM_INVALID)
    return value


@attrs.frozen(kw_only=True)
class LinkSettings:
    secret: Optional[bytes]
    forced_transport: Optional[str]
    keepalive_s: float
    peer_timeout_s: float
    retry_count: int
    total_time_s: Optional[float]
    server_tls: Optional[ssl.SSLContext]
    client_tls: Optional[ssl.SSLContext]
    data_host: Optional[str]
    handshake_s: float
    max_pending: int = 64
    max_pending_per_address: int = 8
    io_workers: int = 8
    client_tls_named: Optional[ssl.SSLContext] = None   # the client context that checks host names
    tls_server_name: Optional[str] = None

    @classmethod
    def from_options(cls, options) -> "LinkSettings":
        raw = options.raw
        secret = raw.get(OPT_SECRET) or os.environ.get("LLMDD_AUTH_SECRET") or None
        forced = raw.get(OPT_TRANSPORT) or None
        if forced is None and options.transfer_backend:
            # "hixl" is upstream's one-sided host-side engine: llmdd's counterpart is the tcp transport
            forced = "tcp" if options.transfer_backend == "hixl" else options.transfer_backend
        # one policy for control and tcp data connections (the tcp transport reads the same options)
        tls = tls_config(raw)
        total = options.link_total_time_s
        return cls(
            secret=secret.encode() if isinstance(secret, str) else secret,
            forced_transport=forced,
            keepalive_s=_ms_option(raw, OPT_KEEPALIVE_MS, 1000) / 1000.0,
            peer_timeout_s=_ms_option(raw, OPT_PEER_TIMEOUT_MS, 5000) / 1000.0,
            retry_count=options.link_retry_count or 1,
            total_time_s=float(total) if total else None,
            server_tls=tls.server if tls else None,
            client_tls=tls.client if tls else None,
            data_host=raw.get(OPT_DATA_HOST) or None,
            handshake_s=_ms_option(raw, OPT_HANDSHAKE_MS, 10000) / 1000.0,
            max_pending=_count_option(raw, OPT_MAX_PENDING, 64),
            max_pending_per_address=_count_option(raw, OPT_MAX_PENDING_PER_ADDRESS, 8),
            io_workers=_count_option(raw, OPT_IO_WORKERS, 8),
            client_tls_named=tls.client_named if tls else None,
            tls_server_name=tls.server_name if tls else None,
        )
