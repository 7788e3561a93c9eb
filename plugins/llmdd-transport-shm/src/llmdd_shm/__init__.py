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
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
import queue
import select
import sys
import threading
import time
from typing import Any, Callable, Mapping as TMapping, Optional, Union

from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from llmdd.plugin import hookimpl
from llmdd.lowlevel import get_logger
from llmdd.lowlevel import TransportError
from llmdd.status import LLMStatusCode
import msgspec

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor, Transport, TransportInfo
from llmdd.lowlevel import Batch, BatchSet, Cancelled, Corrupt, DoneCompletion, MemRegion, PeerGone, RegionRegistry
from llmdd.lowlevel import RegionTable, RegisteredRegion, Refused, ThreadCompletion, TransportTimeout, as_ops
from llmdd.lowlevel import copy_runs, decode_payload, encode_payload, map_os_error, segment_name

_DONE_OK = DoneCompletion(None)  # immutable: one shared instance for every successful native batch

from . import _quick, _seg
from ._cma import FEW, IOV_MAX, Cma, CmaError, iovecs, probe_cma

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


_native, NATIVE_REASON = _load_native()

# statuses of _shmfast.batch / copy (see _shmfast.c)
_ST_OK, _ST_FALLBACK, _ST_BUSY, _ST_CLOSED, _ST_STALE, _ST_CMA, _ST_NOPROGRESS, _ST_DEAD, _ST_LOCKERR = range(9)


def data_path() -> dict:
    """Which data path this process's shm batches take: ``{"native": bool, "path": str, "reason": str}``."""
    if _native is not None:
        return {"native": True, "path": f"C extension (llmdd_shm._shmfast, ABI {NATIVE_ABI}): small blocks "
                                        f"transfers in one call, other batches in one call per chunk",
                "reason": ""}
    return {"native": False, "path": "pure Python", "reason": NATIVE_REASON}

__all__ = ["ShmTransport", "ShmEndpoint", "ShmChannel", "hookimpl", "llmdd_register_transports",
           "host_identity", "data_path"]


_log = get_logger("llmdd.transport.shm")

VERSION = 1
_MAGIC = 0x314D48534444_4C4C  # "LLDDSHM1"-ish tag in the header's first word
_PROBE_MAGIC = 0x6C6C6D6464534850
MAX_SLOTS = 1 << 14
_HDR_WORDS = 8                      # magic, version, state, pid, id_lo, id_hi, nslots, reserved
_SLOTS_OFF = 4096
_CTL_SIZE = _SLOTS_OFF + MAX_SLOTS * 16
_OPEN, _CLOSED = 1, 2
_FREE, _LIVE, _DYING = 0, 1, 2
KIND_SHM, KIND_CMA = 0, 1

OPT_THREADS = "llmdd.shm.threads"
OPT_SPLIT = "llmdd.shm.split_min_bytes"
OPT_CHUNK = "llmdd.shm.chunk_bytes"
#: "auto" (the C hot path when it is built), "off" (pure Python), "on" (refuse to open without it)
OPT_NATIVE = "llmdd.shm.native"
#: native batches of at most this many bytes keep the GIL for the copy (no thread hand-off after it)
OPT_GIL = "llmdd.shm.native_gil_bytes"
_DEFAULTS: dict[str, Union[int, str]] = {OPT_THREADS: 2, OPT_SPLIT: 8 * 1024 * 1024, OPT_CHUNK: 8 * 1024 * 1024,
                                         OPT_NATIVE: "auto", OPT_GIL: 256 * 1024}
#: batches with more ops than this skip the native single-call path (the numpy plan coalesces them)
_NATIVE_MAX_OPS = 4096


_owned_lock = threading.Lock()
_owned_ctl: set[str] = set()  # control segments of endpoints of this process not closed yet


@atexit.register
def _unlink_owned() -> None:
    """A process that never closed its endpoints leaves no control segment behind (owner only)."""
    with _owned_lock:
        names = list(_owned_ctl)
        _owned_ctl.clear()
    for name in names:
        _seg.unlink(name)


# --------------------------------------------------------------------------- host facts


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_identity() -> dict:
    """What makes two endpoints "the same host": boot id, machine id, pid namespace."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    try:
        ipcns = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        ipcns = 0
    return {"boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "machine_id": _read_text("/etc/machine-id") or _read_text("/var/lib/dbus/machine-id"),
            "pidns": int(pidns), "ipcns": int(ipcns)}


class EndpointFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a shm :class:`~llmdd.abc.EndpointDescriptor` (version :data:`VERSION`)."""

    endpoint_id: bytes
    pid: int
    uid: int
    ctl: str                 # the control segment's name
    probe_addr: int          # an 8-byte word that cross-memory attach reads to check it reached the peer
    user_regions: int = 0    # remote-accessible regions without a backing segment (they need CMA)
    cma: bool = False
    boot_id: str = ""
    machine_id: str = ""
    pidns: int = 0
    ipcns: int = 0


class RegionFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a shm :class:`~llmdd.abc.RegionDescriptor` (version :data:`VERSION`)."""

    endpoint_id: bytes
    region_id: int
    size: int
    remote_accessible: bool
    kind: str = ""           # "shm" (a backing segment), "cma" (the owner's memory) or "" (not accessible)
    slot: int = -1
    gen: int = 0
    shm_name: str = ""
    shm_offset: int = 0
    pid: int = 0
    addr: int = 0


def endpoint_fields(desc: EndpointDescriptor) -> EndpointFields:
    """The fields of a shm endpoint descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="shm", version=VERSION, type=EndpointFields)


def region_fields(desc: RegionDescriptor) -> RegionFields:
    """The fields of a shm region descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="shm", version=VERSION, type=RegionFields)


def _dev_shm_usable() -> tuple[bool, str]:
    name = segment_name("shmprobe")
    try:
        m = _seg.create(name, 4096)
    except OSError as exc:
        return False, f"cannot create a POSIX shared-memory segment: {exc}"
    try:
        ctypes.memset(m.addr, 1, 4096)
        return True, ""
    finally:
        m.close()
        _seg.unlink(name)


class _Liveness:
    """Is the peer process still running? pidfd where the kernel has it, else kill(0) + /proc state."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: Optional[int] = None
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            try:
                self._fd = opener(pid)
            except ProcessLookupError:
                raise PeerGone(f"peer process {pid} does not exist") from None
            except OSError:
                self._fd = None
        if not self.alive():
            raise PeerGone(f"peer process {pid} is not running")

    def alive(self) -> bool:
        fd = self._fd
        if fd is not None:
            try:
                r, _, _ = select.select([fd], [], [], 0)
            except (OSError, ValueError):
                return False
            return not r  # a pidfd turns readable when its process exits
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        stat = _read_text(f"/proc/{self.pid}/stat")
        if stat:
            state = stat.rsplit(")", 1)[-1].split()[:1]
            return state not in (["Z"], ["X"])
        return True

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


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
            ok, why = _dev_shm_usable()
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
        self._cfg = {k: type(v)(self.options.get(k, v)) for k, v in _DEFAULTS.items()}
        mode = str(self._cfg[OPT_NATIVE]).strip().lower()
        if mode not in ("auto", "on", "off"):
            raise Refused(f"{OPT_NATIVE} must be auto, on or off, got {self._cfg[OPT_NATIVE]!r}")
        if mode == "on" and _native is None:
            raise Refused(f"{OPT_NATIVE}=on but the C hot path is unavailable: {NATIVE_REASON}")
        self._cfg[OPT_NATIVE] = mode

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> "ShmEndpoint":
        _allow_same_user_tracers()
        return ShmEndpoint(cfg=self._cfg)


