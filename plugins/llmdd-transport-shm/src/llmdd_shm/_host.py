"""Facts about this host and its processes: what makes two endpoints "the same host", whether POSIX
shared memory works, whether a peer process still runs (:class:`Liveness`), and the ptrace permission
that cross-memory attach needs (:func:`allow_same_user_tracers`)."""

from __future__ import annotations

import ctypes
import os
import select
from typing import Optional

from llmdd.lowlevel import PeerGone, segment_name

from . import _seg
from ._cma import probe_cma


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


def dev_shm_usable() -> tuple[bool, str]:
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


class Liveness:
    """Is the peer process still running? pidfd where the kernel has it, else kill(0) + /proc state."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: Optional[int] = None
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            try:
                self.fd = opener(pid)
            except ProcessLookupError:
                raise PeerGone(f"peer process {pid} does not exist") from None
            except OSError:
                self.fd = None
        if not self.alive():
            raise PeerGone(f"peer process {pid} is not running")

    def alive(self) -> bool:
        fd = self.fd
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
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = (1 << 64) - 1


def allow_same_user_tracers() -> None:
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
