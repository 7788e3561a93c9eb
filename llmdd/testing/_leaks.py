"""Resource snapshots for leak checks: threads, file descriptors, /dev/shm segments, RSS.

    before = ResourceSnapshot.take()
    ...  # run and clean up the code under test
    before.assert_no_leaks()  # polls (grace_s) until threads finish and fds close, then fails

Inside a peer (see ``_harness``): ``before = handle.call(peer_snapshot)`` then
``before.assert_no_leaks(lambda: handle.call(peer_snapshot))``.

Only *new* things count as leaks: a thread, fd (number and target) or shm name present after but
not before.  Python threads are compared by ``(ident, name)``; the native thread count
(``/proc/self/task``) and RSS are reported, and RSS fails only when ``rss_slack_bytes`` is given.
Linux only for fds, native threads and RSS (empty / 0 elsewhere).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Pattern, Union

__all__ = ["LeakReport", "ResourceLeakError", "ResourceSnapshot", "peer_snapshot"]

_SHM_DIR = "/dev/shm"

IgnorePattern = Union[str, "Pattern[str]"]


def _fd_table() -> tuple[tuple[int, str], ...]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return ()
    table = []
    for name in names:
        try:
            table.append((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:  # the directory fd of listdir itself, or closed meanwhile
            continue
    return tuple(sorted(table))


def _shm_names() -> frozenset[str]:
    try:
        return frozenset(os.listdir(_SHM_DIR))
    except OSError:
        return frozenset()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


@dataclass(frozen=True)
class LeakReport:
    """What appeared between two snapshots (after ignore patterns)."""

    threads: tuple[tuple[int, str], ...] = ()
    fds: tuple[tuple[int, str], ...] = ()
    shm: tuple[str, ...] = ()
    rss_growth_bytes: int = 0
    rss_exceeded: bool = False
    native_threads_before: int = 0
    native_threads_after: int = 0

    def __bool__(self) -> bool:
        return bool(self.threads or self.fds or self.shm or self.rss_exceeded)

    def format(self) -> str:
        lines = []
        if self.threads:
            lines.append(f"threads still running ({len(self.threads)}):")
            lines += [f"    {name!r} (ident {ident})" for ident, name in self.threads]
        if self.fds:
            lines.append(f"file descriptors still open ({len(self.fds)}):")
            lines += [f"    fd {fd} -> {target}" for fd, target in self.fds]
        if self.shm:
            lines.append(f"/dev/shm entries left ({len(self.shm)}):")
            lines += [f"    {_SHM_DIR}/{name}" for name in self.shm]
        if self.rss_exceeded:
            lines.append(f"RSS grew by {self.rss_growth_bytes} bytes (over the allowed slack)")
        lines.append(f"(native threads {self.native_threads_before} -> {self.native_threads_after},"
                     f" RSS {self.rss_growth_bytes:+d} bytes)")
        return "\n".join(lines)


class ResourceLeakError(AssertionError):
    """Raised by :meth:`ResourceSnapshot.assert_no_leaks`; ``report`` is the :class:`LeakReport`."""

    def __init__(self, message: str, report: LeakReport) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return (type(self), (str(self), self.report))


def _compile(ignore: Iterable[IgnorePattern]) -> list[Pattern[str]]:
    return [p if isinstance(p, re.Pattern) else re.compile(p) for p in ignore]


def _ignored(patterns: list[Pattern[str]], text: str) -> bool:
    return any(p.search(text) for p in patterns)


@dataclass(frozen=True)
class ResourceSnapshot:
    """Resources of one process at one moment; picklable, so a peer can return one."""

    pid: int
    threads: frozenset[tuple[int, str]]
    native_threads: int
    fds: tuple[tuple[int, str], ...]
    shm: frozenset[str]
    rss_bytes: int
    taken_at: float = field(compare=False)

    @classmethod
    def take(cls) -> "ResourceSnapshot":
        return cls(
            pid=os.getpid(),
            threads=frozenset((t.ident or 0, t.name) for t in threading.enumerate()),
            native_threads=_native_threads(),
            fds=_fd_table(),
            shm=_shm_names(),
            rss_bytes=_rss_bytes(),
            taken_at=time.monotonic(),
        )

    def diff(self, after: "ResourceSnapshot", *, ignore: Iterable[IgnorePattern] = (),
             rss_slack_bytes: int | None = None) -> LeakReport:
        """New threads/fds/shm entries in ``after``.

        ``ignore``: regular expressions searched in ``"thread:<name>"``, ``"fd:<target>"`` and
        ``"shm:<name>"``; a match hides the item (``"thread:pytest_timeout"``, ``"fd:pipe:"``).
        """
        if after.pid != self.pid:
            raise ValueError(f"snapshots of different processes ({self.pid} and {after.pid})")
        pats = _compile(ignore)
        before_fds = set(self.fds)
        growth = after.rss_bytes - self.rss_bytes
        return LeakReport(
            threads=tuple(sorted((t for t in after.threads - self.threads
                                  if not _ignored(pats, f"thread:{t[1]}")), key=lambda t: t[1])),
            fds=tuple(fd for fd in after.fds if fd not in before_fds and not _ignored(pats, f"fd:{fd[1]}")),
            shm=tuple(sorted(n for n in after.shm - self.shm if not _ignored(pats, f"shm:{n}"))),
            rss_growth_bytes=growth,
            rss_exceeded=rss_slack_bytes is not None and growth > rss_slack_bytes,
            native_threads_before=self.native_threads,
            native_threads_after=after.native_threads,
        )

    def assert_no_leaks(
        self,
        after: "ResourceSnapshot | Callable[[], ResourceSnapshot] | None" = None,
        *,
        grace_s: float = 2.0,
        ignore: Iterable[IgnorePattern] = (),
        rss_slack_bytes: int | None = None,
        poll_s: float = 0.05,
    ) -> None:
        """Fail with a readable diff if resources are still leaked once ``grace_s`` has passed.

        ``after``: ``None`` (take fresh snapshots of this process), a snapshot (compared first;
        later polls take fresh ones when it is of this process, otherwise it is compared once),
        or a callable returning a snapshot (e.g. ``lambda: peer.call(peer_snapshot)``), called
        at each poll.
        """
        ignore = list(ignore)
        deadline = time.monotonic() + grace_s

        def source() -> Callable[[], ResourceSnapshot]:
            if callable(after):
                return after
            return ResourceSnapshot.take

        snap = after if isinstance(after, ResourceSnapshot) else source()()
        repeatable = not isinstance(after, ResourceSnapshot) or after.pid == os.getpid()
        while True:
            report = self.diff(snap, ignore=ignore, rss_slack_bytes=rss_slack_bytes)
            if not report or not repeatable or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
            snap = source()()
        if report:
            raise ResourceLeakError(
                f"resource leaks in pid {self.pid} after a {grace_s} s grace period:\n{report.format()}", report)


def peer_snapshot(state: dict[str, Any]) -> ResourceSnapshot:
    """Peer function (``handle.call(peer_snapshot)``): a snapshot of the child process."""
    return ResourceSnapshot.take()