_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = (1 << 64) - 1


def _allow_same_user_tracers() -> None:
    """With Yama ``ptrace_scope=1`` only ancestors may attach to a process, so two engines started
    separately could not use cross-memory attach on each other.  An engine that opens an shm
    endpoint declares, with ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``, that processes of the
    same user may attach: exactly the trust boundary the shm transport already has (docs/transports.md).
    Scope 0 needs nothing; scope >= 2 cannot be relaxed this way (CMA is then reported unavailable)."""
    scope = probe_cma().get("ptrace_scope")
    if scope != 1:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
    except (OSError, AttributeError):
        pass


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(ShmTransport)


# --------------------------------------------------------------------------- control segment


class _Ctl:
    """numpy views of a mapped control segment (owner's or a peer's mapping)."""

    __slots__ = ("mapping", "hdr", "slots")

    def __init__(self, mapping: _seg.Mapping) -> None:
        self.mapping = mapping
        self.hdr = np.ctypeslib.as_array((ctypes.c_uint64 * _HDR_WORDS).from_address(mapping.addr))
        self.slots = np.ctypeslib.as_array(
            (ctypes.c_uint32 * (MAX_SLOTS * 4)).from_address(mapping.addr + _SLOTS_OFF)).reshape(MAX_SLOTS, 4)


def _id_words(endpoint_id: bytes) -> tuple[int, int]:
    return int.from_bytes(endpoint_id[:8], "little"), int.from_bytes(endpoint_id[8:16], "little")


class _LocalReg(RegisteredRegion):
    __slots__ = ("slot", "gen")

    def __init__(self, region: MemRegion, slot: int, gen: int) -> None:
        super().__init__(region)
        self.slot = slot
        self.gen = gen


class _Batch(Batch):
    """One running batch: what it pins (local regions, the peer's mapped segments), its abort flag and
    (split batch) completion; parts check ``aborted`` between chunks."""

    __slots__ = ("maps",)

    def __init__(self) -> None:
        super().__init__()
        self.maps: list = []


class _CopyPool:
    """Persistent copy threads shared by every shm channel of this process.

    A split batch hands its parts after the first to these threads and copies the first part in
    the caller's thread, so a pull on two cores runs two copying threads (the caller and one
    helper) and starts no thread: starting two threads per batch cost 5-25 ms per GiB under load
    (``Thread.start`` waits until the new thread runs).  A thread is added when every existing one
    is busy (concurrent batches), up to ``_POOL_MAX``; beyond that parts queue, bounded by their
    batch's deadline.  Threads are daemons that wait on the queue while idle (no CPU)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: list = []
        self._idle = 0
        self._pid = os.getpid()

    def after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here, and its lock may be held."""
        self._lock = threading.Lock()
        self._reset()

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            if self._pid != os.getpid():  # forked without the at-fork hook (os.fork from C)
                self._reset()
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < _POOL_MAX:
                t = threading.Thread(target=self._loop, name=f"llmdd-shm-copy-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._q.put(work)

    def _loop(self) -> None:
        q = self._q
        while True:
            work = q.get()
            try:
                work()
            except BaseException:  # noqa: BLE001 - a part records its own error; nothing may kill the thread
                pass
            work = None
            with self._lock:
                self._idle += 1

    def threads(self) -> int:
        with self._lock:
            return len(self._threads) if self._pid == os.getpid() else 0


_POOL_MAX = 16
_pool = _CopyPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.after_fork)


