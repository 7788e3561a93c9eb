"""The link table: every link of one engine by peer cluster id, and the bookkeeping of links being made.

One :class:`LinkTable` per link manager.  It holds the live links (keyed by the cluster id the
peer reports), the aliases (the ``remote_cluster_id`` a user gave -> the peer's id), the clusters a
``link_clusters`` call is linking now, the peers whose incoming link is being accepted, and why
each remote's last link attempt failed.  Each method is one critical section under the table's
lock; only dict and set operations, reads of a link's machine and the ``Lifecycle.create`` of the
caller happen under it: no trigger fires, no socket, plugin, hook or memory call is made while it
is held (docs/architecture.md, "Locks": it is the outermost lock of the control plane).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from llmdd._base.status import LLMStatusCode
from llmdd._runtime.runtime import Waiter
from llmdd._control.link import Link
from llmdd._protocol import messages as m
from llmdd._lifecycle.tables import LINK_CLAIMABLE, LINK_FAILED, LINK_PROCESSING, LINK_RELEASED

__all__ = ["LinkTable"]

S = LLMStatusCode


class LinkTable:
    """The links of one engine and the links being made, under one lock."""

    def __init__(self, *, cluster_id: int, max_links: Optional[int], event: Callable[[], Waiter]) -> None:
        self.cluster_id = cluster_id
        self._event = event             # the loop's waiters (threading.Event on the engine's loop)
        self._max_links = max_links
        self._lock = threading.RLock()
        self._links: dict[int, Link] = {}           # peer cluster id -> live link
        self._aliases: dict[int, int] = {}          # remote_cluster_id given by the user -> peer id
        self._linking: set[int] = set()             # remote_cluster_ids with a link_clusters in progress
        self._accepting: dict[int, Waiter] = {}   # peers whose incoming link is being accepted
        # remote_cluster_id -> why its last link_clusters attempt failed (dropped when one succeeds);
        # a failed link is never made, so it has no Link.last_error (LLMDataDist.statistics()["link_failures"])
        self._link_failures: dict[int, dict] = {}

    # ------------------------------------------------------------------ lookups
    def get(self, cluster_id: int) -> Optional[Link]:
        with self._lock:
            link = self._links.get(cluster_id)
            if link is None:
                alias = self._aliases.get(cluster_id)
                if alias is not None:
                    link = self._links.get(alias)
            return link

    def links(self) -> list[Link]:
        with self._lock:
            return list(self._links.values())

    def has_links(self) -> bool:
        with self._lock:
            return any(not lk.fsm.is_final for lk in self._links.values())

    def announced_to(self) -> list[Link]:
        """The links whose peer gets this engine's table changes (its tables are in, or it is LINKED)."""
        with self._lock:
            return [lk for lk in self._links.values() if lk.tables_ready.is_set() or lk.linked]

    # ------------------------------------------------------------------ entries
    def put(self, link: Link) -> Optional[Link]:
        """Enter ``link`` for its peer; returns the link it replaces (the caller closes it)."""
        with self._lock:
            old = self._links.get(link.peer_cluster_id)
            self._links[link.peer_cluster_id] = link
        return old

    def remove(self, link: Link) -> None:
        """Drop ``link`` when it is still its peer's entry (a replacement stays)."""
        with self._lock:
            if self._links.get(link.peer_cluster_id) is link:
                del self._links[link.peer_cluster_id]

    def set_alias(self, remote_id: int, peer_cluster_id: int) -> None:
        with self._lock:
            self._aliases[remote_id] = peer_cluster_id

    def _link_limit_reached(self) -> bool:
        limit = self._max_links
        return limit is not None and sum(1 for lk in self._links.values() if not lk.fsm.is_final) >= limit

    # ------------------------------------------------------------------ server side: a link being accepted
    def begin_accept(self, hello: m.Hello) -> tuple[bool, bool, Optional[Waiter]]:
        """A peer authenticated: is this engine over its link limit, is it a cross link, and (when it
        is neither and no other accept of that peer runs) the event its ``link_clusters`` may wait on."""
        accepting: Optional[Waiter] = None
        with self._lock:
            over = self._link_limit_reached() and hello.cluster_id not in self._links
            cross = self._is_cross_link(hello)
            if not over and not cross and hello.cluster_id not in self._accepting:
                accepting = self._accepting[hello.cluster_id] = self._event()
        return over, cross, accepting

    def end_accept(self, peer_id: int, accepting: Waiter) -> None:
        with self._lock:
            if self._accepting.get(peer_id) is accepting:
                del self._accepting[peer_id]
        accepting.set()

    def _is_cross_link(self, hello: m.Hello) -> bool:
        """Under ``_lock``: is ``hello`` the peer's half of a simultaneous mutual link that this side,
        the lower cluster id, keeps its own half of?  (A peer with a new incarnation is a restart, not
        a cross link: its link replaces the old one.)"""
        peer_id = hello.cluster_id
        if self.cluster_id >= peer_id:
            return False
        if peer_id in self._linking:
            return True
        existing = self._links.get(peer_id)
        return (existing is not None and existing.is_client and not existing.fsm.is_final
                and not existing.fsm.in_(LINK_FAILED) and existing.peer is not None
                and existing.peer.incarnation == hello.incarnation)

    # ------------------------------------------------------------------ client side: link_clusters
    def peer_started(self, remote_id: int) -> bool:
        """Did the peer ``remote_id`` link to this engine first (or is it doing so now)?"""
        with self._lock:
            existing = self._links.get(self._aliases.get(remote_id, remote_id))
            return (existing is not None and not existing.is_client and not existing.claimed
                    and existing.fsm.in_(LINK_CLAIMABLE)) \
                or (existing is None and remote_id in self._accepting)

    def reserve(self, remote_id: int) -> tuple[Optional[LLMStatusCode], Optional[Link]]:
        """Reserve ``remote_id`` for one ``link_clusters`` call: (the status to answer at once, or None
        when reserved; the FAILED link to replace, if any)."""
        with self._lock:
            if self._link_limit_reached():
                return S.LLM_CLUSTER_NUM_EXCEED_LIMIT, None
            stale = None
            existing = self._links.get(self._aliases.get(remote_id, remote_id))
            if existing is not None:
                if existing.linked:
                    return S.LLM_ALREADY_LINK, None
                if existing.fsm.in_(LINK_PROCESSING):
                    return S.LLM_PROCESSING_LINK, None
                stale = existing  # FAILED: the caller relinks without unlinking first; replace it
            if remote_id in self._linking:
                # another call is linking this cluster: its handshake would be replaced by ours
                return S.LLM_PROCESSING_LINK, None
            self._linking.add(remote_id)
        return None, stale

    def release(self, remote_id: int) -> None:
        with self._lock:
            self._linking.discard(remote_id)

    def peer_link(self, remote_id: int) -> tuple[Optional[Link], Optional[Waiter]]:
        """The link the peer ``remote_id`` started (or None), and the event of its accept in progress."""
        with self._lock:
            return self._links.get(remote_id), self._accepting.get(remote_id)

    def claim(self, link: Link, remote_id: int) -> bool:
        """Return the peer's link from this side's ``link_clusters``: False when claimed already."""
        with self._lock:
            if link.claimed:
                return False
            link.claimed = True
            self._aliases[remote_id] = link.peer_cluster_id
        return True

    # ------------------------------------------------------------------ holds (who on this side uses a link)
    def hold(self, link: Link, token: object) -> None:
        """``token`` (``CLUSTERS_HOLD`` or a comm id) holds ``link`` from now on (a released link is
        LINKED again: ``hold``)."""
        deliver: list[Callable[[], None]] = []
        with self._lock:
            link.holds.add(token)
            if link.fsm.in_(LINK_RELEASED):
                link.fsm.offer("hold", defer=deliver.append)
        for event in deliver:   # after the lock
            event()

    def rehold(self, remote_id: int, token: object) -> Optional[Link]:
        """A ``link_clusters`` to a peer whose link this side released but the peer kept: hold it
        again (RELEASED -> LINKED, nothing to set up) and return it; None when that is not the case."""
        deliver: list[Callable[[], None]] = []
        with self._lock:
            link = self._links.get(self._aliases.get(remote_id, remote_id))
            if link is None or not link.fsm.in_(LINK_RELEASED) or link.unlink_pending:
                return None
            link.holds.add(token)
            link.fsm.offer("hold", defer=deliver.append)
        for event in deliver:   # after the lock
            event()
        return link

    def drop_shared_hold(self, link: Link, token: object) -> bool:
        """Drop ``token``'s hold when another hold of this side remains (no message to the peer):
        True when it was dropped so."""
        with self._lock:
            if token not in link.holds or len(link.holds) < 2:
                return False
            link.holds.discard(token)
            return True

    def begin_unlink(self, link: Link, token: object) -> bool:
        """This side's last hold (``token``) goes and its unlink request is about to leave: whether
        this side held the link at all (a server that never linked back did not)."""
        with self._lock:
            held = token in link.holds
            link.holds.discard(token)
            link.unlink_pending, link.unlink_crossed = True, False
            return held

    def end_unlink(self, link: Link, *, kept: bool) -> str:
        """This side's unlink got its answer (or none): ``"crossed"`` when the peer unlinked at the
        same moment (the link ends), ``"kept"`` when the peer keeps the link (``unlink_kept``: this
        side has released it, RELEASED; LINKED again at once when a hold of this side came meanwhile),
        else ``"closed"``."""
        deliver: list[Callable[[], None]] = []
        with self._lock:
            link.unlink_pending = False
            if link.unlink_crossed:
                outcome = "crossed"
            elif kept:
                outcome = "kept"
                if link.fsm.offer("unlink_kept", reason="the peer keeps the link", defer=deliver.append) \
                        and link.holds:
                    link.fsm.offer("hold", defer=deliver.append)
            else:
                outcome = "closed"
        for event in deliver:   # after the lock
            event()
        return outcome

    def peer_unlinks(self, link: Link, *, force: bool) -> str:
        """The peer's unlink request arrived: ``"crossed"`` when this side is unlinking too (each
        answers the other's request; this side's own unlink ends the link), ``"kept"`` when this side
        still holds the LINKED link (only the peer's hold went), else ``"close"``.  ``force``: the peer
        held nothing and ends the link whatever this side holds."""
        with self._lock:
            if link.unlink_pending:
                link.unlink_crossed = True
                return "crossed"
            if link.holds and not force and link.linked:
                return "kept"
            return "close"   # nothing holds it here, or it failed here: it ends on both sides

    def record_attempt(self, remote_id: int, code: LLMStatusCode, error: Optional[str]) -> None:
        """The outcome of a ``link_clusters`` attempt: a failure is kept until one succeeds."""
        with self._lock:
            if error is None:
                self._link_failures.pop(remote_id, None)
            else:
                self._link_failures[remote_id] = {"status": code.name, "error": error, "at": time.time()}

    def link_failures(self) -> dict:
        """remote_cluster_id -> {"status", "error", "at"} of its last failed link_clusters attempt
        (kept until a later attempt succeeds)."""
        with self._lock:
            return {k: dict(v) for k, v in self._link_failures.items()}
