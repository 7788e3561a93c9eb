"""Memory backends: where the bytes of a pool live.

A backend hands out *segments*: one contiguous, mapped range with an integer
address.  Both built-in backends put their segments in POSIX shared memory so a
same-host peer can map them (``attach_segment``):

* :class:`HostBackend` (``Placement.HOST``) is host DRAM;
* :class:`EmulatedDeviceBackend` (``Placement.DEVICE``) is host memory playing
  the device's part on a machine without an accelerator, so every D2D/D2H/H2D
  rule of the contract is exercised (``describe()`` says so).  A CUDA or NPU
  backend implements the same :class:`MemoryBackend` protocol.

Shared-memory hygiene:

* the *owner* creates a segment with ``track=False`` (Python >= 3.13) or
  unregisters it from the resource tracker right after creation (older
  Pythons), and unlinks it explicitly in :meth:`release` / at engine finalize;
  a process-exit handler unlinks whatever an owner forgot, so no ``/dev/shm``
  entry outlives its owner's orderly exit (names carry the owner's pid:
  :func:`sweep_orphan_segments` removes those of dead owners after a crash);
* a *peer* attaches with :func:`attach_segment`, which never registers the
  segment with a resource tracker and never unlinks it (on Python < 3.13
  ``SharedMemory`` registers even attached segments, and the tracker unlinks
  them when the attaching process exits).

Segments are reserved at creation (``posix_fallocate`` where available): a
``/dev/shm`` too small for a pool is ``LLM_OUT_OF_MEMORY`` at creation, never a
``SIGBUS`` at first touch.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import secrets
import sys
import threading
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from multiprocessing import shared_memory

from llmdd._base.lazy import np
from llmdd._base.enums import Placement
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._memory import segments as _segments

__all__ = [
    "Segment",
    "MemoryBackend",
    "HostBackend",
    "EmulatedDeviceBackend",
    "attach_segment",
    "backend_for",
    "owned_segment_names",
    "sweep_orphan_segments",
    "SEGMENT_PREFIX",
]

_log = get_logger("llmdd.memory")

#: every segment llmdd creates is named by :func:`llmdd._memory.segments.segment_name`
#: (``llmdd_<pid>_<pidns>_<kind>_<unique>``)
SEGMENT_PREFIX = _segments.SEGMENT_PREFIX

_TRACK_PARAM = sys.version_info >= (3, 13)

_counter = itertools.count(1)
_owned_lock = threading.Lock()
_owned: dict[str, "Segment"] = {}  # segments this process created and has not unlinked yet


class Segment:
    """One mapped shared-memory segment: ``name``, ``size``, integer ``addr``.

    ``owner`` is True in the process that created it (only the owner unlinks).
    :meth:`array` is a ``uint8`` numpy view of the whole segment.
    """

    __slots__ = ("name", "size", "placement", "owner", "_shm", "_mmap", "_array", "addr", "_closed")

    def __init__(self, name: str, size: int, placement: Placement, owner: bool,
                 shm: Optional[shared_memory.SharedMemory] = None, mm: Optional[mmap.mmap] = None) -> None:
        self.name = name
        self.size = size
        self.placement = placement
        self.owner = owner
        self._shm = shm
        self._mmap = mm
        if shm is not None:
            buf = shm.buf
        elif mm is not None:
            buf = memoryview(mm)
        else:
            raise TypeError("a segment is backed by a SharedMemory or an mmap, got neither")
        self._array: Optional[np.ndarray] = np.frombuffer(buf, dtype=np.uint8, count=size)
        self.addr: int = int(self._array.ctypes.data)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def array(self) -> np.ndarray:
        """A ``uint8`` view of the segment (invalid once the segment is closed)."""
        if self._array is None:
            raise LLMException(f"segment {self.name} is closed", status_code=LLMStatusCode.LLM_FAILED)
        return self._array

    def close(self) -> None:
        """Unmap (best effort: a mapping still exported to numpy views stays until they go)."""
        if self._closed:
            return
        self._closed = True
        self._array = None
        try:
            if self._shm is not None:
                self._shm.close()
            elif self._mmap is not None:
                self._mmap.close()
        except BufferError:
            # someone still holds a view of the buffer: the mapping is freed with the last view
            _log.debug("llmdd.memory.segment_still_exported", name=self.name)
            shm = self._shm
            if shm is not None:  # stop SharedMemory.__del__ from trying (and failing) again
                try:
                    shm._buf = None  # type: ignore[attr-defined]  # private: not in typeshed
                    shm._mmap = None  # type: ignore[attr-defined]  # private: not in typeshed
                    if getattr(shm, "_fd", -1) >= 0:
                        os.close(shm._fd)  # type: ignore[attr-defined]  # private: not in typeshed
                        shm._fd = -1  # type: ignore[attr-defined]  # private: not in typeshed
                except Exception:  # noqa: BLE001
                    pass

    def unlink(self) -> None:
        """Remove the ``/dev/shm`` name (owner only); the mapping itself stays valid until closed."""
        if not self.owner:
            raise LLMException(f"segment {self.name} is attached, only its owner unlinks it",
                               status_code=LLMStatusCode.LLM_FAILED)
        with _owned_lock:
            present = _owned.pop(self.name, None) is not None
        if present:
            _shm_unlink(self.name)

    def __repr__(self) -> str:
        return (f"Segment(name={self.name!r}, size={self.size}, placement={self.placement}, "
                f"owner={self.owner}, addr={self.addr:#x})")


def _SharedMemory(*args, **kwargs) -> "shared_memory.SharedMemory":
    """``multiprocessing.shared_memory.SharedMemory``, imported when a segment is first made or attached:
    multiprocessing brings pickle, subprocess and more (about 3 MiB an idle engine does not need)."""
    from multiprocessing import shared_memory

    return shared_memory.SharedMemory(*args, **kwargs)


def _shm_unlink(name: str) -> None:
    try:
        import _posixshmem

        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    except ImportError:  # pragma: no cover - non-POSIX
        shm = _SharedMemory(name=name)
        shm.close()
        shm.unlink()


def _create_shm(size: int) -> shared_memory.SharedMemory:
    name = _segments.segment_name("pool", f"{next(_counter)}_{secrets.token_hex(4)}")
    if _TRACK_PARAM:
        shm = _SharedMemory(name=name, create=True, size=size, track=False)
    else:
        shm = _SharedMemory(name=name, create=True, size=size)
        try:
            from multiprocessing import resource_tracker

            # ignore: SharedMemory._name is private (not in typeshed)
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover - tracker unavailable
            pass
    # exactly owner read/write whatever the umask: 0600 is the creation mode, but a umask such as
    # 277 would leave 0400 and lock this user's own peers (the shm transport) out of the pool
    os.fchmod(shm._fd, 0o600)  # type: ignore[attr-defined]  # private: not in typeshed
    return shm


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Back the whole segment now (tmpfs pages), so a full /dev/shm fails here, not by SIGBUS."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or sys.platform != "linux":
        return
    fd = os.open(f"/dev/shm/{shm.name}", os.O_RDWR)
    try:
        fallocate(fd, 0, size)
    finally:
        os.close(fd)


@runtime_checkable
class MemoryBackend(Protocol):
    """The seam for memory kinds: host DRAM, emulated device, CUDA, NPU..."""

    placement: Placement

    def allocate_segment(self, size: int) -> Segment:
        """A new mapped segment of ``size`` bytes; ``LLMException(LLM_OUT_OF_MEMORY)`` if impossible."""

    def release(self, segment: Segment) -> None:
        """Unmap and (owner) unlink ``segment``; idempotent."""

    def describe(self) -> dict:
        """What this backend is, for logs, statistics and the link handshake."""


class _ShmBackend:
    placement: Placement = Placement.HOST
    kind = "host"

    def allocate_segment(self, size: int) -> Segment:
        if not isinstance(size, int) or size <= 0:
            raise LLMException(f"segment size must be a positive int, got {size!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        try:
            shm = _create_shm(size)
        except OSError as exc:
            raise LLMException(f"cannot create a shared-memory segment of {size} bytes: {exc}",
                               status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
        try:
            _reserve(shm, size)
            seg = Segment(shm.name, size, self.placement, True, shm=shm)
        except BaseException as exc:
            shm.close()
            _shm_unlink(shm.name)
            if isinstance(exc, OSError):
                raise LLMException(f"cannot reserve {size} bytes of shared memory: {exc}",
                                   status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
            raise
        with _owned_lock:
            _owned[seg.name] = seg
        return seg

    def release(self, segment: Segment) -> None:
        segment.close()
        if segment.owner:
            segment.unlink()

    def describe(self) -> dict:
        return {"kind": self.kind, "placement": self.placement.name, "shared_memory": True,
                "emulated": False}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HostBackend(_ShmBackend):
    """Host DRAM in POSIX shared memory."""

    placement = Placement.HOST
    kind = "host"


class EmulatedDeviceBackend(_ShmBackend):
    """Host memory playing the device's part (no accelerator here)."""

    placement = Placement.DEVICE
    kind = "emulated-device"

    def describe(self) -> dict:
        return {"kind": self.kind, "placement": self.placement.name, "shared_memory": True,
                "emulated": True,
                "note": "device memory emulated with host shared memory; no accelerator backend is in use"}