class ShmEndpoint(Endpoint):
    """Owns a control segment; registers regions; opens channels to same-host peers."""

    def __init__(self, *, cfg: TMapping[str, Any]) -> None:
        self._cfg = dict(cfg)
        self._id = os.urandom(16)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._nb_epoch = 0                 # bumped by every _rebuild: native batches use one snapshot
        self._regs: RegionRegistry[_LocalReg] = RegionRegistry(self._cond, on_rebuild=self._rebuild)
        self._free_slots = list(range(MAX_SLOTS - 1, -1, -1))
        self._gens = np.zeros(MAX_SLOTS, np.uint32)
        self._user_regions = 0
        self._channels: set[ShmChannel] = set()
        self._closed = False
        self._cma = Cma()
        self._cma_info = probe_cma()
        self._native = None if self._cfg.get(OPT_NATIVE) == "off" else _native
        self._nb_count: dict[int, int] = {}  # epoch -> native batches running on that snapshot
        self._qc = _quick.counters()  # the quick path's table version and counters (llmdd_shm._quick)
        self._rebuild(self._regs)
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"regions": 0, "channels": 0, "batches": 0, "refused": 0, "last_error": None}
        self._ctl_name = segment_name("shmctl", self._id.hex()[:12])
        self._ctl_map = _seg.create(self._ctl_name, _CTL_SIZE)
        with _owned_lock:
            _owned_ctl.add(self._ctl_name)
        self._ctl = _Ctl(self._ctl_map)
        lo, hi = _id_words(self._id)
        self._ctl.hdr[:] = [0, VERSION, _OPEN, os.getpid(), lo, hi, MAX_SLOTS, 0]
        self._ctl.hdr[0] = _MAGIC  # written last: a reader seeing the magic sees the rest
        self._probe = ctypes.c_uint64(_PROBE_MAGIC ^ lo)
        self._log = _log.bind(endpoint=self._id.hex()[:8])

    # ------------------------------------------------------------------ public API

    def describe(self) -> EndpointDescriptor:
        fields = EndpointFields(endpoint_id=self._id, pid=os.getpid(), uid=os.getuid(), ctl=self._ctl_name,
                                probe_addr=ctypes.addressof(self._probe), user_regions=self._user_regions,
                                cma=bool(self._cma_info["cma"]), **host_identity())
        return EndpointDescriptor(transport="shm", version=VERSION, payload=encode_payload(fields))

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.check_new(region.region_id)
            slot, gen = -1, 0
            if region.remote_accessible:
                if not self._free_slots:
                    raise Refused(f"too many remote-accessible regions (at most {MAX_SLOTS})")
                slot = self._free_slots.pop()
                gen = int(self._gens[slot]) + 1
                self._gens[slot] = gen
                s = self._ctl.slots[slot]
                s[1] = gen
                s[2] = region.region_id
                s[0] = _LIVE
            if region.remote_accessible and region.backing is None:
                self._user_regions += 1
            self._regs.add(_LocalReg(region, slot, gen))
            self._stats["regions"] = len(self._regs)
        fields = RegionFields(endpoint_id=self._id, region_id=region.region_id, size=region.size,
                              remote_accessible=region.remote_accessible)
        if region.backing is not None and region.remote_accessible:
            fields = msgspec.structs.replace(fields, slot=slot, gen=gen, kind="shm", shm_name=region.backing.name,
                                             shm_offset=region.backing.offset)
        elif region.remote_accessible:
            fields = msgspec.structs.replace(fields, slot=slot, gen=gen, kind="cma", pid=os.getpid(), addr=region.addr)
        return RegionDescriptor(transport="shm", version=VERSION, payload=encode_payload(fields))

    def deregister(self, region_id: int) -> None:
        epoch = [0]

        def dying(reg: _LocalReg) -> None:   # under the lock, the region already out of the tables
            if reg.slot >= 0:
                self._ctl.slots[reg.slot][0] = _DYING
                if reg.region.backing is None:
                    self._user_regions -= 1
            self._stats["regions"] = len(self._regs)
            epoch[0] = self._nb_epoch

        # cancel the batches touching it, then drain: its pins, and the native batches (short and
        # uninterruptible) that may use it from an older table snapshot
        reg = self._regs.deregister(region_id, locked=dying,
                                    also_wait=lambda: any(e < epoch[0] for e in self._nb_count))
        if reg is None:
            return
        if reg.slot >= 0:
            self._drain_slots(reg.slot, 1)
            with self._lock:
                self._ctl.slots[reg.slot][0] = _FREE
                self._free_slots.append(reg.slot)

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "ShmChannel":
        if self._closed:
            raise Cancelled("endpoint is closed")
        fields = endpoint_fields(peer)
        try:
            ch = ShmChannel(self, fields, time.monotonic() + timeout)
        except (KeyError, TypeError, ValueError) as exc:
            raise Refused(f"bad shm endpoint description: {exc!r}") from None
        with self._lock:
            if self._closed:
                ch.close()
                raise Cancelled("endpoint is closed")
            self._channels.add(ch)
            self._stats["channels"] += 1
        return ch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _quick.bump(self._qc)
            self._ctl.hdr[2] = _CLOSED
            channels = list(self._channels)
        for ch in channels:
            ch.close()
        self._regs.close(also_wait=lambda: bool(self._nb_count))   # cancel, then drain (native batches too)
        self._drain_slots(0, MAX_SLOTS)  # every remote reader has left its batch
        with _owned_lock:
            _owned_ctl.discard(self._ctl_name)
        try:
            _seg.unlink(self._ctl_name)
        except FileNotFoundError:
            pass
        self._ctl_map.close()

    def statistics(self) -> dict:
        with self._lock:
            return _quick.merged(dict(self._stats, closed=self._closed, active_batches=len(self._regs.batches),
                                      cma=self._cma_info["cma"], control_segment=self._ctl_name),
                                 self._qc, channel=False)

    # ------------------------------------------------------------------ internals

    def _rebuild(self, regs: RegionRegistry) -> None:
        items = sorted(regs.entries.items())
        self._addr_of = {k: int(r.region.addr) for k, r in items}
        # the native path's snapshot: rows (id, addr, size) sorted by id, kept alive by the tuple
        tab = np.zeros((len(items), 3), np.uint64)
        for i, (k, r) in enumerate(items):
            tab[i] = (k, r.region.addr, r.region.size)
        self._ntab = (tab, tab.ctypes.data, len(items))
        self._nb_epoch += 1
        _quick.bump(self._qc)

    def _nbegin(self) -> tuple[tuple, int]:
        """A native batch starts: the local snapshot it uses, and its epoch (see :meth:`deregister`)."""
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            e = self._nb_epoch
            c = self._nb_count
            c[e] = c.get(e, 0) + 1
            return self._ntab, e

    def _nend(self, epoch: int, counted: bool) -> None:
        """A native batch ended (``counted``: it was not handed to the Python path, which counts it)."""
        with self._cond:
            if counted:
                self._stats["batches"] += 1
            c = self._nb_count
            left = c[epoch] - 1
            if left:
                c[epoch] = left
            else:
                del c[epoch]
                if self._regs.waiting:
                    self._cond.notify_all()

    def _drain_slots(self, start: int, count: int) -> None:
        """Wait until no reader (any process) holds a shared lock on these slots."""
        try:
            fd = _seg.open_fd(self._ctl_name)
        except FileNotFoundError:
            return  # the segment is already gone (exit handler): no reader can hold a lock on it
        try:
            _seg.lock(fd, _seg.F_WRLCK, start, count, wait=True)
            _seg.lock(fd, _seg.F_UNLCK, start, count)
        finally:
            os.close(fd)

    def _begin(self, ops: np.ndarray, remote: RegionTable) -> tuple[np.ndarray, _Batch, np.ndarray]:
        """Validate ``ops`` (both sides) and pin the local regions; return ops, batch, local addrs
        (a list of ints for at most ``FEW`` ops, else a numpy array)."""
        batch = _Batch()
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            try:
                ops = self._regs.pin(ops, remote, batch)
            except Refused:
                self._stats["refused"] += 1
                raise
            if 0 < len(ops) <= FEW:
                # a few ops (the latency path): Python ints, returned as a list
                addr_of = self._addr_of
                laddr = [addr_of[r] for r in ops["local_region"].tolist()]
            else:
                regs = self._regs
                pos = np.searchsorted(regs.ids, ops["local_region"].astype(np.int64))
                laddr = regs.addrs[pos] if len(ops) else np.empty(0, np.uint64)
            self._stats["batches"] += 1
        return ops, batch, laddr

    def _end(self, batch: _Batch) -> None:
        self._regs.unpin(batch)

    def _forget_channel(self, ch: "ShmChannel") -> None:
        with self._lock:
            self._channels.discard(ch)


# --------------------------------------------------------------------------- channel


class _Remote:
    __slots__ = ("size", "kind", "base", "slot", "gen", "mapping", "accessible")

    def __init__(self, size: int, kind: int, base: int, slot: int, gen: int,
                 mapping: Optional[_seg.Mapping], accessible: bool) -> None:
        self.size = size
        self.kind = kind
        self.base = base
        self.slot = slot
        self.gen = gen
        self.mapping = mapping
        self.accessible = accessible


