"""Lazy access to NIXL: environment set-up before UCX loads, the import, scoped UCX config, and
the mapping of NIXL's exceptions to llmdd's typed errors.

Nothing here imports NIXL at module import. :func:`load` is called by ``probe()`` and when the
first endpoint opens; it sets ``UCX_MODULES=^ib`` (unless the user set ``UCX_MODULES``) *before*
the NIXL/UCX shared libraries load: in the nixl 1.5.1 wheels UCX's IB module loads the bundled
``libnl-route-3``, whose ELF destructor segfaults at process exit on a host without RDMA
devices (every process exits with rc 139). On an RDMA cluster set ``UCX_MODULES`` yourself
(e.g. to an empty value) to keep the IB transports.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from types import ModuleType
from typing import Iterator, Mapping, Optional

from llmdd.lowlevel import Corrupt, PeerGone, Refused, TransportError

__all__ = ["load", "load_error", "scoped_env", "version_info", "PACKAGES"]

#: where NIXL's Python API may live, in order of preference
PACKAGES = ("nixl_cu12", "nixl_cu13", "nixl")

_lock = threading.Lock()
_env_lock = threading.RLock()
_api: Optional[ModuleType] = None
_error: Optional[str] = None
_pkg_name: Optional[str] = None


def _prepare_env() -> None:
    if "UCX_MODULES" not in os.environ:
        os.environ["UCX_MODULES"] = "^ib"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _import_api() -> tuple[ModuleType, str]:
    errors = []
    for pkg in PACKAGES:
        try:
            if pkg == "nixl":
                meta = importlib.import_module("nixl")
                inner = getattr(getattr(meta, "_pkg", None), "__name__", None)
                name = inner or "nixl"
            else:
                name = pkg
            return importlib.import_module(name + "._api"), name
        except ImportError as exc:
            errors.append(f"{pkg}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a broken wheel must not break llmdd
            errors.append(f"{pkg}: {exc!r}")
    raise ImportError("NIXL is not installed (pip install --no-deps nixl-cu12): " + "; ".join(errors))


def load() -> ModuleType:
    """Return NIXL's ``_api`` module, importing it once; raises ImportError with the reason."""
    global _api, _error, _pkg_name
    with _lock:
        if _api is not None:
            return _api
        if _error is not None:
            raise ImportError(_error)
        _prepare_env()
        try:
            _api, _pkg_name = _import_api()
        except ImportError as exc:
            _error = str(exc)
            raise
        import logging
        for n in ("NIXL", "nixl", _pkg_name, _pkg_name + "._api"):
            lg = logging.getLogger(n)
            if lg.level == logging.NOTSET:
                lg.setLevel(logging.WARNING)
        return _api


def load_error() -> Optional[str]:
    return _error


def version_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {"package": _pkg_name}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` while a UCX context is created, then restore.

    UCX reads its configuration (``UCX_TLS``, ``UCX_IB_TRAFFIC_CLASS``...) from the environment
    when a context is created, so per-endpoint settings are applied around agent creation under
    one process-wide lock. Variables the user set in the environment are never overridden.
    """
    with _env_lock:
        saved: dict[str, None] = {}   # the keys set here, in order
        for k, v in values.items():
            if k in os.environ:
                continue
            saved[k] = None
            os.environ[k] = str(v)
        try:
            yield
        finally:
            for k in saved:
                os.environ.pop(k, None)


def nixl_error(exc: BaseException, what: str) -> TransportError:
    """Map an exception of NIXL's bindings (``nixlRemoteDisconnectError``...) to a typed error."""
    if isinstance(exc, TransportError):
        return exc
    kind = type(exc).__name__
    if "Disconnect" in kind or "Unreach" in kind:
        return PeerGone(f"{what}: the peer agent is gone ({kind})")
    if "NotFound" in kind or "InvalidParam" in kind or "NotAllowed" in kind:
        return Refused(f"{what}: NIXL refused the descriptors ({kind}: {exc})")
    if "Backend" in kind:
        return PeerGone(f"{what}: the UCX backend failed ({kind}: {exc})")
    return Corrupt(f"{what}: unexpected NIXL failure ({kind}: {exc!r})")
