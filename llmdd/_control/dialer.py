"""The client side of link setup: ``link_clusters``, one link's connect and handshake, and claiming
a link the peer started.

:meth:`Dialer.link_clusters` links up to ``MAX_CLUSTERS_PER_CALL`` clusters at once (a small thread
pool of its own, for that call only).  One cluster is reserved in the link table while it is
linked; a peer that linked to this engine first (or at the same moment, a cross link) is claimed
instead of dialled, so each pair has one link.  :meth:`Dialer.connect_peer` connects (retrying a
server over its caps with a growing jittered pause), wraps TLS, runs the client handshake in the
caller's thread, has the link manager adopt the link, exchanges tables and connects the data
channel; the connection moves to the I/O loop once authenticated.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any, Optional

from llmdd._base.log import get_logger
from llmdd._base.options import is_ip_literal, is_local_address
from llmdd._base.status import InvalidStateError, LLMException, LLMStatusCode
from llmdd._control.announce import Announcements
from llmdd._control.connection import ControlConnection
from llmdd._control.endpoints import TransportEndpoints, endpoint_descriptor, offer_args, to_wire
from llmdd._control.link import CLUSTERS_HOLD, Link
from llmdd._control.linking import (
    CROSS_LINK_REASON, LINK_DESCRIPTOR_OP, NO_TRANSPORT, CrossLink, LinkHost, transport_reason,
)
from llmdd._protocol import messages as m
from llmdd._protocol.codec import PEER_CLOSED, ProtocolError
from llmdd._protocol.handshake import ClientHandshake, HandshakeRefused
from llmdd._runtime.runtime import run_concurrently
from llmdd._control.settings import MAX_CLUSTERS_PER_CALL
from llmdd._control.table import LinkTable
from llmdd._extension.manager import LazyCandidates
from llmdd._lifecycle.tables import LINK_SETTING_UP
from llmdd._seam.abc import TransportError
from llmdd.plugin import LinkInfo

__all__ = ["Dialer"]

_log = get_logger("llmdd.link")

S = LLMStatusCode


class Dialer:
    """The client side of link setup."""

    def __init__(self, *, host: LinkHost, table: LinkTable, endpoints: TransportEndpoints,
                 announcements: Announcements) -> None:
        self.host = host
        self._table = table
        self.endpoints = endpoints
        self._announcements = announcements
        # the local IP a client named in ``append_local_ip_info`` (where data endpoints bind by default)
        self.client_host: Optional[str] = None

    def link_clusters(self, clusters: list, timeout_ms: int) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        if not clusters:
            return S.LLM_SUCCESS, []
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            codes = [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
            return S.LLM_CLUSTER_NUM_EXCEED_LIMIT, codes
        deadline = self.host.loop.monotonic() + timeout_ms / 1000.0
        if len(clusters) == 1:
            codes = [self._link_one_safe(clusters[0], deadline)]
        else:
            codes = run_concurrently(self.host.loop, lambda c: self._link_one_safe(c, deadline), clusters,
                                     width=16, name="llmdd-link")
        overall = S.LLM_SUCCESS
        for code in codes:
            if code is not S.LLM_SUCCESS:
                overall = code
        return overall, codes

    def _link_one_safe(self, cluster, deadline: float) -> LLMStatusCode:
        remote = cluster.remote_cluster_id
        try:
            code = self._link_one(cluster, deadline)
            error = None if code in (S.LLM_SUCCESS, S.LLM_ALREADY_LINK) else code.name
        except LLMException as exc:
            _log.warning("llmdd.link.failed", remote=remote, error=str(exc))
            code = exc.status_code if exc.status_code is not S.LLM_SUCCESS else S.LLM_LINK_FAILED
            error = str(exc)
        except Exception as exc:  # never raise out of link_clusters
            _log.warning("llmdd.link.failed", remote=remote, error=repr(exc))
            code, error = S.LLM_LINK_FAILED, repr(exc)
        self._table.record_attempt(remote, code, error)
        return code

    def _link_one(self, cluster, deadline: float) -> LLMStatusCode:
        remote_id = cluster.remote_cluster_id
        io_error = self.host.io_error
        if io_error is not None:
            raise LLMException(f"the engine's I/O loop stopped ({io_error}); finalize and init again",
                               status_code=S.LLM_LINK_FAILED)
        if self._table.rehold(remote_id, CLUSTERS_HOLD) is not None:
            # this side unlinked it and the peer kept it: this side holds it again
            return S.LLM_SUCCESS
        if self._table.peer_started(remote_id):
            # the peer linked to this engine first (or is doing so now): that link serves both directions
            return self._claim_peer_link(remote_id, deadline)
        refused, stale = self._table.reserve(remote_id)
        if refused is not None:
            return refused
        try:
            if stale is not None:
                self.host.close_link(stale, trigger="force_unlink", reason="relink after failure")
            return self._link_one_unreserved(cluster, remote_id, deadline)
        finally:
            self._table.release(remote_id)

    def _link_one_unreserved(self, cluster, remote_id: int, deadline: float) -> LLMStatusCode:
        if not cluster.remote_ip_info_list:
            raise LLMException("remote_ip_info_list is empty. Call append_remote_ip_info to set the server's "
                               "listen address.", status_code=S.LLM_PARAM_INVALID)
        ip_int, port = cluster.remote_ip_info_list[0]
        host = socket.inet_ntoa(int(ip_int).to_bytes(4, "little"))
        if self.client_host is None and cluster.local_ip_info_list:
            local = socket.inet_ntoa(int(cluster.local_ip_info_list[0][0]).to_bytes(4, "little"))
            if local not in ("0.0.0.0",) and is_local_address(local):
                self.client_host = local
        try:
            link = self.connect_peer(host, port, deadline)
        except CrossLink:
            # the peer links to this engine at the same moment and keeps its own link: use that one
            return self._claim_peer_link(remote_id, deadline)
        self._table.set_alias(remote_id, link.peer_cluster_id)
        self._table.hold(link, CLUSTERS_HOLD)
        return S.LLM_SUCCESS

    def _claim_peer_link(self, remote_id: int, deadline: float) -> LLMStatusCode:
        """Wait (until ``deadline``) for the link the peer ``remote_id`` started to this engine, and
        return it from this side's ``link_clusters`` (one link per pair, transfers both ways)."""
        while True:
            link, accepting = self._table.peer_link(remote_id)
            left = deadline - self.host.loop.monotonic()
            if link is not None and not link.is_client:
                if link.fsm.in_(LINK_SETTING_UP) and left > 0:
                    link.settled.wait(left)
                    continue
                if not link.linked:
                    raise LLMException(f"the link cluster {remote_id} started to this engine did not come up "
                                       f"({link.last_error or link.state.value})", status_code=S.LLM_LINK_FAILED)
                if not self._table.claim(link, remote_id):
                    return S.LLM_ALREADY_LINK
                self._table.hold(link, CLUSTERS_HOLD)
                return S.LLM_SUCCESS
            if link is not None and link.linked:
                return S.LLM_ALREADY_LINK
            if left <= 0:
                raise LLMException(f"cluster {remote_id} links to this engine at the same moment; its link did not "
                                   f"come up in time", status_code=S.LLM_LINK_FAILED)
            if accepting is not None:
                accepting.wait(min(left, 0.5))
            else:
                self.host.loop.sleep(min(left, 0.01))   # the peer's connection has not arrived yet

    def connect_peer(self, host: str, port: int, deadline: float, *, comm_id: Optional[int] = None) -> Link:
        """Client side of one link: connect and handshake (retrying), tables, data channel.

        Runs in the caller's thread; the connection moves to the I/O loop once authenticated."""
        io_error = self.host.io_error
        if io_error is not None:
            raise LLMException(f"the engine's I/O loop stopped ({io_error})", status_code=S.LLM_LINK_FAILED)
        if not any(True for _ in LazyCandidates(self.endpoints.registry)):   # probes until one transport can run
            raise LLMException(f"cannot link to {host}:{port}: {NO_TRANSPORT}", status_code=S.LLM_LINK_FAILED)
        if self.host.settings.total_time_s is not None and comm_id is not None:
            deadline = min(deadline, self.host.loop.monotonic() + self.host.settings.total_time_s)
        grant_id, capability = self.endpoints.mint()
        while True:
            conn, peer, offers = self._client_handshake(host, port, deadline, capability=capability)
            deferred = next((o for o in offers if o.name == peer.transport.name and o.deferred), None)
            if deferred is None or self.endpoints.open_deferred(deferred.name) is not None:
                break
            # the server chose a transport offered deferred that cannot run here: hand the server's
            # half-made link back (it fails and goes) and offer again without it
            conn.close()
            if self.host.loop.monotonic() >= deadline:
                raise LLMException(f"link to {host}:{port} failed: no time left after {deferred.name!r} turned out "
                                   f"unusable here", status_code=S.LLM_LINK_FAILED)
        link: Optional[Link] = None
        try:
            info = LinkInfo(local_cluster_id=self.host.cluster_id, peer_cluster_id=peer.cluster_id,
                            same_host=self.host.host.same_ipc_domain(peer.host), forced=self.host.settings.forced_transport,
                            peer_transports=tuple(o.name for o in peer.offered))
            link = self.host.adopt(peer, conn, is_client=True, transport=peer.transport.name,
                                  reason=transport_reason(info, peer.transport.name))
            link.comm_id = comm_id
            # the peer connects its data channel to us once our tables are in: grant before they leave
            link.grant_id, link.capability = grant_id, capability
            self.endpoints.grant(link, ())
            if deferred is not None:   # our endpoint's descriptor, before the tables the server waits for
                desc = to_wire(self.endpoints.endpoint(link.transport).describe())
                (offer,) = self.endpoints.with_capability((m.TransportOffer(name=link.transport, descriptor=desc),),
                                                 capability)
                self.host.notify(link, m.TransferRequest(request_id=0, op=LINK_DESCRIPTOR_OP,
                                                    args=offer_args(offer)))
            self._announcements.send_initial_tables(link)
            link.tables_ready.wait(max(0.0, deadline - self.host.loop.monotonic()))
            if not link.tables_ready.is_set():
                raise TimeoutError("the peer did not send its tables in time")
            if not link.fsm.in_(LINK_SETTING_UP):
                raise ProtocolError(f"the peer went away during the link setup ({link.last_error})")
            self.host.connect_channel(link, endpoint_descriptor(peer.transport), deadline)
            link.liveness.restart(self.host.loop.monotonic())   # liveness counts from LINKED, not from a slow handshake
            link.fsm.fire("handshake_succeeded", transport=link.transport, reason=link.transport_reason)
            link.settled.set()
            return link
        except (TimeoutError, ProtocolError, TransportError, OSError, InvalidStateError) as exc:
            if link is not None:
                self.host.fail(link, exc, trigger="handshake_failed")
                self.host.close_link(link, trigger="force_unlink", reason="link setup failed")
            else:
                conn.close()
            raise LLMException(f"link to {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None

    def _client_handshake(self, host: str, port: int, deadline: float, *,
                          capability: bytes) -> tuple[ControlConnection, Any, tuple]:
        """Connect and authenticate; returns the (blocking, not yet attached) connection, the peer and
        the transports offered.

        A server over its pending-connection caps closes a new connection at once, before any
        answer: that attempt is retried, with a growing jittered pause, while the deadline
        allows.  Connection failures are retried ``link_retry_count`` times (the contract's option)."""
        attempts = max(1, self.host.settings.retry_count)
        failures = 0
        busy = 0
        last: BaseException | None = None
        offers = self.endpoints.with_capability(self.endpoints.offers(), capability)
        while True:
            left = deadline - self.host.loop.monotonic()
            if left <= 0:
                if last is None:
                    last = TimeoutError("no time left")
                break
            try:
                sock = self.host.loop.create_connection((host, port), left)
            except OSError as exc:
                last = exc
                failures += 1
                if failures >= attempts:
                    raise LLMException(f"cannot connect to {host}:{port}: {exc}",
                                       status_code=S.LLM_LINK_FAILED) from None
                self.host.loop.sleep(min(0.05 * failures, max(0.0, deadline - self.host.loop.monotonic())))
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client_tls = self.host.settings.client_tls
                if client_tls is not None:
                    sock.settimeout(max(0.1, deadline - self.host.loop.monotonic()))
                    sock = self._wrap_client_tls(client_tls, sock, host)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                if _closed_at_once(exc):
                    last = exc
                    busy += 1
                    self._busy_pause(busy, deadline)
                    continue
                raise LLMException(f"TLS with {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None
            conn = ControlConnection(self.host.loop, sock, name=f"{host}:{port}")
            try:
                hs = ClientHandshake(self.host.handshake_config(self.host.role, offers=offers))
                conn.send(hs.start())
                while not hs.finished:
                    msg = conn.recv_message(deadline)
                    if msg is PEER_CLOSED:
                        raise ProtocolError("the server closed the connection before answering")
                    for out in hs.receive(msg):
                        conn.send(out)
                peer = hs.result()   # raises HandshakeRefused
                if peer.frame_key is not None and self.host.settings.client_tls is None:
                    # a secret and no TLS: every frame after the Welcome carries a MAC with a sequence number
                    conn.codec.enable_frame_mac(peer.frame_key, client=True)
                return conn, peer, offers
            except HandshakeRefused as exc:
                conn.close()
                if exc.by_peer and exc.refusal.status_code == S.LLM_ALREADY_LINK.value \
                        and exc.refusal.reason == CROSS_LINK_REASON:
                    raise CrossLink(str(exc)) from None
                if not (exc.by_peer and exc.refusal.status_code == S.LLM_LINK_BUSY.value):
                    raise LLMException(f"link to {host}:{port} refused: {exc}",
                                       status_code=S.LLM_LINK_FAILED) from None
                last = exc   # over the server's pending-connection caps: retry while time allows
                busy += 1
                self._busy_pause(busy, deadline)
            except (ProtocolError, OSError, TimeoutError) as exc:
                conn.close()
                raise LLMException(f"link to {host}:{port} failed: {exc}", status_code=S.LLM_LINK_FAILED) from None
        if busy:
            reason = f"the server kept refusing new connections ({busy} refused; last: {last})"
        elif failures:
            reason = f"the link timeout passed while connecting ({failures} failed attempts; last: {last})"
        else:   # the deadline passed before this thread tried once: it did not get to run in time
            reason = "the link timeout passed before a connection could be tried (this process did not run in time)"
        raise LLMException(f"link to {host}:{port} failed: {reason}", status_code=S.LLM_LINK_FAILED)

    def _wrap_client_tls(self, client_tls: ssl.SSLContext, sock: socket.socket, host: str) -> socket.socket:
        """TLS on a client socket: the server's certificate must name ``llmdd.tls_server_name`` when it
        is set, else ``host`` when that is a name rather than an IP literal (with a CA; see docs)."""
        name = self.host.settings.tls_server_name
        if name is None and self.host.settings.client_tls_named is not None and not is_ip_literal(host):
            name = host
        if name is not None and self.host.settings.client_tls_named is not None:
            return self.host.settings.client_tls_named.wrap_socket(sock, server_hostname=name)
        return client_tls.wrap_socket(sock)

    def _busy_pause(self, attempt: int, deadline: float) -> None:
        pause = min(0.5, 0.01 * (2 ** min(attempt, 6))) * (0.5 + self.host.loop.random())
        self.host.loop.sleep(max(0.0, min(pause, deadline - self.host.loop.monotonic())))


def _closed_at_once(exc: BaseException) -> bool:
    """A TLS server closed a new connection before its TLS handshake (over a cap)."""
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError)):
        return True
    return isinstance(exc, ssl.SSLError) and "EOF" in str(exc)