class ShmChannel(Channel):
    """A same-host peer: its control segment and pool segments mapped, its pid attached."""

    def __init__(self, endpoint: ShmEndpoint, peer: EndpointFields, deadline: float) -> None:
        self._ep = endpoint
        self._cfg = endpoint._cfg
        self._peer_id = peer.endpoint_id
        self._pid = peer.pid
        mine = host_identity()
        for key in ("boot_id", "machine_id", "pidns", "ipcns"):
            if str(getattr(peer, key)) != str(mine[key]):
                raise Refused(f"peer endpoint is not on this host (its {key} {getattr(peer, key)!r} differs from "
                              f"ours {mine[key]!r}); the shm transport is same-host only",
                              status_code=LLMStatusCode.LLM_LINK_FAILED)
        if time.monotonic() > deadline:
            raise TransportTimeout("deadline passed before connecting")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._remote: dict[int, _Remote] = {}
        self._maps: dict[str, _seg.Mapping] = {}
        self._fds: list[int] = []
        self._batches: BatchSet[_Batch] = BatchSet(self._cond)   # py batches tracked, native ones counted
        self._nbusy = 0                      # native batches running (they use table snapshots)
        self._deferred: list = []            # mappings released while a native batch ran
        self._native = endpoint._native
        self._qc = _quick.counters()  # the quick path's table version and counters (llmdd_shm._quick)
        self._qfd = -1                # the quick path's lock fd (used under the GIL only)
        self._nrtab: tuple = (np.zeros((0, 6), np.uint64), 0, 0)
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0,
                                       "batches": 0, "failed": 0, "cma_calls": 0, "segments_mapped": 0,
                                       "last_error": None, "native_batches": 0, "native_fallbacks": 0}
        self._ctl_name = peer.ctl
        try:
            ctl_map = _seg.attach(self._ctl_name)
        except FileNotFoundError:
            raise PeerGone(f"peer endpoint {self._peer_id.hex()[:8]} is closed (no control segment)") from None
        except OSError as exc:
            raise PeerGone(f"cannot map the peer's control segment: {exc}") from None
        self._ctl_map = ctl_map
        try:
            if ctl_map.size < _CTL_SIZE:
                raise Corrupt("peer control segment is too small")
            self._ctl = _Ctl(ctl_map)
            hdr = self._ctl.hdr
            if int(hdr[0]) != _MAGIC or int(hdr[1]) != VERSION:
                raise Corrupt(f"peer does not speak llmdd-shm v{VERSION}")
            if (int(hdr[4]), int(hdr[5])) != _id_words(self._peer_id) or int(hdr[3]) != self._pid:
                raise PeerGone("the control segment belongs to another endpoint incarnation")
            if int(hdr[2]) != _OPEN:
                raise PeerGone("peer endpoint is closed")
            self._live = _Liveness(self._pid)
        except BaseException:
            ctl_map.close()
            raise
        self._pidfd = self._live._fd if self._live._fd is not None else -1
        self._ctl_addr = ctl_map.addr
        # the native single call covers one chunk of an unsplit batch (the Python path does the rest)
        limit = int(self._cfg[OPT_CHUNK])
        if int(self._cfg[OPT_THREADS]) > 1:
            limit = min(limit, int(self._cfg[OPT_SPLIT]) - 1)
        self._nlimit = max(0, limit)
        self._ngil = int(self._cfg[OPT_GIL])
        self._cma = Cma()
        self._iov_max = self._cma.iov_max
        self._cma_ok, self._cma_reason = self._check_cma(peer)
        if not self._cma_ok and peer.user_regions > 0:
            self._teardown()
            raise Refused(f"peer {self._pid} has user-memory regions but cross-memory attach to it does not "
                          f"work: {self._cma_reason}", status_code=LLMStatusCode.LLM_LINK_FAILED)
        self._rebuild()

    def _check_cma(self, peer: EndpointFields) -> tuple[bool, str]:
        if not self._cma.available:
            return False, "process_vm_readv is not available"
        out = np.zeros(1, np.uint64)
        liov = iovecs(np.array([out.ctypes.data], np.uint64), np.array([8], np.uint64))
        riov = iovecs(np.array([peer.probe_addr], np.uint64), np.array([8], np.uint64))
        try:
            self._cma.transfer(self._pid, liov, riov, write=False)
        except CmaError as exc:
            scope = probe_cma()["ptrace_scope"]
            extra = f" (kernel.yama.ptrace_scope={scope})" if scope else ""
            return False, f"{exc.strerror or exc}{extra}"
        if int(out[0]) != _PROBE_MAGIC ^ _id_words(self._peer_id)[0]:
            return False, "cross-memory attach reached a process that is not the peer endpoint"
        return True, "ok"

    # ------------------------------------------------------------------ public API

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = region_fields(desc)
        if fields.endpoint_id != self._peer_id:
            raise Refused(f"descriptor of region {region_id} belongs to another endpoint")
        region_id = int(region_id)
        size = min(int(size), fields.size)
        if not fields.remote_accessible or not fields.kind:
            rem = _Remote(size, KIND_CMA, 0, -1, 0, None, False)
        else:
            rem = self._remote_of(region_id, size, fields)
        with self._lock:
            if rem.mapping is not None:
                rem.mapping.refs += 1
            old = self._remote.pop(region_id, None)
            self._remote[region_id] = rem
            self._rebuild()
        if old is not None and old.mapping is not None:
            self._release_map(old.mapping, ref=True)

    def _remote_of(self, region_id: int, size: int, desc: RegionFields) -> _Remote:
        """A remote-accessible peer region: its segment mapped (kind shm) or its pid checked (kind cma)."""
        slot, gen = desc.slot, desc.gen
        if not 0 <= slot < MAX_SLOTS:
            raise Refused(f"descriptor of region {region_id} names slot {slot}")
        if desc.kind == "shm":
            name, off = desc.shm_name, desc.shm_offset
            with self._lock:
                if self._batches.closed:
                    raise Cancelled("channel closed")
                m = self._maps.get(name)
            if m is None:
                try:
                    m = _seg.attach(name)
                except (OSError, ValueError) as exc:
                    if not self._live.alive():
                        raise PeerGone(f"peer process {self._pid} is gone") from None
                    raise Refused(f"cannot map segment {name} of region {region_id}: {exc}") from None
                with self._lock:
                    other = self._maps.get(name)
                    if other is None:
                        self._maps[name] = m
                        self._stats["segments_mapped"] += 1
                    else:
                        m.close()
                        m = other
            if off < 0 or off + size > m.size:
                self._drop_map_if_unused(m)
                raise Refused(f"region {region_id} ({off}+{size}) exceeds segment {name} ({m.size} bytes)")
            return _Remote(size, KIND_SHM, m.addr + off, slot, gen, m, True)
        if desc.kind == "cma":
            if desc.pid != self._pid:
                raise Refused(f"descriptor of region {region_id} names pid {desc.pid}, peer is {self._pid}")
            if not self._cma_ok:
                raise Refused(f"user-memory region {region_id} needs cross-memory attach to pid {self._pid}, "
                              f"which does not work: {self._cma_reason}")
            return _Remote(size, KIND_CMA, desc.addr, slot, gen, None, True)
        raise Refused(f"descriptor of region {region_id} has unknown kind {desc.kind!r}")

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            old = self._remote.pop(int(region_id), None)
            self._rebuild()
        if old is not None and old.mapping is not None:
            self._release_map(old.mapping, ref=True)

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        try:
            return self._submit(False, ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        try:
            return self._submit(True, ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def close(self) -> None:
        # the quick path's plans of this channel are void from now on (llmdd_shm._quick)
        _quick.bump(self._qc)
        # refuse new batches, fail those in flight, wait until every one (native ones too) left
        if not self._batches.close(Cancelled("channel closed")):
            return
        self._teardown()
        self._ep._forget_channel(self)

    def statistics(self) -> dict:
        with self._lock:
            # cma_calls: every process_vm_* call of this channel (the connect-time probe included)
            return _quick.merged(dict(self._stats, remote_regions=len(self._remote), mapped_segments=len(self._maps),
                                      closed=self._batches.closed, cma=self._cma_ok, cma_reason=self._cma_reason,
                                      peer_pid=self._pid, cma_calls=self._cma.calls), self._qc, channel=True)

    def quick_plan(self, pairs, block_bytes: int, src_units: int, dst_units: int, push: bool):
        """The C path of one small-transfer shape (``llmdd_shm._quick.quick_plan``), or None."""
        return _quick.quick_plan(self, pairs, block_bytes, src_units, dst_units, push)

    # ------------------------------------------------------------------ mappings and tables

    def _teardown(self) -> None:
        with self._lock:
            _quick.bump(self._qc)
            if self._qfd >= 0:
                self._fds.append(self._qfd)   # closed below with the others
                self._qfd = -1
            maps = list(self._maps.values()) + self._deferred
            self._maps.clear()
            self._deferred = []
            self._remote.clear()
            fds, self._fds = self._fds, []
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)
        self._live.close()
        self._ctl_map.close()

    def _drop_map_if_unused(self, m: _seg.Mapping) -> None:
        with self._lock:
            if m.refs or m.pins or self._maps.get(m.name) is not m:
                return
            del self._maps[m.name]
            if self._nbusy:
                self._deferred.append(m)  # a native batch may hold an older table snapshot
                return
        m.close()

    def _release_map(self, m: _seg.Mapping, *, ref: bool = False, pin: bool = False) -> None:
        with self._lock:
            m.refs -= int(ref)
            m.pins -= int(pin)
            if m.refs or m.pins:
                return
            if self._maps.get(m.name) is m:
                del self._maps[m.name]
            if self._nbusy:
                self._deferred.append(m)  # a native batch may hold an older table snapshot
                return
        m.close()

    def _rebuild(self) -> None:
        items = sorted((k, r) for k, r in self._remote.items() if r.accessible)
        self._table = RegionTable({k: r.size for k, r in items},
                                  private=[k for k, r in self._remote.items() if not r.accessible])
        n = len(items)
        self._rids = np.fromiter((k for k, _ in items), np.int64, n)
        self._rbase = np.fromiter((r.base for _, r in items), np.uint64, n)
        self._rkind = np.fromiter((r.kind for _, r in items), np.uint8, n)
        self._rslot = np.fromiter((r.slot for _, r in items), np.int64, n)
        self._rgen = np.fromiter((r.gen for _, r in items), np.uint32, n)
        self._rmaps = [r.mapping for _, r in items]
        self._rinfo = {k: (r.base, r.kind, r.slot, r.gen, r.mapping) for k, r in items}
        # the native path's snapshot: rows (id, base, kind, slot, gen, size) sorted by id
        tab = np.zeros((n, 6), np.uint64)
        for i, (k, r) in enumerate(items):
            tab[i] = (k, r.base, r.kind, r.slot, r.gen, r.size)
        self._nrtab = (tab, tab.ctypes.data, n)
        _quick.bump(self._qc)

    # ------------------------------------------------------------------ batches

    def _submit(self, write: bool, ops: np.ndarray, deadline: float) -> Completion:
        nat = self._native
        if nat is not None:
            ops = as_ops(ops)
            if 0 < len(ops) <= _NATIVE_MAX_OPS:
                done = self._submit_native(nat, write, ops, deadline)
                if done is not None:
                    return done
        return self._submit_py(write, ops, deadline)

    def _submit_native(self, nat: Any, write: bool, ops: np.ndarray, deadline: float) -> Optional[Completion]:
        """One C call: lookup, bounds, pidfd, lock, slot checks, copy, unlock.  ``None`` when the
        batch needs the Python path (nothing was done): more than one chunk, a region or bound the C
        side is not sure of (the Python path produces the refusal), or the owner holding its lock."""
        ep = self._ep
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            rtab = self._nrtab
            fd = self._fds.pop() if self._fds else -1
            self._batches.enter()
            self._nbusy += 1
        epoch = -1
        res: tuple = (-1, 0, 0)  # -1: the C side was not called
        err: Optional[TransportError] = None
        try:
            ltab, epoch = ep._nbegin()  # Cancelled when the endpoint is closed, as the Python path
            if fd < 0:
                try:
                    fd = self._take_fd()
                except TransportError as exc:
                    err = exc
            if err is not None:
                pass
            elif time.monotonic() >= deadline:
                err = TransportTimeout("deadline passed before the batch started")
            elif self._pidfd < 0 and not self._live.alive():
                err = PeerGone(f"peer process {self._pid} is gone")
            else:
                res = nat.batch(write, self._pid, self._pidfd, fd, self._ctl_addr, ops, ltab[1], ltab[2], rtab[1],
                                rtab[2], self._iov_max, self._nlimit, self._ngil)
        finally:
            if epoch >= 0:
                ep._nend(epoch, res[0] != _ST_FALLBACK and res[0] != _ST_BUSY)
            deferred = None
            with self._lock:
                if fd >= 0 and not self._batches.closed and len(self._fds) < 8:
                    self._fds.append(fd)
                    fd = -1
                self._batches.leave()   # wakes a close() draining the channel
                self._nbusy -= 1
                if not self._nbusy and self._deferred:
                    deferred, self._deferred = self._deferred, []
                if res[0] == _ST_FALLBACK or res[0] == _ST_BUSY:
                    self._stats["native_fallbacks"] += 1
                elif res[0] == _ST_OK and err is None:
                    st = self._stats
                    st["batches"] += 1
                    st["native_batches"] += 1
                    if write:
                        st["bytes_written"] += res[1]
                        st["ops_written"] += len(ops)
                    else:
                        st["bytes_read"] += res[1]
                        st["ops_read"] += len(ops)
                    if res[2]:
                        self._cma.calls += res[2]
                        st["cma_calls"] = self._cma.calls
            if fd >= 0:
                os.close(fd)
            for m in deferred or ():
                m.close()
        st = res[0]
        if err is None:
            if st == _ST_OK:
                return _DONE_OK
            if st == _ST_FALLBACK or st == _ST_BUSY:
                return None
            err = self._native_error(write, res)
        with self._lock:
            self._stats["batches"] += 1
            self._stats["native_batches"] += 1
            self._stats["failed"] += 1
            self._stats["last_error"] = str(err)
        return DoneCompletion(err)

    def _native_error(self, write: bool, res: tuple) -> TransportError:
        st, a, b = res
        call = f"process_vm_{'writev' if write else 'readv'}(pid={self._pid})"
        if st == _ST_DEAD:
            return PeerGone(f"peer process {self._pid} is gone")
        if st == _ST_CLOSED:
            return PeerGone("peer endpoint closed")
        if st == _ST_STALE:
            return Refused(f"remote region {a} is not registered by its owner any more")
        if st == _ST_CMA:
            return self._map_exc(CmaError(a, f"{call}: {os.strerror(a)} ({b} bytes moved before)"))
        if st == _ST_NOPROGRESS:
            return self._map_exc(CmaError(errno.EFAULT, f"{call} made no progress ({a} bytes left)"))
        if st == _ST_LOCKERR:
            return self._map_exc(OSError(a, f"locking the peer's slots: {os.strerror(a)}"))
        return Corrupt(f"native shm path returned status {st}")

    def _submit_py(self, write: bool, ops: np.ndarray, deadline: float) -> Completion:
        with self._lock:
            if self._batches.closed:
                raise Cancelled("channel closed")
            table, rids, rbase = self._table, self._rids, self._rbase
            rkind, rslot, rgen, rmaps = self._rkind, self._rslot, self._rgen, self._rmaps
            rinfo = self._rinfo
        ops, batch, laddr = self._ep._begin(ops, table)  # Refused before a byte moves
        small = type(laddr) is list
        try:
            if small:
                rl = ops["remote_region"].tolist()
                used_ids = sorted(set(rl))
                maps = [m for r in used_ids if (m := rinfo[r][4]) is not None]
            else:
                pos = np.searchsorted(rids, ops["remote_region"].astype(np.int64))
                used = np.unique(pos)
                maps = [m for i in used.tolist() if (m := rmaps[i]) is not None]
            with self._lock:
                if self._batches.closed:
                    raise Cancelled("channel closed")
                for m in maps:
                    m.pins += 1
                batch.maps = maps
                self._batches.add(batch)
        except BaseException:
            self._ep._end(batch)
            raise
        plan: Union[_Plan, _FewPlan]
        if small:
            plan = _FewPlan(ops, laddr, rl, rinfo, used_ids)
            if plan.total >= int(self._cfg[OPT_SPLIT]) and int(self._cfg[OPT_THREADS]) > 1:
                plan = plan.full()  # big enough to split across the copy threads
        else:
            plan = _Plan(ops, laddr, rbase[pos], rkind[pos], rslot[used], rgen[used], rids[used])
        total = plan.total
        if time.monotonic() >= deadline:
            return self._done(batch, write, plan, TransportTimeout("deadline passed before the batch started"))
        if total < int(self._cfg[OPT_SPLIT]) or int(self._cfg[OPT_THREADS]) <= 1:
            err = None
            try:
                self._run(batch, write, plan, deadline)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes the batch's error
                err = self._map_exc(exc)
            return self._done(batch, write, plan, err)
        parts = plan.split(int(self._cfg[OPT_THREADS]))
        workers = [(lambda p=p: self._run_mapped(batch, write, p, deadline)) for p in parts]
        # part 0 in this thread, the others on the copy pool (no thread start per batch)
        completion = ThreadCompletion(
            workers, deadline=deadline, abort=lambda: batch.abort(Cancelled("batch aborted")),
            on_done=lambda c: self._done(batch, write, plan,
                                         self._map_exc(c.recorded_error) if c.recorded_error else None),
            pool=_pool.submit, start=False)
        batch.completion = completion  # set before any part runs: close() and deregister() fail it
        return completion.start()

    def _map_exc(self, exc: BaseException) -> TransportError:
        if isinstance(exc, CmaError):
            if exc.errno == errno.ESRCH or not self._live.alive():
                return PeerGone(f"peer process {self._pid} is gone")
            if exc.errno == errno.EPERM:
                return Refused(f"cross-memory attach to pid {self._pid} not permitted: {exc}")
            return Corrupt(f"cross-memory attach failed: {exc}")
        return map_os_error(exc, what="peer endpoint unreachable", peer_alive=self._live.alive)

    def _done(self, batch: _Batch, write: bool, plan: "_AnyPlan", err: Optional[TransportError]) -> Completion:
        self._ep._end(batch)
        for m in batch.maps:
            self._release_map(m, pin=True)
        batch.maps = []
        with self._cond:
            self._batches.discard_locked(batch)
            self._stats["batches"] += 1
            self._stats["cma_calls"] = self._cma.calls
            if err is None:
                key = "written" if write else "read"
                self._stats[f"bytes_{key}"] += plan.total
                self._stats[f"ops_{key}"] += plan.n
            else:
                self._stats["failed"] += 1
                self._stats["last_error"] = str(err)
            self._cond.notify_all()
        return DoneCompletion(err)

    def _take_fd(self) -> int:
        with self._lock:
            if self._fds:
                return self._fds.pop()
        try:
            return _seg.open_fd(self._ctl_name)
        except FileNotFoundError:
            raise PeerGone("peer endpoint closed (control segment removed)") from None

    def _give_fd(self, fd: int) -> None:
        with self._lock:
            if not self._batches.closed and len(self._fds) < 8:
                self._fds.append(fd)
                return
        os.close(fd)

    def _check_peer(self, plan: "_AnyPlan", batch: _Batch, deadline: float, *, first: bool) -> None:
        """Between chunks: abort, deadline, peer endpoint closed, regions deregistered."""
        if batch.aborted:
            raise batch.why or Cancelled("batch aborted")
        if time.monotonic() >= deadline:
            raise TransportTimeout("batch missed its deadline")
        if int(self._ctl.hdr[2]) != _OPEN:
            raise PeerGone("peer endpoint closed")
        if type(plan.slots) is list:  # a _FewPlan: a few slots, Python ints
            slots = self._ctl.slots
            for slot, gen, rid in zip(plan.slots, plan.gens, plan.rids):
                if int(slots[slot, 0]) != _LIVE or int(slots[slot, 1]) != gen:
                    if first:
                        raise Refused(f"remote region {rid} is not registered by its owner any more")
                    raise Cancelled(f"remote region {rid} was deregistered by its owner")
        elif len(plan.slots):
            st = self._ctl.slots[plan.slots]
            ok = (st[:, 0] == _LIVE) & (st[:, 1] == plan.gens)
            if not ok.all():
                rid = int(plan.rids[int(np.argmin(ok))])
                if first:
                    raise Refused(f"remote region {rid} is not registered by its owner any more")
                raise Cancelled(f"remote region {rid} was deregistered by its owner")

    def _run_mapped(self, batch: _Batch, write: bool, plan: "_Plan", deadline: float) -> None:
        try:
            self._run(batch, write, plan, deadline)
        except BaseException as exc:  # noqa: BLE001 - typed errors reach the completion
            raise self._map_exc(exc) from None

    def _run(self, batch: _Batch, write: bool, plan: "_AnyPlan", deadline: float) -> None:
        if not self._live.alive():
            raise PeerGone(f"peer process {self._pid} is gone")
        if int(self._ctl.hdr[2]) != _OPEN:
            raise PeerGone("peer endpoint closed")
        if plan.n == 0:
            return
        lo, hi = plan.slot_range
        fd = self._take_fd()
        locked = False
        try:
            delay = 2e-5
            while not _seg.lock(fd, _seg.F_RDLCK, lo, hi - lo):
                # the owner is deregistering or closing (or stalled holding its lock)
                if batch.aborted:
                    raise batch.why or Cancelled("batch aborted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("batch missed its deadline waiting for the peer's regions")
                self._check_peer(plan, batch, deadline, first=True)
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2e-3)
            locked = True
            self._check_peer(plan, batch, deadline, first=True)
            plan.execute(self, batch, write, deadline)
        finally:
            if locked:
                _seg.lock(fd, _seg.F_UNLCK, lo, hi - lo)
            self._give_fd(fd)


class _Plan:
    """A validated batch as address arrays: mapped-segment runs and CMA iovecs, chunked."""

    __slots__ = ("n", "total", "slots", "gens", "rids", "slot_range", "mlocal", "mremote", "mlen",
                 "clocal", "cremote", "clen")

    def __init__(self, ops: np.ndarray, laddr: np.ndarray, rbase: np.ndarray, rkind: np.ndarray,
                 slots: np.ndarray, gens: np.ndarray, rids: np.ndarray) -> None:
        self.slots = slots
        self.gens = gens
        self.rids = rids
        self.slot_range = (int(slots.min()), int(slots.max()) + 1) if len(slots) else (0, 1)
        la = laddr + ops["local_offset"]
        ra = rbase + ops["remote_offset"]
        ln = ops["length"]
        if len(ops) > 1:
            # coalesce ops that continue each other on both sides, in the order given (the engine's
            # planner emits a table's blocks in order and has merged those runs already): no sort,
            # which cost 8 ms per 16384 ops (a GiB of 64 KiB blocks), more than the iovecs it saved
            cont = (rkind[1:] == rkind[:-1]) & (la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])
            if cont.any():
                starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                la, ra, rkind = la[starts], ra[starts], rkind[starts]
                ln = np.add.reduceat(ln, starts)
        keep = ln > 0
        if not keep.all():
            la, ra, ln, rkind = la[keep], ra[keep], ln[keep], rkind[keep]
        m = rkind == KIND_SHM
        if m.all():
            self._set(la, ra, ln, None, None, None)
        elif not m.any():
            self._set(None, None, None, la, ra, ln)
        else:
            c = ~m
            self._set(la[m], ra[m], ln[m], la[c], ra[c], ln[c])

    def _set(self, ml, mr, mn, cl, cr, cn) -> None:
        e = np.empty(0, np.uint64)
        self.mlocal, self.mremote, self.mlen = (e, e, e) if ml is None else (ml, mr, mn)
        self.clocal, self.cremote, self.clen = (e, e, e) if cl is None else (cl, cr, cn)
        self.n = len(self.mlen) + len(self.clen)
        self.total = int(self.mlen.sum(dtype=np.uint64)) + int(self.clen.sum(dtype=np.uint64))

    def split(self, parts: int) -> list["_Plan"]:
        """At most ``parts`` sub-plans of about equal bytes (each kind split on its own)."""
        out = []
        mp = _split_arrays(self.mlocal, self.mremote, self.mlen, parts)
        cp = _split_arrays(self.clocal, self.cremote, self.clen, parts)
        e = np.empty(0, np.uint64)
        for i in range(max(len(mp), len(cp))):
            p = object.__new__(_Plan)
            p.slots, p.gens, p.rids, p.slot_range = self.slots, self.gens, self.rids, self.slot_range
            ml, mr, mn = mp[i] if i < len(mp) else (e, e, e)
            cl, cr, cn = cp[i] if i < len(cp) else (e, e, e)
            p._set(ml, mr, mn, cl, cr, cn)
            if p.n:
                out.append(p)
        return out or [self]

    def execute(self, ch: ShmChannel, batch: _Batch, write: bool, deadline: float) -> None:
        chunk = int(ch._cfg[OPT_CHUNK])
        if len(self.mlen):
            self._memmove(ch, batch, write, deadline, chunk)
        if len(self.clen):
            self._cma(ch, batch, write, deadline, chunk)

    def _memmove(self, ch: ShmChannel, batch: _Batch, write: bool, deadline: float, chunk: int) -> None:
        la, ra, ln = _cap(self.mlocal, self.mremote, self.mlen, chunk)
        dst, src = (ra, la) if write else (la, ra)
        bounds = _chunks(ln, chunk, IOV_MAX)
        nat = ch._native
        if nat is not None:  # one C call per chunk, no Python object per op
            liov, riov = iovecs(la, ln), iovecs(ra, ln)
            for k, (s, e) in enumerate(bounds):
                if k:
                    ch._check_peer(self, batch, deadline, first=False)
                nat.copy(int(write), 0, KIND_SHM, liov[s:e].ctypes.data, riov[s:e].ctypes.data, e - s)
            return
        for k, (s, e) in enumerate(bounds):   # numpy gathers per chunk (llmdd.lowlevel.copy_runs)
            if k:
                ch._check_peer(self, batch, deadline, first=False)
            copy_runs(dst[s:e], src[s:e], ln[s:e])

    def _cma(self, ch: ShmChannel, batch: _Batch, write: bool, deadline: float, chunk: int) -> None:
        la, ra, ln = _cap(self.clocal, self.cremote, self.clen, chunk)
        liov = iovecs(la, ln)
        riov = iovecs(ra, ln)
        check = lambda: ch._check_peer(self, batch, deadline, first=False)  # noqa: E731
        nat = ch._native
        for k, (s, e) in enumerate(_chunks(ln, chunk, ch._cma.iov_max)):
            if k:
                check()
            if nat is None:
                ch._cma.transfer(ch._pid, liov[s:e], riov[s:e], write=write, between=check)
                continue
            # one C call per chunk (short transfers resumed inside it)
            st, a, b = nat.copy(int(write), ch._pid, KIND_CMA, liov[s:e].ctypes.data, riov[s:e].ctypes.data, e - s)
            call = f"process_vm_{'writev' if write else 'readv'}(pid={ch._pid})"
            if st == _ST_CMA:
                ch._cma.calls += 1
                raise CmaError(a, f"{call}: {os.strerror(a)}")
            if st == _ST_NOPROGRESS:
                ch._cma.calls += 1
                raise CmaError(errno.EFAULT, f"{call} made no progress ({a} bytes left)")
            ch._cma.calls += b


