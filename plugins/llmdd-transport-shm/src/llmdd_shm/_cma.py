"""Cross-memory attach (``process_vm_readv`` / ``process_vm_writev``) through ctypes.

Iovec arrays are numpy ``(n, 2)`` ``uint64`` arrays (``struct iovec`` is two 64-bit words on
the 64-bit Linux ABIs this targets), built for a whole batch with vectorised numpy. Element
``i`` of the local and of the remote array always have the same length (one op each), which
is what makes resuming after a short transfer exact: :meth:`Cma.transfer` finds the element
the kernel stopped in and continues from that byte.

The syscall is injectable (``Cma(readv=..., writev=...)``) so the resume logic is unit-tested
with simulated short returns. ctypes releases the GIL for the duration of each call.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from typing import Callable, Optional

from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

__all__ = ["IOV_MAX", "Cma", "CmaError", "iovecs", "probe_cma", "libc_syscalls"]


def _iov_max() -> int:
    try:
        n = int(os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError, AttributeError):
        n = -1
    return n if n > 0 else 1024


#: most iovec elements per call (``UIO_MAXIOV``; 1024 on Linux)
IOV_MAX = _iov_max()

#: ``fn(pid, local_iov_ptr, local_count, remote_iov_ptr, remote_count, flags) -> bytes or -1``
Syscall = Callable[[int, int, int, int, int, int], int]


class CmaError(OSError):
    """A failed cross-memory-attach call (``errno`` set); the transport maps it to a typed error."""


def libc_syscalls() -> tuple[Optional[Syscall], Optional[Syscall]]:
    """``(process_vm_readv, process_vm_writev)`` from libc, or ``(None, None)`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = []
        for name in ("process_vm_readv", "process_vm_writev"):
            fn = getattr(libc, name)
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
            fns.append(fn)
        return fns[0], fns[1]
    except (OSError, AttributeError):
        return None, None


def iovecs(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A C-contiguous ``(n, 2)`` ``uint64`` iovec array of ``(base, len)``."""
    out = np.empty((len(addrs), 2), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lengths
    return out


class Cma:
    """Moves the bytes of paired iovec arrays between this process and ``pid``."""

    def __init__(self, readv: Optional[Syscall] = None, writev: Optional[Syscall] = None,
                 iov_max: int = IOV_MAX) -> None:
        if readv is None or writev is None:
            r, w = libc_syscalls()
            readv = readv or r
            writev = writev or w
        self._readv = readv
        self._writev = writev
        self.iov_max = max(1, int(iov_max))
        self.calls = 0
        self.short_returns = 0
        self._tls = threading.local()  # per-thread ctypes iovec buffers of transfer_few

    @property
    def available(self) -> bool:
        return self._readv is not None and self._writev is not None

    def transfer(self, pid: int, liov: np.ndarray, riov: np.ndarray, *, write: bool,
                 between: Optional[Callable[[], None]] = None) -> int:
        """Move every byte described by ``liov`` / ``riov`` (read: remote -> local); return the count.

        At most ``iov_max`` elements go into one call; ``between()`` runs before every call
        after the first (abort and deadline checks: it raises to stop). Raises
        :class:`CmaError` when the kernel refuses or makes no progress.
        """
        fn = self._writev if write else self._readv
        if fn is None:
            raise CmaError(errno.ENOSYS, "process_vm_readv/writev are not available")
        n = len(liov)
        total = 0
        first = True
        for s in range(0, n, self.iov_max):
            l = liov[s:s + self.iov_max]
            r = riov[s:s + self.iov_max]
            while len(l):
                if not first and between is not None:
                    between()
                first = False
                want = int(l[:, 1].sum(dtype=np.uint64))
                if want == 0:
                    break
                got = fn(pid, l.ctypes.data, len(l), r.ctypes.data, len(r), 0)
                self.calls += 1
                if got < 0:
                    err = ctypes.get_errno()
                    raise CmaError(err, f"process_vm_{'writev' if write else 'readv'}(pid={pid}): "
                                        f"{os.strerror(err)}")
                if got == 0:
                    raise CmaError(errno.EFAULT, f"process_vm_{'writev' if write else 'readv'}(pid={pid}) "
                                                 f"made no progress ({want} bytes left)")
                total += got
                if got >= want:
                    break
                # short transfer: resume from the exact byte, inside the element it stopped in
                self.short_returns += 1
                ends = np.cumsum(l[:, 1], dtype=np.uint64)
                k = int(np.searchsorted(ends, np.uint64(got), side="right"))
                skip = got - (int(ends[k - 1]) if k else 0)
                l = l[k:].copy()
                r = r[k:].copy()
                if skip:
                    l[0, 0] += np.uint64(skip)
                    l[0, 1] -= np.uint64(skip)
                    r[0, 0] += np.uint64(skip)
                    r[0, 1] -= np.uint64(skip)
        return total


    def transfer_few(self, pid: int, laddrs: list, raddrs: list, lengths: list, *, write: bool,
                     between: Optional[Callable[[], None]] = None) -> int:
        """:meth:`transfer` for at most :data:`FEW` elements given as Python int lists.

        The iovecs go into per-thread ctypes buffers that are reused from call to call (no numpy
        array per call); a short transfer resumes through :meth:`transfer` from the exact byte.
        """
        n = len(lengths)
        if n > FEW or n > self.iov_max:
            return self.transfer(pid, iovecs(np.asarray(laddrs, np.uint64), np.asarray(lengths, np.uint64)),
                                 iovecs(np.asarray(raddrs, np.uint64), np.asarray(lengths, np.uint64)),
                                 write=write, between=between)
        fn = self._writev if write else self._readv
        if fn is None:
            raise CmaError(errno.ENOSYS, "process_vm_readv/writev are not available")
        want = sum(lengths)
        if n == 0 or want == 0:
            return 0
        bufs = getattr(self._tls, "bufs", None)
        if bufs is None:
            bufs = self._tls.bufs = ((ctypes.c_uint64 * (2 * FEW))(), (ctypes.c_uint64 * (2 * FEW))())
        li, ri = bufs
        for i in range(n):
            ln = lengths[i]
            li[2 * i] = laddrs[i]
            li[2 * i + 1] = ln
            ri[2 * i] = raddrs[i]
            ri[2 * i + 1] = ln
        got = fn(pid, ctypes.addressof(li), n, ctypes.addressof(ri), n, 0)
        self.calls += 1
        if got < 0:
            err = ctypes.get_errno()
            raise CmaError(err, f"process_vm_{'writev' if write else 'readv'}(pid={pid}): {os.strerror(err)}")
        if got == 0:
            raise CmaError(errno.EFAULT, f"process_vm_{'writev' if write else 'readv'}(pid={pid}) "
                                         f"made no progress ({want} bytes left)")
        if got >= want:
            return got
        # short transfer: the rest, from the exact byte, through the general path
        self.short_returns += 1
        la, ra, ln, skip = [], [], [], got
        for a, b, c in zip(laddrs, raddrs, lengths):
            if skip >= c:
                skip -= c
                continue
            la.append(a + skip)
            ra.append(b + skip)
            ln.append(c - skip)
            skip = 0
        if between is not None:
            between()
        lens = np.asarray(ln, np.uint64)
        return got + self.transfer(pid, iovecs(np.asarray(la, np.uint64), lens),
                                   iovecs(np.asarray(ra, np.uint64), lens), write=write, between=between)


#: most elements :meth:`Cma.transfer_few` puts into its reusable ctypes buffers
FEW = 8


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _seccomp_mode() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Seccomp:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def probe_cma() -> dict:
    """Whether cross-memory attach works here: a read of this process's own memory, plus facts.

    Returns ``{"cma": bool, "cma_reason": str, "ptrace_scope": int|None, "seccomp": int|None,
    "iov_max": int}``. A self-read succeeding does not prove access to *another* process
    (``ptrace_scope`` >= 1 restricts that); ``connect`` checks each peer.
    """
    scope = _read_int("/proc/sys/kernel/yama/ptrace_scope")
    out = {"cma": False, "cma_reason": "", "ptrace_scope": scope, "seccomp": _seccomp_mode(), "iov_max": IOV_MAX}
    readv, _ = libc_syscalls()
    if readv is None:
        out["cma_reason"] = "process_vm_readv is not available (not Linux or no libc symbol)"
        return out
    src = ctypes.c_uint64(0x6C6C6D6464534D31)
    dst = ctypes.c_uint64(0)
    liov = iovecs(np.array([ctypes.addressof(dst)], np.uint64), np.array([8], np.uint64))
    riov = iovecs(np.array([ctypes.addressof(src)], np.uint64), np.array([8], np.uint64))
    got = readv(os.getpid(), liov.ctypes.data, 1, riov.ctypes.data, 1, 0)
    if got != 8 or dst.value != src.value:
        err = ctypes.get_errno()
        why = os.strerror(err) if err else f"returned {got}"
        hint = " (seccomp filter?)" if err in (errno.EPERM, errno.ENOSYS) else ""
        out["cma_reason"] = f"process_vm_readv on the own pid failed: {why}{hint}"
        return out
    if scope is not None and scope >= 2:
        out["cma_reason"] = (f"kernel.yama.ptrace_scope={scope}: cross-memory attach to other processes is "
                             "restricted to CAP_SYS_PTRACE (user memory is not served; pool memory in shared "
                             "segments still is)")
        return out
    out["cma"] = True
    out["cma_reason"] = ("ok" if not scope else
                         f"kernel.yama.ptrace_scope={scope}: only descendants are readable unless the peer "
                         "allows it; each connect checks its peer")
    return out