def backend_for(placement: Placement) -> MemoryBackend:
    """The default backend of a placement."""
    return EmulatedDeviceBackend() if placement == Placement.DEVICE else HostBackend()


def attach_segment(name: str, size: int, placement: Placement = Placement.HOST) -> Segment:
    """Map a peer's segment. Never registers it with a resource tracker, never unlinks it.

    ``LLMException(LLM_PARAM_INVALID)`` when no such segment exists or it is smaller than ``size``.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise LLMException(f"invalid segment name {name!r}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    if not isinstance(size, int) or size <= 0:
        raise LLMException(f"invalid segment size {size!r}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    try:
        if _TRACK_PARAM:
            shm = _SharedMemory(name=name, track=False)
            if shm.size < size:
                shm.close()
                raise LLMException(f"segment {name} has {shm.size} bytes, {size} expected",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
            return Segment(name, size, placement, False, shm=shm)
        import _posixshmem

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise LLMException(f"segment {name} has {actual} bytes, {size} expected",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return Segment(name, size, placement, False, mm=mm)
    except FileNotFoundError as exc:
        raise LLMException(f"segment {name} does not exist", status_code=LLMStatusCode.LLM_PARAM_INVALID) from exc


def owned_segment_names() -> set[str]:
    """Names of the segments this process created and has not unlinked yet."""
    with _owned_lock:
        return set(_owned)


def sweep_orphan_segments(directory: str = "/dev/shm") -> list[str]:
    """Unlink llmdd segments whose creating process is gone (after a crash); returns their names.

    The rules (same user, same pid namespace, creator dead, llmdd's name form only) are those of
    :func:`llmdd._memory.segments.find_leftovers`; an engine runs this at ``init``.
    """
    return [left.name for left in _segments.reclaim_leftovers(directory)]


def _forget_owned_in_child() -> None:
    # a forked child does not own its parent's segments: it must never unlink them
    global _owned_lock
    _owned_lock = threading.Lock()
    _owned.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_owned_in_child)


@atexit.register
def _unlink_owned_at_exit() -> None:
    me = os.getpid()
    with _owned_lock:
        names = [n for n in _owned if (_segments.parse_segment_name(n) or (0, -1, ""))[1] == me]
        _owned.clear()
    for name in names:
        _shm_unlink(name)
