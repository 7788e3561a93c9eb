"""Names of llmdd's POSIX shared-memory segments, and reclaiming the ones a crashed process left.

Every segment llmdd or one of its transports creates in ``/dev/shm`` is named

    ``llmdd_<pid>_<pidns>_<kind>_<unique>``

(``llmdd<scope>_...`` where the environment variable ``LLMDD_SHM_SCOPE`` names a scope: 1-16
lowercase letters or digits).  ``pid`` is the creator's pid in its namespace, ``pidns`` the inode
of that pid namespace (``/proc/self/ns/pid``, 0 where unknown), ``kind`` says what it is
(``pool``, ``shmctl``...).  A process killed with SIGKILL never runs its exit handlers, so its segments stay; with the name
alone (plus the file's owner) another process decides, without asking anyone, that a segment is a
*leftover*:

* the name has llmdd's prefix of this process's scope and this exact form (anything else, another
  scope's segments included, is never touched);
* the creator's pid namespace is ours (a pid means nothing across namespaces);
* the file belongs to our effective user (never another user's memory);
* the creator pid is not ours and no process with that pid exists (``kill(pid, 0)`` says
  ``ESRCH``); a pid that was reused by a live process keeps the segment (conservative).

:func:`reclaim_leftovers` runs when an engine initializes; ``llmdd doctor`` lists leftovers and
removes them with ``--reclaim-shm``.

Scopes: ``/dev/shm`` is one directory for the whole machine, so the engines of a process that sets
``LLMDD_SHM_SCOPE`` (and the processes inheriting it) and the other engines of the machine never
reclaim each other's leftovers.  The test suite gives the tests that watch reclaiming a scope of
their own, so that another engine starting meanwhile cannot reclaim what they planted (issue 41).
Unset (the default), the prefix is ``llmdd_``.

Modes: no other user may open a segment.  The shm transport creates its segments with mode 0600
and sets exactly 0600 after creation, whatever the umask; so does the engine for its pool segments
(:mod:`llmdd._memory.backend`, an ``fchmod`` after ``multiprocessing.shared_memory`` created them).
``plugins/llmdd-transport-shm/tests/test_segment_mode.py`` reads the modes back from ``/dev/shm``.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from typing import Optional

import attrs

__all__ = ["SEGMENT_PREFIX", "SCOPE_ENV", "segment_prefix", "segment_name", "parse_segment_name", "Leftover",
           "find_leftovers", "reclaim_leftovers", "pid_namespace"]

#: the prefix of every segment name outside a scope
SEGMENT_PREFIX = "llmdd_"
#: the environment variable naming this process's segment scope (see the module docstring)
SCOPE_ENV = "LLMDD_SHM_SCOPE"
_NAME = re.compile(r"^llmdd([a-z0-9]{0,16})_(\d+)_(\d+)_([a-z][a-z0-9]{0,15})_([0-9a-z_]{1,40})$")
_KIND = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_SCOPE = re.compile(r"^[a-z0-9]{0,16}$")


def _scope() -> str:
    scope = os.environ.get(SCOPE_ENV, "")
    if not _SCOPE.match(scope):
        raise ValueError(f"{SCOPE_ENV}={scope!r} must be 1-16 lowercase letters or digits")
    return scope


def segment_prefix() -> str:
    """The prefix of this process's segment names: ``llmdd_``, or ``llmdd<scope>_`` in a scope."""
    return f"llmdd{_scope()}_"


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        link = os.readlink("/proc/self/ns/pid")   # "pid:[4026531836]"
    except OSError:
        return 0
    m = re.search(r"\[(\d+)\]", link)
    return int(m.group(1)) if m else 0


def segment_name(kind: str, unique: Optional[str] = None) -> str:
    """A fresh segment name of this process (``kind``: 1-16 lowercase letters or digits)."""
    if not _KIND.match(kind):
        raise ValueError(f"segment kind {kind!r} must be 1-16 lowercase letters or digits")
    return f"{segment_prefix()}{os.getpid()}_{pid_namespace()}_{kind}_{unique or secrets.token_hex(6)}"


def parse_segment_name(name: str) -> Optional[tuple[int, int, str]]:
    """``(pidns, pid, kind)`` of an llmdd segment name (of any scope), or None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    return int(m.group(3)), int(m.group(2)), m.group(4)


@attrs.frozen
class Leftover:
    """A segment whose creator is gone: reclaimable."""

    name: str
    pid: int
    kind: str
    size: int


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True       # exists, another user's process
    return True


def find_leftovers(directory: str = "/dev/shm") -> list[Leftover]:
    """The llmdd segments in ``directory`` whose creator died (rules in the module docstring)."""
    out: list[Leftover] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    ns, me, uid, prefix = pid_namespace(), os.getpid(), os.geteuid(), segment_prefix()
    for name in sorted(names):
        parsed = parse_segment_name(name)
        if parsed is None or not name.startswith(prefix):   # not llmdd's, or another scope's
            continue
        pidns, pid, kind = parsed
        if pidns != ns or ns == 0 or pid == me or pid <= 0:
            continue
        try:
            st = os.stat(os.path.join(directory, name), follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
            continue
        if _alive(pid):
            continue
        out.append(Leftover(name=name, pid=pid, kind=kind, size=int(st.st_size)))
    return out


def reclaim_leftovers(directory: str = "/dev/shm") -> list[Leftover]:
    """Unlink every leftover (see :func:`find_leftovers`); returns the ones removed."""
    removed = []
    for left in find_leftovers(directory):
        try:
            os.unlink(os.path.join(directory, left.name))
        except FileNotFoundError:
            continue      # another engine reclaimed it first
        except OSError:
            continue
        removed.append(left)
    return removed
