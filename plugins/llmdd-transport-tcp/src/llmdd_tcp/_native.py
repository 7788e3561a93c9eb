"""The tcp transport's C hot path: loading ``llmdd_tcp._tcpfast`` (its ABI checked, or why it is not
used) and :func:`data_path`.  What it does is in its source, ``_tcpfast.c``; where it is used:
:mod:`._quick` (a client's one-call transfer) and :meth:`TcpEndpoint._serve_native` (the owner's
small requests)."""

from __future__ import annotations

import os
from typing import Any

#: the ``ABI`` constant this Python code expects of ``llmdd_tcp._tcpfast``
NATIVE_ABI = 1
#: ``LLMDD_TCP_NATIVE=0`` forces the pure-Python path in this process (how the suite runs on it)
ENV_NATIVE = "LLMDD_TCP_NATIVE"


def _load() -> tuple[Any, str]:
    """The extension, or ``(None, why not)``; never raises."""
    if os.environ.get(ENV_NATIVE, "").strip().lower() in ("0", "off", "no", "false"):
        return None, f"disabled by {ENV_NATIVE}=0"
    try:
        from . import _tcpfast  # type: ignore[attr-defined]  # a C extension: no source or stub for mypy
    except ImportError as exc:
        return None, f"C extension llmdd_tcp._tcpfast not built ({exc}); reinstall the plugin with gcc and Python.h"
    if getattr(_tcpfast, "ABI", None) != NATIVE_ABI:
        return None, (f"C extension llmdd_tcp._tcpfast has ABI {getattr(_tcpfast, 'ABI', None)}, this code needs "
                      f"{NATIVE_ABI} (a stale build: reinstall the plugin)")
    return _tcpfast, ""


native, NATIVE_REASON = _load()


def data_path() -> dict:
    """Which path this process's tcp small transfers take: ``{"native": bool, "path": str, "reason": str}``."""
    if native is not None:
        return {"native": True, "reason": "",
                "path": f"C extension (llmdd_tcp._tcpfast, ABI {NATIVE_ABI}): one-call small transfers and the "
                        f"owner's serving of small requests without Python per request"}
    return {"native": False, "path": "pure Python", "reason": NATIVE_REASON}
