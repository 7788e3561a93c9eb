"""Comm groups: the bilateral, rank-table ``link()`` / ``unlink()`` / ``query_register_mem_status()``.

Every member calls ``link(comm_name, cluster_rank_info, rank_table)`` at about the same
time.  Each member listens for the group (see :mod:`llmdd._base.ranktable` for how a rank
table entry maps to an address here), the member of the higher rank of every pair
connects to the lower one with the ordinary link handshake, and the group is ``OK``
once every pairwise link is up (memory descriptors are exchanged by the handshake), or
``FAILED`` when that does not happen within ``link_total_time`` (default 120 s).

A pair has one link, whatever number of groups (and ``link_clusters``) join it: a group over a
pair already linked uses that link and holds it (its comm id among the link's holds); a member
connects only when no link to that peer exists or is being made (one connect per peer at a time),
so a second group never replaces the first one's link.  ``unlink(comm_id)`` gives back the group's
hold; the link ends when neither side holds it (:meth:`LinkManager.unlink_one`).

A same-host member publishes its address in a rendezvous file (:func:`rendezvous_dir`) that names
its incarnation too: ``ip:port pid start incarnation``, ``start`` being the process's start time
(``/proc/<pid>/stat``, clock ticks since boot; 0 where there is no ``/proc``) and ``incarnation`` a
random token of the group.  A reader takes an entry only while that process lives (same pid *and*
start time, not a zombie): the file of a member killed before it could remove it (SIGKILL) is
stale, and the reader keeps waiting, until the group's deadline, for the new member's entry, which
replaces the stale file atomically.  A reader never deletes a file (it could delete a new entry
written between its check and the unlink).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import socket
import tempfile
from typing import TYPE_CHECKING, Any, Optional

from llmdd._base.enums import RegisterMemStatus
from llmdd._lifecycle.tables import GROUP_OK, GROUP_PREPARING, LINK_SETTING_UP
from llmdd._base.log import get_logger
from llmdd._base.options import is_local_address
from llmdd._base.ranktable import RankMember, RankTable
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._runtime.runtime import Threads, Waiter, Worker
from llmdd._runtime.threads import SYSTEM

if TYPE_CHECKING:
    from llmdd._control.link import Link
    from llmdd._lifecycle.machines import Lifecycle, Tracked
    from llmdd._control.manager import LinkManager

__all__ = ["CommGroups", "rendezvous_dir"]

_log = get_logger("llmdd.comm_group")
S = LLMStatusCode

DEFAULT_BASE_PORT = 26100
DEFAULT_TOTAL_TIME_S = 120.0


def rendezvous_dir() -> str:
    return os.environ.get("LLMDD_RENDEZVOUS_DIR") or os.path.join(tempfile.gettempdir(),
                                                                   f"llmdd-rendezvous-{os.getuid()}")


def _start_time(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks since boot) of ``pid`` from ``/proc``; None when there is
    no such process.  Raises OSError other than "no such file" (no ``/proc`` at all, for one)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()   # after "pid (comm) ": state is field 3, start 22
    return fields[0], int(fields[19])


def _own_start_time() -> int:
    try:
        found = _start_time(os.getpid())
    except (OSError, ValueError, IndexError):
        return 0
    return found[1] if found is not None else 0


def _entry_alive(pid: int, start: int) -> bool:
    """Whether the process that wrote a rendezvous entry (``pid`` started at ``start``) still runs:
    a process gone, a zombie, or another process under a reused pid is not it."""
    if start and os.path.isdir("/proc"):
        try:
            found = _start_time(pid)
        except (OSError, ValueError, IndexError):
            found = ("R", start)   # unreadable: judged by the signal check below
        if found is None or found[0] in ("Z", "X") or found[1] != start:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse_entry(text: str) -> tuple[str, int, int, int]:
    """``ip:port pid start incarnation`` → (ip, port, pid, start); ValueError when malformed."""
    parts = text.split()
    if len(parts) != 4:
        raise ValueError(f"malformed rendezvous entry {text!r}")
    host, port_text = parts[0].rsplit(":", 1)
    port, pid, start = int(port_text), int(parts[1]), int(parts[2])
    if not 0 < port < 65536 or pid <= 0 or start < 0:
        raise ValueError(f"malformed rendezvous entry {text!r}")
    return host, port, pid, start


def _base_port() -> int:
    text = os.environ.get("LLMDD_COMM_BASE_PORT")
    return int(text) if text and text.isdigit() else DEFAULT_BASE_PORT


class _Group:
    def __init__(self, comm_id: int, name: str, table: RankTable, ranks: dict, my_rank: int, fsm: "Tracked",
                 stop: Waiter) -> None:
        self.comm_id = comm_id
        self.name = name
        self.table = table
        self.ranks = ranks                      # cluster id -> rank
        self.my_rank = my_rank
        self.fsm = fsm
        self.tag = hashlib.sha256(f"{name}\0{table.digest}".encode()).hexdigest()[:24]
        self.listener: Optional[socket.socket] = None
        self.published: Optional[str] = None
        self.peers = {cid: r for cid, r in ranks.items() if r != my_rank}
        self.linked: set[int] = set()
        self.error: Optional[str] = None
        self.stop = stop                        # set by unlink / finalize: the setup worker ends
        self.thread: Optional[Worker] = None


class CommGroups:
    """The comm groups of one engine (comm ids from 1)."""

    def __init__(self, *, cluster_id: int, links: "LinkManager", lifecycle: "Lifecycle",
                 runtime: Threads = SYSTEM) -> None:
        self._rt = runtime
        self._cluster_id = cluster_id
        self._lm = links
        self._lc = lifecycle
        self._ids = itertools.count(1)
        self._groups: dict[int, _Group] = {}
        self._lock = runtime.lock()
        self._connecting: dict[int, Waiter] = {}   # peer cluster id -> its connect in progress

    def link(self, comm_name: str, cluster_rank_info: dict, table: RankTable) -> int:
        my_id = self._cluster_id
        if my_id not in cluster_rank_info:
            raise LLMException(f"this engine's cluster id {my_id} is not in cluster_rank_info",
                               status_code=S.LLM_PARAM_INVALID)
        for cid, rank in cluster_rank_info.items():
            table.member(rank)  # every rank must be in the table (LLM_PARAM_INVALID otherwise)
        comm_id = next(self._ids)
        fsm = self._lc.create(comm_id, comm_id=comm_id, comm_name=comm_name, members=len(cluster_rank_info))
        group = _Group(comm_id, comm_name, table, dict(cluster_rank_info), cluster_rank_info[my_id], fsm,
                       self._rt.event())
        total = self._lm.settings.total_time_s or DEFAULT_TOTAL_TIME_S
        deadline = self._rt.monotonic() + total
        self._listen(group)
        with self._lock:
            self._groups[comm_id] = group
        group.thread = self._rt.start_worker(f"llmdd-comm-{comm_id}", self._run, group, deadline)
        return comm_id

    # ------------------------------------------------------------------ addressing
    def _listen(self, group: _Group) -> None:
        me = group.table.member(group.my_rank)
        if is_local_address(me.device_ip):
            host, port = "127.0.0.1", 0
        else:
            host, port = "0.0.0.0", _base_port() + me.device_id
        try:
            group.listener = self._lm.open_group_listener(host, port, comm_id=group.comm_id)
        except LLMException:
            group.fsm.fire("prepare_failed", reason=f"cannot listen on {host}:{port}")
            raise
        addr = group.listener.getsockname()
        if host == "127.0.0.1":
            path = os.path.join(rendezvous_dir(), f"{group.tag}-{group.my_rank}")
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                fh.write(f"{addr[0]}:{addr[1]} {os.getpid()} {_own_start_time()} {secrets.token_hex(8)}\n")
            os.replace(tmp, path)   # replaces a stale entry of this rank (its writer was killed)
            group.published = path

    def _address(self, group: _Group, member: RankMember, deadline: float) -> tuple[str, int]:
        if not is_local_address(member.device_ip):
            return member.device_ip, _base_port() + member.device_id
        path = os.path.join(rendezvous_dir(), f"{group.tag}-{member.rank_id}")
        stale: Optional[str] = None
        while self._rt.monotonic() < deadline and not group.stop.is_set():
            try:
                with open(path) as fh:
                    text = fh.read(256)
                host, port, pid, start = _parse_entry(text)
            except (OSError, ValueError):   # not there yet, or being replaced
                group.stop.wait(0.02)
                continue
            if _entry_alive(pid, start):
                return host, port
            if text != stale:   # once per stale entry: its writer is gone, the new member's is awaited
                stale = text
                _log.warning("llmdd.comm_group.stale_entry", comm_id=group.comm_id, rank=member.rank_id,
                             pid=pid, path=path)
            group.stop.wait(0.02)
        raise TimeoutError(f"member of rank {member.rank_id} did not publish its address"
                           + (" (its entry names a process that is gone)" if stale is not None else ""))

    # ------------------------------------------------------------------ setup
    def _run(self, group: _Group, deadline: float) -> None:
        try:
            for cid, rank in sorted(group.peers.items(), key=lambda kv: kv[1]):
                if rank < group.my_rank:
                    link = self._connect(group, cid, rank, deadline)
                    if link.peer_cluster_id != cid:
                        raise LLMException(f"rank {rank} answered as cluster {link.peer_cluster_id}, expected {cid}",
                                           status_code=S.LLM_LINK_FAILED)
                    self._lm.hold(link, group.comm_id)
                    group.linked.add(cid)
            while self._rt.monotonic() < deadline and not group.stop.is_set():
                missing = [cid for cid in group.peers if cid not in group.linked]
                for cid in missing:
                    found = self._lm.get(cid)
                    if found is not None and found.linked:
                        if found.comm_id is None:
                            found.comm_id = group.comm_id
                        self._lm.hold(found, group.comm_id)
                        group.linked.add(cid)
                if len(group.linked) == len(group.peers):
                    break
                group.stop.wait(0.01)
            if group.stop.is_set():
                return
            if len(group.linked) != len(group.peers):
                raise TimeoutError(f"comm group {group.name!r}: not every member linked within the time allowed")
            group.fsm.fire("members_ready", members=len(group.ranks))
        except Exception as exc:  # the failure is the group's state, read by query_register_mem_status
            group.error = str(exc)
            _log.warning("llmdd.comm_group.failed", comm_id=group.comm_id, error=str(exc))
            group.fsm.offer("prepare_failed", error=exc, reason=str(exc))

    def _connect(self, group: _Group, cid: int, rank: int, deadline: float) -> "Link":
        """The link to member ``cid`` (this member connects): the one that exists already (another
        group's, or ``link_clusters``'s), else a new connection.  One connect per peer at a time: a
        group that comes while another connects to the same peer waits for it and uses its link
        (a second handshake would replace the first group's link on the peer)."""
        while True:
            with self._lock:
                busy = self._connecting.get(cid)
                if busy is None:
                    mine = self._connecting[cid] = self._rt.event()
            if busy is not None:
                if not busy.wait(max(0.0, deadline - self._rt.monotonic())):
                    raise TimeoutError(f"comm group {group.name!r}: the link to cluster {cid} being made for "
                                       f"another group did not come up in time")
                continue
            try:
                existing = self._lm.get(cid)
                if existing is not None and not existing.linked and existing.fsm.in_(LINK_SETTING_UP):
                    existing.settled.wait(max(0.0, deadline - self._rt.monotonic()))
                if existing is not None and existing.linked:
                    return existing
                host, port = self._address(group, group.table.member(rank), deadline)
                return self._lm.connect_peer(host, port, deadline, comm_id=group.comm_id)
            finally:
                with self._lock:
                    del self._connecting[cid]
                mine.set()

    # ------------------------------------------------------------------ queries and teardown
    def _get(self, comm_id: int) -> _Group:
        with self._lock:
            group = self._groups.get(comm_id)
        if group is None:
            raise LLMException(f"comm id {comm_id} does not exist", status_code=S.LLM_PARAM_INVALID)
        return group

    def status(self, comm_id: int) -> RegisterMemStatus:
        group = self._get(comm_id)
        if group.fsm.in_(GROUP_PREPARING):
            return RegisterMemStatus.PREPARING
        if group.fsm.in_(GROUP_OK):
            for cid in group.peers:
                link = self._lm.get(cid)
                if link is None or not link.linked or group.comm_id not in link.holds:
                    group.fsm.fire("member_lost", peer=cid)
                    return RegisterMemStatus.FAILED
            return RegisterMemStatus.OK
        return RegisterMemStatus.FAILED

    def unlink(self, comm_id: int) -> None:
        group = self._get(comm_id)
        group.stop.set()
        if group.thread is not None:
            group.thread.join(timeout=5.0)
        deadline = self._rt.monotonic() + 3.0
        failed = []
        for cid in group.peers:
            link = self._lm.get(cid)
            if link is None or comm_id not in link.holds:
                continue
            code = self._lm.unlink_one(cid, deadline, force=False, hold=comm_id)
            if code not in (S.LLM_SUCCESS, S.LLM_NOTIFY_PROMPT_UNLINK_FAILED):
                failed.append((cid, code))
        self._teardown(group, "unlink")
        with self._lock:
            self._groups.pop(comm_id, None)
        if failed:
            raise LLMException(f"unlink of comm {comm_id} failed for {failed}", status_code=failed[0][1])

    def _teardown(self, group: _Group, trigger: str) -> None:
        if group.listener is not None:
            self._lm.close_group_listener(group.listener)
            group.listener = None
        if group.published:
            try:
                os.unlink(group.published)
            except OSError:
                pass
            group.published = None
        group.fsm.offer(trigger)

    def close(self) -> None:
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            group.stop.set()
        for group in groups:
            if group.thread is not None:
                group.thread.join(timeout=2.0)
            self._teardown(group, "finalize")
