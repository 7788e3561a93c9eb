"""The shm transport's C hot path: loading the extension ``llmdd_shm._shmfast`` (its ABI checked, or why
it is not used), the statuses its ``batch`` / ``copy`` calls return, and :func:`data_path`."""

from __future__ import annotations

import os
from typing import Any

#: the ``ABI`` constant this Python code expects of the C extension ``llmdd_shm._shmfast``
NATIVE_ABI = 4
#: ``LLMDD_SHM_NATIVE=0`` forces the pure-Python path in this process (to run the suite on it)
ENV_NATIVE = "LLMDD_SHM_NATIVE"


def _load_native() -> tuple[Any, str]:
    """The C hot path, or ``(None, why not)``; never raises."""
    if os.environ.get(ENV_NATIVE, "").strip().lower() in ("0", "off", "no", "false"):
        return None, f"disabled by {ENV_NATIVE}=0"
    try:
        from . import _shmfast  # type: ignore[attr-defined]  # a C extension: no source or stub for mypy
    except ImportError as exc:
        return None, f"C extension llmdd_shm._shmfast not built ({exc}); reinstall the plugin with gcc and Python.h"
    if getattr(_shmfast, "ABI", None) != NATIVE_ABI:
        return None, (f"C extension llmdd_shm._shmfast has ABI {getattr(_shmfast, 'ABI', None)}, this code needs "
                      f"{NATIVE_ABI} (stale build: reinstall the plugin)")
    return _shmfast, ""


native, NATIVE_REASON = _load_native()

# statuses of _shmfast.batch / copy (see _shmfast.c)
ST_OK, ST_FALLBACK, ST_BUSY, ST_CLOSED, ST_STALE, ST_CMA, ST_NOPROGRESS, ST_DEAD, ST_LOCKERR = range(9)


def data_path() -> dict:
    """Which data path this process's shm batches take: ``{"native": bool, "path": str, "reason": str}``."""
    if native is not None:
        return {"native": True, "path": f"C extension (llmdd_shm._shmfast, ABI {NATIVE_ABI}): small blocks "
                                        f"transfers in one call, other batches in one call per chunk",
                "reason": ""}
    return {"native": False, "path": "pure Python", "reason": NATIVE_REASON}
