"""The record of one link to a peer cluster: its machine, connection, tables, counters and waiters.

Its state is its machine's (``fsm``); everything else here is data the control and data planes
read.  Nothing in this module decides a state.
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

import threading

import attrs

from llmdd._seam.abc import Channel
from llmdd._lifecycle.machines import Tracked
from llmdd._lifecycle.tables import LINK_IN_USE, LINK_RELEASED, LINK_SERVES, LINK_SETTING_UP, LINK_UP, LinkState
from llmdd._protocol import messages as m
from llmdd._protocol.handshake import PeerInfo
from llmdd._protocol.tables import DescriptorTables, TableAnnouncer
from llmdd._base.status import LLMStatusCode
from llmdd._control.connection import ControlConnection
from llmdd._runtime.runtime import Lock, Timer, Waiter
from llmdd._runtime.ioloop import Strand
from llmdd._control.liveness import Liveness

__all__ = ["Link", "Pending", "SetupSession", "CLUSTERS_HOLD"]

#: the hold of this side's ``link_clusters`` on a link (a comm group's hold is its comm id)
CLUSTERS_HOLD = "link_clusters"


class SetupSession(Protocol):
    """The server-side setup a link belongs to until it is LINKED (``admission.ServerSession``)."""

    done: bool            # LINKED or dropped: its deadline does nothing any more
    accepted_at: float    # when the connection was accepted (the deadline runs from here)
    timer: Timer          # the handshake deadline


class Pending:
    """A request waiting for its reply (released by the reply or by the link going down)."""

    __slots__ = ("event", "reply")

    def __init__(self, event: Waiter) -> None:
        self.event = event              # from the link manager's loop (its clock and its way of waiting)
        self.reply: Optional[Union[m.UnlinkAck, m.TransferReply]] = None   # the peer's answer


@attrs.define(eq=False)
class Link:
    """One live link to a peer cluster (keyed by the cluster id the peer reports)."""

    peer_cluster_id: int
    fsm: Tracked
    control: ControlConnection
    peer: Optional[PeerInfo] = None                    # the handshake's answer about the peer
    tables: DescriptorTables = attrs.field(factory=DescriptorTables)
    announcer: TableAnnouncer = attrs.field(factory=TableAnnouncer)
    transport: str = attrs.field(kw_only=True)        # the chosen transport's name (set when the link is adopted)
    transport_reason: str = ""
    channel: Optional[Channel] = None
    tables_ready: Waiter = attrs.field(kw_only=True)   # the peer's first tables are in (from the loop)
    # the data plane's (one transfer at a time); the link manager makes it with its runtime's lock()
    transfer_lock: Lock = attrs.field(factory=threading.Lock, kw_only=True)
    pending: dict = attrs.field(factory=dict)
    remote_regions: set = attrs.field(factory=set)
    comm_id: Optional[int] = None
    is_client: bool = True
    created_at: float = attrs.field(kw_only=True)   # the loop's clock
    bytes_read: int = 0
    bytes_written: int = 0
    transfers: int = 0
    failures: int = 0
    last_error: Optional[str] = None
    failure_status: Optional[LLMStatusCode] = None
    strand: Strand = attrs.field(kw_only=True)   # the link's tasks, in order, on the engine's pool
    session: Optional[SetupSession] = None    # server side: the accepting admission.ServerSession until LINKED
    # server side: the peer's offer of the chosen transport (its descriptor and capability; deferred until
    # its link_descriptor request), until LINKED
    setup_descriptor: Optional[m.TransportOffer] = attrs.field(default=None, repr=False)
    grant_id: Optional[int] = None            # this side's data-port grant to the peer (Endpoint.grant)
    capability: Optional[bytes] = attrs.field(default=None, repr=False)   # never logged, never shown
    settled: Waiter = attrs.field(kw_only=True)   # LINKED, FAILED or closed (from the loop)
    claimed: bool = False                     # server side: a local link_clusters to the peer returned it
    liveness: Liveness = attrs.field(kw_only=True)   # keepalive state, sans-io (.liveness)
    # who on this side holds the link: CLUSTERS_HOLD (a link_clusters made or claimed it) and the
    # comm ids of the groups using it; an unlink gives back one hold, and the link ends only when
    # neither side holds it any more (docs/links.md, "Unlink").  Changed under the link table's lock.
    holds: set = attrs.field(factory=set)
    unlink_pending: bool = False  # this side's non-force unlink waits for the peer's answer
    unlink_crossed: bool = False  # ... and the peer's own unlink request came meanwhile (both unlink)

    @property
    def last_rx(self) -> float:
        """When the peer was last heard (the loop's clock)."""
        return self.liveness.last_rx

    @property
    def rtt_s(self) -> Optional[float]:
        """The last keepalive round trip, or None before the first answer."""
        return self.liveness.rtt_s

    @property
    def state(self) -> LinkState:
        state = self.fsm.state
        if not isinstance(state, LinkState):   # the fsm is tracked by the LINK lifecycle
            raise TypeError(f"link to {self.peer_cluster_id}: its machine is in {state!r}, not a LinkState")
        return state

    @property
    def linked(self) -> bool:
        """Up with its peer: LINKED, or RELEASED (this side let it go, the peer keeps it)."""
        return self.fsm.in_(LINK_UP)

    @property
    def released(self) -> bool:
        """This side unlinked it while the peer still holds it (RELEASED: served, not used here)."""
        return self.fsm.in_(LINK_RELEASED)

    @property
    def in_use(self) -> bool:
        """llmdd._protocol.port.LinkView: this side's transfers may start on it (LINKED: not on its way
        down, not released)."""
        return self.fsm.in_(LINK_IN_USE)

    @property
    def serves_peer(self) -> bool:
        """Are the peer's requests and notices served (and recorded)?  LINKED or UNLINKING, or a
        client's link still in its setup (the server is LINKED before its tables leave).  A link
        FAILED, CLOSED or not yet accepted serves nothing and holds nothing."""
        return self.fsm.in_(LINK_SERVES) or (self.is_client and self.fsm.in_(LINK_SETTING_UP))
