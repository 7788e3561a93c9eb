"""A link's transfers: which async tasks hold which link, which links are being unlinked, and the
blocking transfers' turn on a link.

A link carries one blocking transfer at a time (its ``transfer_lock``) and none while a layer-wise
async task holds it.  Which async tasks hold which link, and which links are being unlinked, is
this engine's table (:class:`BusyTable`, under its lock), so that "busy" is decided in one place: an
async task claims all its links at once or none, and once an unlink has quiesced a link no transfer
starts on it.

Lock: ``BusyTable._lock`` is a leaf, held only while the table changes (taking a link's
``transfer_lock`` without waiting inside it); docs/architecture.md, "Locks".
"""

from __future__ import annotations

import threading
from typing import Any

from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._data.port import ControlPort

__all__ = ["BusyTable"]

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
        self._closing: set[int] = set()         # id(link) of links quiesced for an unlink

    def claim_links(self, links: list) -> None:
        """An async task takes ``links`` (all or none): LLM_LINK_BUSY while another task or an unlink has one."""
        with self._lock:
            for link in links:
                if self._async_busy.get(id(link)) or id(link) in self._closing:
                    raise _err(f"an async transfer is already running on the link to cluster "
                               f"{link.peer_cluster_id}", S.LLM_LINK_BUSY)
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

    def quiesce(self, link: Any) -> bool:
        """llmdd._data.port.DataService: True when no transfer runs on ``link``, and from then on none starts
        on it (the control plane unlinks it next); False while one runs (the unlink answers LLM_LINK_BUSY)."""
        with self._lock:
            if self._async_busy.get(id(link)) or not link.transfer_lock.acquire(timeout=0):
                return False
            self._closing.add(id(link))
        link.transfer_lock.release()
        return True

    def acquire(self, link: Any) -> None:
        """Take ``link``'s transfer lock for one blocking transfer (by sync_kv_timeout), or raise the
        contract's status: busy with an async task, unlinking, down, or relinked meanwhile."""
        if self._async_busy.get(id(link)):
            raise _err(f"an async transfer is running on the link to cluster {link.peer_cluster_id}",
                       S.LLM_LINK_BUSY)
        if not link.transfer_lock.acquire(timeout=self.timeout_s):
            raise _err(f"the link to cluster {link.peer_cluster_id} stayed busy for {self.timeout_s:.3f} s",
                       S.LLM_LINK_BUSY)
        if id(link) in self._closing and link.linked:
            link.transfer_lock.release()   # quiesced for an unlink that has not fired yet: as if UNLINKING
            raise _err(f"link to cluster {link.peer_cluster_id} is unlinking", S.LLM_PROCESSING_LINK)
        if not link.linked:
            link.transfer_lock.release()
            if self._lm.get(link.peer_cluster_id) in (link, None):
                # failed or unlinking: its status; unlinked: LLM_NOT_YET_LINK, as a call made now
                self._lm.require(link.peer_cluster_id)
            # relinked while this call waited: it was planned on the link that went (and it never
            # returns without holding that link's lock)
            raise _err(f"the link to cluster {link.peer_cluster_id} went down while this transfer waited for it",
                       getattr(link, "failure_status", None) or S.LLM_LINK_FAILED)

    def forget(self, link: Any) -> None:
        """The link is down, or its unlink kept it: it is no longer being unlinked."""
        with self._lock:
            self._closing.discard(id(link))
