"""What both sides of a link's setup ask of the link manager, and the words they share.

The server side (:mod:`llmdd._control.admission`) and the client side (:mod:`llmdd._control.dialer`)
set a link up; the link manager (:mod:`llmdd._control.manager`) owns the link once it exists: it
adopts it into the link table, runs its per-link protocol, fails and closes it.  The setup sides
see the manager only as a :class:`LinkHost` (the manager builds them and passes itself), so neither
imports the manager.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from llmdd._base.enums import LLMRole
from llmdd._control.connection import ControlConnection
from llmdd._control.ioloop import Runtime
from llmdd._control.link import Link
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.handshake import HandshakeConfig, PeerInfo
from llmdd._control.settings import LinkSettings
from llmdd._seam.abc import EndpointDescriptor
from llmdd.plugin import LinkInfo

__all__ = ["LinkHost", "LINK_DESCRIPTOR_OP", "NO_TRANSPORT", "CROSS_LINK_REASON", "CrossLink", "transport_reason"]

#: the control plane's own request op: a client's data descriptor for a transport offered by name only
LINK_DESCRIPTOR_OP = "link_descriptor"

NO_TRANSPORT = ("no transport is available in this process (no transport plugin installed, or all "
                "unavailable or disabled): pip install llmdd brings llmdd-transport-shm and llmdd-transport-tcp; "
                "`llmdd doctor` says what is missing")
CROSS_LINK_REASON = "cross link: both clusters link to each other; the link the lower cluster id starts is kept"


class CrossLink(Exception):
    """The peer refused our link because its own link to us, started at the same moment, is kept."""


class LinkHost(Protocol):
    """The link manager as link setup sees it (implemented by ``LinkManager``)."""

    @property
    def loop(self) -> Runtime: ...

    @property
    def settings(self) -> LinkSettings: ...

    @property
    def cluster_id(self) -> int: ...

    @property
    def role(self) -> LLMRole: ...

    @property
    def host(self) -> m.HostIdentity: ...

    @property
    def closed(self) -> bool:
        """``close`` has begun: no new link is accepted."""
        ...

    @property
    def io_error(self) -> Optional[str]:
        """Why the engine's I/O loop stopped, or None while it runs."""
        ...

    def handshake_config(self, role: LLMRole, *, offers: Optional[tuple] = None) -> HandshakeConfig: ...

    def adopt(self, peer: PeerInfo, conn: ControlConnection, *, is_client: bool, transport: str, reason: str,
              start: bool = True) -> Link:
        """Enter a link for an authenticated peer into the table (replacing a stale one)."""
        ...

    def dispatch(self, link: Link, msg: Any) -> None:
        """A message arrived on ``link``'s control connection (loop thread)."""
        ...

    def submit(self, link: Link, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` on the link's strand, in order with its other tasks."""
        ...

    def connect_channel(self, link: Link, peer_desc: EndpointDescriptor, deadline: float) -> None:
        """Connect the link's data channel to the peer's endpoint."""
        ...

    def fail(self, link: Link, error: BaseException, *, trigger: str) -> None:
        """Move a link to FAILED (a link down already absorbs the trigger)."""
        ...

    def close_link(self, link: Link, *, trigger: str, reason: str) -> None:
        """Tear a link down and drop it from the table; it ends CLOSED."""
        ...

    def notify(self, link: Link, msg: Any) -> None:
        """Best-effort one-way message."""
        ...

    def peer_unlinks(self, link: Link, *, force: bool) -> str:
        """The peer asks to unlink: ``"crossed"``, ``"kept"`` or ``"close"`` (``LinkTable.peer_unlinks``)."""
        ...


def transport_reason(info: LinkInfo, name: str) -> str:
    if info.forced:
        return f"forced by option ({info.forced})"
    where = "same host" if info.same_host else "different host"
    return f"{where}: chosen {name} among {list(info.peer_transports)}"