class _FewPlan:
    """A validated batch of at most ``FEW`` ops as Python ints (the latency path).

    Same contract as :class:`_Plan` (``n``, ``total``, ``slots`` / ``gens`` / ``rids`` of the remote
    regions, ``slot_range``, ``execute``), without numpy's fixed per-call costs: mapped-segment ops
    are ``memmove``d, CMA ops go into one ``process_vm_readv`` / ``writev`` with reused ctypes
    iovecs. Ops larger than the chunk size, or a split across threads, go through :meth:`full`.
    """

    __slots__ = ("n", "total", "slots", "gens", "rids", "slot_range", "mm", "cm", "_args")

    def __init__(self, ops: np.ndarray, laddr: list, rl: list, rinfo: dict, used_ids: list) -> None:
        lo, ro, ln = ops["local_offset"].tolist(), ops["remote_offset"].tolist(), ops["length"].tolist()
        mm: list = []
        cm: list = []
        total = 0
        for la, off, rid, roff, n in zip(laddr, lo, rl, ro, ln):
            if n <= 0:
                continue
            base, kind = rinfo[rid][0], rinfo[rid][1]
            (mm if kind == KIND_SHM else cm).append((la + off, base + roff, n))
            total += n
        self.mm, self.cm = mm, cm
        self.n = len(mm) + len(cm)
        self.total = total
        self.rids = used_ids
        self.slots = [rinfo[r][2] for r in used_ids]
        self.gens = [rinfo[r][3] for r in used_ids]
        self.slot_range = (min(self.slots), max(self.slots) + 1) if self.slots else (0, 1)
        self._args = (ops, laddr, rl, rinfo)

    def full(self) -> "_Plan":
        """The same batch as a numpy :class:`_Plan` (chunking, splitting)."""
        ops, laddr, rl, rinfo = self._args
        info = [rinfo[r] for r in rl]
        ids = self.rids
        return _Plan(ops, np.asarray(laddr, np.uint64), np.asarray([i[0] for i in info], np.uint64),
                     np.asarray([i[1] for i in info], np.uint8),
                     np.asarray([rinfo[r][2] for r in ids], np.int64),
                     np.asarray([rinfo[r][3] for r in ids], np.uint32), np.asarray(ids, np.int64))

    def split(self, parts: int) -> list:
        return self.full().split(parts)

    def execute(self, ch: "ShmChannel", batch: _Batch, write: bool, deadline: float) -> None:
        chunk = int(ch._cfg[OPT_CHUNK])
        if any(n > chunk for _, _, n in self.mm) or any(n > chunk for _, _, n in self.cm) \
                or sum(n for _, _, n in self.mm) > chunk or sum(n for _, _, n in self.cm) > chunk:
            self.full().execute(ch, batch, write, deadline)  # checks between chunks
            return
        if self.mm:
            mm = ctypes.memmove
            for la, ra, n in self.mm:
                if write:
                    mm(ra, la, n)
                else:
                    mm(la, ra, n)
        if self.cm:
            if self.mm:
                ch._check_peer(self, batch, deadline, first=False)
            cm = self.cm
            ch._cma.transfer_few(ch._pid, [c[0] for c in cm], [c[1] for c in cm], [c[2] for c in cm], write=write,
                                 between=lambda: ch._check_peer(self, batch, deadline, first=False))


