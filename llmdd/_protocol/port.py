"""The typed port between the control plane and the data plane, below both.

The control plane (``llmdd._control.manager.LinkManager``) owns links: their sockets, their lifecycle
and the messages that cross them.  The data plane (``llmdd._data.engine.TransferEngine``) moves bytes
over a link's channel and keeps the owner-side tables of what peers reserved and read.  Each sees
the other only through one of the two protocols below, built by the composition root
(``llmdd._engine.core.EngineCore``):

* :class:`ControlPort` is what the data plane may ask of the control plane: find a linked peer,
  send it a request and wait for the reply, send it a one-way notice, record a transfer's outcome
  on the link, and fail the link (the data channel broke, or a peer sent out-of-table numbers).
* :class:`DataService` is what the control plane hands to the data plane: the requests and notices
  of the data plane's vocabulary (:class:`RequestOp`, :data:`DataNotice`) that arrived on a link,
  and "this link is down".
* :class:`LinkView` is what the data plane may read of a link (the control plane's record,
  ``llmdd._control.link.Link``, is one): whose it is, its peer's announced tables, its data channel,
  whether it is in use or serves its peer (and why it failed), and the lock of its one transfer at a time.  The data plane reads these and
  hands the link back through the port; it writes none of them.

Nothing crosses between the planes by string-keyed tables, private calls or writes to another
layer's fields.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional, Protocol, Union

from llmdd._base.status import LLMStatusCode
from llmdd._protocol import messages as m
from llmdd._protocol.tables import DescriptorTables
from llmdd._seam.abc import Channel

__all__ = ["RequestOp", "DataNotice", "LinkView", "ControlPort", "DataService", "request_op"]


class RequestOp(str, enum.Enum):
    """The requests a peer's data plane sends this engine's data plane (``TransferRequest.op``)."""

    RESERVE_KEY = "reserve_key"     # hold a CacheKey for a pull; the reply names its cache and batch slot
    CONSUME_KEY = "consume_key"     # a pull of a reserved key finished (these tensors were read)
    ENGINE_INFO = "engine_info"     # the owner's memory pools and chip profile (the D2H/H2D rules)


#: one-way notices of the data plane (``TaggedDone`` is acknowledged: it arrives as a request)
DataNotice = Union[m.ReadDone, m.KeyConsumed, m.ReleaseKey, m.PushDone]


class TurnLock(Protocol):
    """A link's transfer lock (made by the engine's runtime: ``threading.Lock``'s ``acquire`` / ``release``)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


class LinkView(Protocol):
    """What the data plane reads of a link (read-only: the control plane owns the record)."""

    @property
    def peer_cluster_id(self) -> int:
        """The peer's cluster id (the key of the link)."""
        ...

    @property
    def tables(self) -> DescriptorTables:
        """The peer's announced caches, regions and keys."""
        ...

    @property
    def channel(self) -> Optional[Channel]:
        """The data channel of the chosen transport (None until the link is adopted)."""
        ...

    @property
    def in_use(self) -> bool:
        """This side may start transfers on the link: LINKED, not on its way down, and not released
        (a link this side unlinked while the peer still holds it serves the peer only)."""
        ...

    @property
    def serves_peer(self) -> bool:
        """The peer's requests and notices are served (and what they reserve recorded)."""
        ...

    @property
    def failure_status(self) -> Optional[LLMStatusCode]:
        """Why the link failed (the status its users get), or None while it has not."""
        ...

    @property
    def transfer_lock(self) -> "TurnLock":
        """Held by the one transfer that runs on the link (the data plane's busy turn)."""
        ...


class ControlPort(Protocol):
    """What the data plane may ask of the control plane (implemented by ``LinkManager``)."""

    def require(self, cluster_id: int) -> LinkView:
        """The LINKED link to ``cluster_id``; raises the contract's status otherwise."""
        ...

    def get(self, cluster_id: int) -> Optional[LinkView]:
        """The current link to ``cluster_id`` whatever its state, or None."""
        ...

    def request(self, link: LinkView, op: RequestOp, args: dict, *, deadline: float) -> tuple[int, dict]:
        """Send ``op`` and wait for the peer's reply until ``deadline`` (monotonic seconds)."""
        ...

    def ask(self, link: LinkView, message: m.TaggedDone, *, deadline: float) -> tuple[int, dict]:
        """Send an acknowledged notice and wait for its reply until ``deadline``."""
        ...

    def notify(self, link: LinkView, message: m.Message) -> None:
        """Send a one-way message, best effort (a link that is gone drops it)."""
        ...

    def fail_link(self, link: LinkView, error: BaseException, *,
                  status: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED) -> None:
        """The link can no longer be trusted: move it to FAILED (a link already down stays as it is)."""
        ...

    def transfer_timed_out(self, link: LinkView, error: BaseException) -> None:
        """A step exceeded ``sync_kv_timeout``: the link is unusable until relinked (contract)."""
        ...

    def record_transfer(self, link: LinkView, *, read: int = 0, written: int = 0, failed: bool = False) -> None:
        """Count a transfer on the link's statistics (bytes read or written, or one failure)."""
        ...


class DataService(Protocol):
    """What the control plane hands to the data plane (implemented by ``TransferEngine``)."""

    def serve(self, link: LinkView, op: RequestOp, args: dict) -> tuple[int, dict]:
        """Answer a peer's request: ``(status code, result)``; raising ``LLMException`` answers its status."""
        ...

    def serve_tagged(self, link: LinkView, message: m.TaggedDone) -> tuple[int, dict]:
        """A peer's tagged transfer on one of this engine's caches ended (acknowledged by the reply)."""
        ...

    def on_notice(self, link: LinkView, message: DataNotice) -> None:
        """A one-way notice of the peer's data plane arrived (in arrival order per link)."""
        ...

    def quiesce(self, link: LinkView, unlink: Callable[[], None]) -> bool:
        """Before an unlink: True when no transfer runs on ``link``; ``unlink()`` (the control plane's
        move of the link to UNLINKING, its event deferred) is then called before any transfer can start
        on it.  False while one runs (``unlink`` is not called; the unlink answers ``LLM_LINK_BUSY``)."""
        ...

    def on_link_down(self, link: LinkView) -> None:
        """The link failed or closed: forget what its peer reserved, queued or was refused."""
        ...


def request_op(op: str) -> Optional[RequestOp]:
    """The :class:`RequestOp` named ``op`` on the wire, or None for an op this engine does not serve."""
    try:
        return RequestOp(op)
    except ValueError:
        return None
