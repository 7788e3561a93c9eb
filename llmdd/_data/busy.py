"""A link's transfers: which async tasks hold which link, and the blocking transfers' turn on a link.

A link carries one blocking transfer at a time (its ``transfer_lock``: the transfer's *turn*, taken
and given back in one place, ``with busy.turn(link):``) and none while a layer-wise async task holds
it.  Which async tasks hold which link is this engine's table (:class:`BusyTable`, under its lock),
so that "busy" is decided in one place: an async task claims all its links at once or none; an
unlink quiesces a link by moving it to UNLINKING (the link table's state) while it holds the link's
turn, so no transfer starts on it afterwards.

Lock: ``BusyTable._lock`` is held only while the table changes (taking a link's ``transfer_lock``
without waiting inside it) and while :meth:`BusyTable.quiesce` moves a link to UNLINKING, which takes
the link table's lock inside it (that order only; no event is delivered under either);
docs/architecture.md, "Locks".
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Callable, Optional

from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._protocol.port import ControlPort, LinkView

__all__ = ["BusyTable", "Turn"]

S = LLMStatusCode


def _err(msg: str, code: LLMStatusCode) -> LLMException:
    return LLMException(msg, status_code=code)


class BusyTable:
    """Which links this engine's transfers hold, and the turn of a blocking transfer on a link."""

    def __init__(self, *, port: ControlPort, timeout_s: float) -> None:
        self._lm = port
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._async_busy: dict[int, int] = {}   # id(link) -> layer-wise async tasks holding it

    def claim_links(self, links: list) -> None:
        """An async task takes ``links`` (all or none): LLM_LINK_BUSY while another task or an unlink has one."""
        with self._lock:
            for link in links:
                if self._async_busy.get(id(link)) or not link.in_use:
                    raise _err(f"an async transfer is already running on the link to cluster "
                               f"{link.peer_cluster_id}, or the link is no longer in use", S.LLM_LINK_BUSY)
            for link in links:
                self._async_busy[id(link)] = self._async_busy.get(id(link), 0) + 1

    def release_links(self, links: list) -> None:
        with self._lock:
            for link in links:
                left = self._async_busy.get(id(link), 0) - 1
                if left > 0:
                    self._async_busy[id(link)] = left
                else:
                    self._async_busy.pop(id(link), None)

    def quiesce(self, link: LinkView, unlink: Callable[[], None]) -> bool:
        """llmdd._protocol.port.DataService: True when no transfer ran on ``link`` and ``unlink()`` moved it
        out of use (UNLINKING) before any could start; False while one runs (``unlink`` is not called,
        and the unlink answers LLM_LINK_BUSY)."""
        with self._lock:
            if self._async_busy.get(id(link)) or not link.transfer_lock.acquire(timeout=0):
                return False
            try:
                unlink()
            finally:
                link.transfer_lock.release()
        return True

    def turn(self, link: LinkView) -> "Turn":
        """``with busy.turn(link):`` runs its body as ``link``'s one blocking transfer: entering takes
        the link's transfer lock (by sync_kv_timeout) or raises the contract's status (busy with an
        async task, unlinking, down, or relinked meanwhile); leaving, however the body ends, gives it
        back."""
        return Turn(self, link)


class Turn:
    """A blocking transfer's turn on one link (:meth:`BusyTable.turn`), a context manager.

    It keeps no state of one use (the turn is the link's ``transfer_lock``), only what entering reads,
    looked up once: so one made per link (a prepared plan keeps its link's) may be entered by any
    number of transfers, one after another or from several threads."""

    __slots__ = ("_busy", "_link", "_key", "_lock")

    def __init__(self, busy: BusyTable, link: LinkView) -> None:
        self._busy = busy
        self._link = link
        self._key = id(link)                 # the link's key in the table of async holds
        self._lock = link.transfer_lock      # fixed for the link's life

    def __enter__(self) -> None:
        """Take the link's transfer lock for one blocking transfer, or raise (see :meth:`BusyTable.turn`)."""
        busy = self._busy
        if busy._async_busy.get(self._key):
            raise _err(f"an async transfer is running on the link to cluster {self._link.peer_cluster_id}",
                       S.LLM_LINK_BUSY)
        if not self._lock.acquire(timeout=busy.timeout_s):
            raise _err(f"the link to cluster {self._link.peer_cluster_id} stayed busy for {busy.timeout_s:.3f} s",
                       S.LLM_LINK_BUSY)
        link = self._link
        if not link.in_use:
            self._lock.release()
            if busy._lm.get(link.peer_cluster_id) in (link, None):
                # failed or unlinking: its status; unlinked: LLM_NOT_YET_LINK, as a call made now
                busy._lm.require(link.peer_cluster_id)
            # relinked while this call waited: it was planned on the link that went (and it never
            # returns without holding that link's lock)
            raise _err(f"the link to cluster {link.peer_cluster_id} went down while this transfer waited for it",
                       link.failure_status or S.LLM_LINK_FAILED)

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._lock.release()
