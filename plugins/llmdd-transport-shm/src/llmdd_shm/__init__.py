"""llmdd transport ``shm``: same-host, one-sided, zero-copy; the copy runs in the caller's thread.

Memory kinds
------------
* **Pool memory** (a :class:`MemRegion` whose ``backing`` is a :class:`SharedSegment`) lives in a POSIX
  shared-memory segment. Its owner describes it as ``(segment name, offset, size)``; a peer maps the
  whole segment once per (segment, channel) at ``add_remote_region`` time and copies coalesced runs
  in one C call per chunk (native path) or with numpy gathers and ``ctypes.memmove`` for long runs
  (pure-Python path, ``llmdd.lowlevel.copy_runs``). Peers map with ``shm_open`` + ``mmap`` and never touch
  ``multiprocessing``'s resource tracker and never unlink (see :mod:`llmdd_shm._seg`).
* **User memory** (numpy arrays, torch tensors: no ``backing``) is described as
  ``(pid, addr, size)`` and moved with ``process_vm_readv`` / ``process_vm_writev``, iovec arrays
  built with numpy, at most ``IOV_MAX`` per call, short transfers resumed at the exact byte
  (:mod:`llmdd_shm._cma`). It needs cross-memory attach to the peer's pid (``connect`` checks).

Batches at or above ``llmdd.shm.split_min_bytes`` (8 MiB) are split by bytes into
``llmdd.shm.threads`` (2) parts: the caller's thread copies the first, persistent copy threads
shared by the process (:class:`_CopyPool`) the others, so a large pull keeps both cores copying
and starts no thread. Smaller batches run inline in the caller's thread and return a finished
completion: no socket, no control round trip, no thread hop per transfer.
``write`` (push) is a synchronous copy, so the bytes are visible at the receiver when it is done.

One-sided safety
----------------
Every endpoint owns a *control segment* (``llmdd_<pid>_<pidns>_shmctl_<random>``, named by
``llmdd.lowlevel.segment_name`` so that a crashed endpoint's one is reclaimed): a header (magic,
endpoint id, open/closed, pid) and one slot per remote-accessible region (state
FREE/LIVE/DYING, generation, region id). Descriptors carry (slot, generation).

* The reader validates every op against the descriptors it was given and its own local
  regions with :func:`check_ops` before a byte moves (:class:`Refused`).
* While a batch runs, the reader holds a *shared* OFD lock over the byte range of the slots it
  touches; under that lock it checks that every slot is still LIVE with the descriptor's
  generation (else :class:`Refused`: deregistered by its owner, or a new incarnation).
* ``deregister`` on the owner marks the slot DYING (readers see it between chunks and stop
  with :class:`Cancelled`), then takes the *exclusive* lock on that byte: it returns only when
  no reader in any process is inside a batch touching the region. ``close`` does the same for
  the whole endpoint (header CLOSED: readers get :class:`PeerGone`).
* Owner death: ``pidfd`` (``os.kill(pid, 0)`` + ``/proc`` state where pidfds are missing) is
  checked at connect, at every batch start and when a batch fails -> :class:`PeerGone`; a CMA
  call to a dead pid fails with ``ESRCH`` -> :class:`PeerGone`. OFD locks of a dead process
  vanish with it.
* Deadlines and ``cancel`` are checked between chunks (at most ``IOV_MAX`` ops and
  ``llmdd.shm.chunk_bytes`` bytes each); after either fired no byte moves any more.

Trust level: the trust boundary is the host and user. A same-host peer of the same user can map
the segments and attach to the process anyway; the checks above keep *correct* peers from
reading freed or foreign memory, they do not sandbox a hostile one.

Modules
-------
This module holds :class:`ShmTransport` and the hook; the rest is one concept a module:
``_endpoint`` (:class:`ShmEndpoint`, its slots and pins), ``_channel`` (:class:`ShmChannel`, one peer),
``_plans`` (a validated batch as a copy plan), ``_copypool`` (the shared copy threads), ``_format``
(descriptor payloads and the control segment's layout), ``_host`` (same-host identity, process
liveness, ptrace permission), ``_hotpath`` (loading the C extension), ``_config`` (options),
``_quick`` (one-call small transfers), ``_cma`` (cross-memory attach), ``_seg`` (segment mapping).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping as TMapping, Union

from llmdd.abc import Transport, TransportInfo
from llmdd.lowlevel import Refused
from llmdd.plugin import hookimpl

from . import _cma, _quick, _seg
from ._channel import ShmChannel
from ._cma import probe_cma
from ._config import OPT_CHUNK, OPT_GIL, OPT_NATIVE, OPT_SPLIT, OPT_THREADS, DEFAULTS
from ._endpoint import ShmEndpoint
from ._format import KIND_CMA, KIND_SHM, MAX_SLOTS, VERSION, EndpointFields, RegionFields, endpoint_fields
from ._format import region_fields
from ._host import allow_same_user_tracers, dev_shm_usable, host_identity
from ._hotpath import ENV_NATIVE, NATIVE_ABI, NATIVE_REASON, native, data_path

__all__ = ["ShmTransport", "ShmEndpoint", "ShmChannel", "hookimpl", "llmdd_register_transports",
           "host_identity", "data_path",
           # the descriptors' payloads, the options and the C hot path's state (importable as before the split)
           "VERSION", "MAX_SLOTS", "KIND_SHM", "KIND_CMA", "EndpointFields", "RegionFields", "endpoint_fields",
           "region_fields", "OPT_THREADS", "OPT_SPLIT", "OPT_CHUNK", "OPT_NATIVE", "OPT_GIL", "NATIVE_ABI",
           "ENV_NATIVE", "NATIVE_REASON", "_cma", "_quick", "_seg"]


# --------------------------------------------------------------------------- transport


class ShmTransport(Transport):
    """Same host only: mapped shared-memory pools and cross-memory attach for user memory."""

    name = "shm"
    priority = 100
    same_host_only = True

    @classmethod
    def probe(cls) -> TransportInfo:
        try:
            if not sys.platform.startswith("linux"):
                return TransportInfo(name=cls.name, available=False, reason="shm needs Linux (OFD locks, CMA, pidfd)")
            ok, why = dev_shm_usable()
            cma = probe_cma()
            details = dict(cma, pidfd=hasattr(os, "pidfd_open"), dev_shm=ok, version=VERSION,
                           user_memory="process_vm_readv" if cma["cma"] else "not served (pool memory only)",
                           data_path=data_path())
            if not ok:
                return TransportInfo(name=cls.name, available=False, reason=why, details=details)
            reason = "" if cma["cma"] else f"cross-memory attach unavailable: {cma['cma_reason']}"
            return TransportInfo(name=cls.name, available=True, reason=reason, details=details)
        except Exception as exc:  # noqa: BLE001 - probe never raises
            return TransportInfo(name=cls.name, available=False, reason=f"probe failed: {exc!r}")

    def __init__(self, options: TMapping[str, str]) -> None:
        super().__init__(options)
        self._cfg = {k: type(v)(self.options.get(k, v)) for k, v in DEFAULTS.items()}
        mode = str(self._cfg[OPT_NATIVE]).strip().lower()
        if mode not in ("auto", "on", "off"):
            raise Refused(f"{OPT_NATIVE} must be auto, on or off, got {self._cfg[OPT_NATIVE]!r}")
        if mode == "on" and native is None:
            raise Refused(f"{OPT_NATIVE}=on but the C hot path is unavailable: {NATIVE_REASON}")
        self._cfg[OPT_NATIVE] = mode

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> "ShmEndpoint":
        allow_same_user_tracers()
        return ShmEndpoint(cfg=self._cfg)


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(ShmTransport)