#: either plan of a batch (same contract: n, total, slots / gens / rids, execute)
_AnyPlan = Union[_Plan, _FewPlan]


def _cap(la: np.ndarray, ra: np.ndarray, ln: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split ops longer than ``cap`` bytes into pieces of at most ``cap`` (vectorised)."""
    if not len(ln) or int(ln.max()) <= cap:
        return la, ra, ln
    cap_u = np.uint64(cap)
    pieces = ((ln + cap_u - np.uint64(1)) // cap_u).astype(np.int64)
    idx = np.repeat(np.arange(len(ln)), pieces)
    first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    k = (np.arange(len(idx)) - np.repeat(first, pieces)).astype(np.uint64)
    off = k * cap_u
    return la[idx] + off, ra[idx] + off, np.minimum(ln[idx] - off, cap_u)


def _chunks(ln: np.ndarray, chunk_bytes: int, max_ops: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` index ranges of at most ``max_ops`` ops and about ``chunk_bytes``."""
    n = len(ln)
    if n <= max_ops and int(ln.sum(dtype=np.uint64)) <= chunk_bytes:
        return [(0, n)]
    ends = np.cumsum(ln, dtype=np.uint64)
    out = []
    s = 0
    while s < n:
        base = int(ends[s - 1]) if s else 0
        e = int(np.searchsorted(ends, np.uint64(base + chunk_bytes), side="right"))
        e = min(max(e, s + 1), s + max_ops, n)
        out.append((s, e))
        s = e
    return out


def _split_arrays(la: np.ndarray, ra: np.ndarray, ln: np.ndarray, parts: int) -> list:
    if not len(ln):
        return []
    if parts <= 1 or len(ln) < 2:
        return [(la, ra, ln)]
    ends = np.cumsum(ln, dtype=np.uint64)
    total = int(ends[-1])
    cuts = np.searchsorted(ends, [total * k // parts for k in range(1, parts)], side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(ln) - 1)).tolist()
    bounds = [0] + cuts + [len(ln)]
    return [(la[a:b], ra[a:b], ln[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
