"""POSIX shared-memory segments mapped with ``mmap(2)`` through ctypes, and OFD byte-range locks.

A peer maps an owner's segment with ``shm_open`` + ``mmap`` directly: nothing is ever
registered with ``multiprocessing``'s resource tracker (which on Python < 3.13 unlinks even
*attached* segments when the attaching process exits), and a peer never unlinks. Only
:func:`create` (owner) pairs with :func:`unlink`.

Mappings are plain integer addresses (``munmap`` is explicit), so no exported Python buffer can
keep a mapping alive or block its release; callers pin mappings while batches use them.

Locks are open-file-description locks (``F_OFD_SETLK``): owned by one open file, so two fds in
the same process conflict like two processes do, and they vanish when their process dies.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import sys

__all__ = ["Mapping", "create", "attach", "open_fd", "unlink", "lock", "F_RDLCK", "F_WRLCK", "F_UNLCK"]

_PROT_READ, _PROT_WRITE, _MAP_SHARED = 0x1, 0x2, 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
F_RDLCK, F_WRLCK, F_UNLCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (x86_64 / aarch64 Linux): type, whence, start, len, pid

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None


def _path(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\0" in name:
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    return "/" + name


#: the mode of every segment this plugin creates: its owner's user only (the trust boundary of a
#: same-user transport), set with fchmod after creation so that no umask changes it either way
MODE = 0o600


def open_fd(name: str, *, create: bool = False) -> int:
    """``shm_open`` the segment read-write (``O_CREAT|O_EXCL`` with ``create``, then mode exactly
    :data:`MODE`); FileNotFoundError if absent."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    if _posixshmem is not None:
        fd = _posixshmem.shm_open(_path(name), flags, mode=MODE)
    else:  # pragma: no cover
        fd = os.open("/dev/shm" + _path(name), flags | getattr(os, "O_CLOEXEC", 0), MODE)
    if create:
        try:
            os.fchmod(fd, MODE)   # the umask may have taken bits away (0400 would lock the peers out)
        except BaseException:
            os.close(fd)
            unlink(name)
            raise
    return fd


def unlink(name: str) -> None:
    """Remove the name (owner only); FileNotFoundError is ignored."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink(_path(name))
        else:  # pragma: no cover
            os.unlink("/dev/shm" + _path(name))
    except FileNotFoundError:
        pass


class Mapping:
    """One mapping of a whole segment: ``addr``, ``size``; :meth:`close` unmaps (idempotent)."""

    __slots__ = ("name", "addr", "size", "refs", "pins", "__weakref__")

    def __init__(self, name: str, addr: int, size: int) -> None:
        self.name = name
        self.addr = addr
        self.size = size
        self.refs = 0   # remote regions (or owners) referring to it
        self.pins = 0   # batches using it right now

    def close(self) -> None:
        if self.addr:
            _munmap(self.addr, self.size)
            self.addr = 0

    def __repr__(self) -> str:
        return f"Mapping({self.name!r}, addr={self.addr:#x}, size={self.size})"


def _map_fd(fd: int, size: int) -> int:
    addr = _mmap(None, size, _PROT_READ | _PROT_WRITE, _MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return int(addr)


def attach(name: str) -> Mapping:
    """Map a peer's whole segment. Never tracked, never unlinked. FileNotFoundError if absent."""
    fd = open_fd(name)
    try:
        size = os.fstat(fd).st_size
        if size <= 0:
            raise OSError(errno.EINVAL, f"segment {name} is empty")
        return Mapping(name, _map_fd(fd, size), size)
    finally:
        os.close(fd)


def create(name: str, size: int) -> Mapping:
    """Create (exclusively), size and map a new segment owned by this process."""
    fd = open_fd(name, create=True)
    try:
        os.ftruncate(fd, size)
        return Mapping(name, _map_fd(fd, size), size)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)


def lock(fd: int, kind: int, start: int, length: int, *, wait: bool = False) -> bool:
    """Set an OFD lock on ``[start, start+length)``; False when ``wait`` is off and it conflicts."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def ofd_locks_available() -> bool:
    return sys.platform.startswith("linux")
