"""A link's liveness, sans-io: no socket, no thread and no clock of its own (aioquic's style).

The link manager feeds it what happened and when (``received(now)`` for any message from the
peer, ``acked(now_ns, echo_ns)`` for a keepalive's answer) and asks it, every keepalive interval,
what to do (``tick(now, stalled_since)``): send a keepalive, or give the peer up with a reason.
``now`` is whatever clock the caller uses, so tests drive it with a fake one.

The rule (docs/links.md, "Liveness"): a linked peer that sent nothing for ``timeout_s``, or that
has read nothing of ours for ``timeout_s`` (our outbound buffer stayed non-empty), is lost.
Liveness counts from LINKED (``restart``), not from a slow handshake.
"""

from __future__ import annotations

from typing import Optional, Union

import attrs

__all__ = ["Liveness", "SendKeepalive", "PeerLost"]


@attrs.frozen
class SendKeepalive:
    """Send ``Keepalive(seq, sent_at_ns)`` to the peer now."""

    seq: int


@attrs.frozen
class PeerLost:
    """The peer is gone: fail the link with ``reason``."""

    reason: str


@attrs.define
class Liveness:
    """One link's keepalive state: when the peer was last heard, its round trip, the next seq."""

    peer: int
    timeout_s: float
    last_rx: float
    rtt_s: Optional[float] = None
    seq: int = 0

    def restart(self, now: float) -> None:
        """The link just became LINKED: silence counts from now."""
        self.last_rx = now

    def received(self, now: float) -> None:
        """Any message from the peer arrived at ``now``."""
        self.last_rx = now

    def acked(self, now_ns: int, echo_sent_at_ns: int) -> None:
        """The peer answered a keepalive this side sent at ``echo_sent_at_ns``."""
        self.rtt_s = max(0, now_ns - echo_sent_at_ns) / 1e9

    def lost(self, now: float, stalled_since: Optional[float]) -> Optional[str]:
        """Why the peer is lost at ``now`` (its silence, or our unread output), or None."""
        silent = now - self.last_rx
        if silent > self.timeout_s:
            return f"no message from peer {self.peer} for {silent:.1f} s"
        if stalled_since is not None and now - stalled_since > self.timeout_s:
            return f"peer {self.peer} has read nothing for {now - stalled_since:.1f} s"
        return None

    def tick(self, now: float, stalled_since: Optional[float]) -> Union[SendKeepalive, PeerLost]:
        """The keepalive interval passed: give the peer up, or send it the next keepalive."""
        reason = self.lost(now, stalled_since)
        if reason is not None:
            return PeerLost(reason)
        self.seq += 1
        return SendKeepalive(self.seq)
