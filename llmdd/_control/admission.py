"""Server admission: accepted control connections until their link is LINKED, or dropped.

A listener hands each accepted connection to :meth:`Admission.admit` (loop thread).  Over a cap
(per address, in all) it is refused at once without work, or the oldest connection of the busiest
address is evicted to make room.  Admitted, it becomes a :class:`ServerSession`: the server half of
the handshake, under one deadline from accept to LINKED.  Once the peer authenticated,
:meth:`Admission.server_accept` (on the pool) refuses a cross link or a link over the limit, chooses
the transport and has the link manager adopt the link; :meth:`Admission.server_finish` (on the
link's strand, once the peer's tables are in) connects the data channel, sends this engine's tables
and fires LINKED.  A setup that fails leaves nothing behind (:meth:`Admission.abort_setup`).

The pending sessions are the loop thread's; the link table's lock is taken only inside
:class:`~llmdd._control.table.LinkTable`'s methods.
"""

from __future__ import annotations

import collections
import socket
from typing import Any, Optional

from msgspec.structs import replace as msgspec_replace

from llmdd._base.log import get_logger
from llmdd._base.profiles import ChipProfile
from llmdd._base.status import InvalidStateError, LLMException, LLMStatusCode
from llmdd._control.announce import Announcements
from llmdd._control.connection import ControlConnection, TlsFailed
from llmdd._control.endpoints import TransportEndpoints, endpoint_descriptor, offer_from_args, to_wire
from llmdd._runtime.runtime import PoolFull, Waiter
from llmdd._control.link import Link
from llmdd._control.linking import CROSS_LINK_REASON, NO_TRANSPORT, LinkHost, transport_reason
from llmdd._control.listener import Listener, close_quietly, refuse_busy
from llmdd._protocol import messages as m
from llmdd._protocol.codec import ProtocolError
from llmdd._protocol.handshake import PRE_AUTH_MAX_FRAME_SIZE, HandshakeRefused, ServerHandshake
from llmdd._control.table import LinkTable
from llmdd._extension.manager import Hooks, LazyCandidates
from llmdd._lifecycle.tables import LINK_SETTING_UP
from llmdd._seam.abc import TransportError
from llmdd.plugin import LinkInfo

__all__ = ["Admission", "ServerSession"]

_log = get_logger("llmdd.link")

S = LLMStatusCode


class _Refused(Exception):
    """A connection over a cap: closed at once, without work."""


class ServerSession:
    """One accepted control connection until its link is LINKED (or it is dropped).

    Pre-authentication it counts against the pending caps; the handshake deadline runs from
    accept to LINKED whatever happens in between.
    """

    __slots__ = ("adm", "conn", "addr", "ip", "listener", "hs", "timer", "pending", "link", "accepted_at", "done")

    def __init__(self, adm: "Admission", conn: ControlConnection, addr, listener: Listener) -> None:
        self.adm = adm
        self.conn = conn
        self.addr = addr
        self.ip = addr[0]
        self.listener = listener
        self.hs = ServerHandshake(adm.host.handshake_config(adm.host.role, offers=()))
        self.timer = adm.host.loop.call_later(adm.host.settings.handshake_s, self.expire)
        self.pending = True
        self.link: Optional[Link] = None
        self.accepted_at = adm.host.loop.monotonic()
        self.done = False

    def on_message(self, msg: m.Message) -> None:
        for out in self.hs.receive(msg):
            self.conn.send(out)
        if self.hs.refused:
            _log.warning("llmdd.link.refused", peer=str(self.addr),
                         reason=self.hs.refusal.reason if self.hs.refusal else "")
            self.drop()
        elif self.hs.authenticated:
            self.adm.unpend(self)
            self.conn.pause()
            try:
                self.adm.host.loop.pool.submit(self.adm.server_accept, self)
            except PoolFull as exc:
                self.listener.refused += 1
                _log.warning("llmdd.link.accept_refused", peer=str(self.addr), error=str(exc))
                try:
                    self.conn.send(self.hs.refuse(S.LLM_LINK_FAILED.value, "the server is overloaded; retry"))
                except ProtocolError:
                    pass
                self.drop()

    def on_closed(self, error: BaseException | None) -> None:
        self.adm.unpend(self)
        self.timer.cancel()
        if self.link is None:
            self.done = True
            if isinstance(error, TlsFailed):
                _log.warning("llmdd.link.tls_refused", peer=str(self.addr), error=str(error))
            elif error is not None:
                _log.info("llmdd.link.handshake_failed", peer=str(self.addr), error=str(error))

    def expire(self) -> None:
        """The handshake deadline (loop thread): whatever is not LINKED by now is dropped."""
        if self.done:
            return
        self.done = True
        self.adm.unpend(self)
        link = self.link
        if link is None:
            if not self.conn.closed:
                _log.info("llmdd.link.handshake_deadline", peer=str(self.addr), seconds=self.adm.host.settings.handshake_s)
            self.conn.close()
            return
        if link.fsm.in_(LINK_SETTING_UP):
            err = TimeoutError(f"link setup did not finish within {self.adm.host.settings.handshake_s} s")
            self.adm.host.submit(link, self.adm.abort_setup, link, err)

    def drop(self, *, busy: bool = False) -> None:
        self.done = True
        self.timer.cancel()
        self.adm.unpend(self)
        if busy and not self.conn._tls and not self.conn.closed:
            try:   # evicted to make room: a legitimate client retries on this answer
                self.conn.send(self.hs.refuse(S.LLM_LINK_BUSY.value, "evicted to make room; retry"))
            except (ProtocolError, InvalidStateError):
                pass
        self.conn.close()


class Admission:
    """The server side of link setup: admission caps, pending handshakes, accept and finish."""

    def __init__(self, *, host: LinkHost, table: LinkTable, endpoints: TransportEndpoints, hooks: Hooks,
                 announcements: Announcements, profile: ChipProfile) -> None:
        self.host = host
        self._table = table
        self.endpoints = endpoints
        self._hooks = hooks
        self._announcements = announcements
        self._profile = profile
        self._pending: dict[ServerSession, None] = {}            # pre-authentication sessions (loop thread)
        self._pending_by_ip: collections.Counter = collections.Counter()
        self._counters: collections.Counter[str] = collections.Counter()

    def admit(self, listener: Listener, sock: socket.socket, addr) -> None:
        """A connection was accepted (loop thread): refuse it at once over a cap, else start its handshake."""
        ip = addr[0] if isinstance(addr, tuple) else str(addr)
        try:
            if self.host.closed or self.host.io_error is not None:
                raise _Refused("the engine is closing")
            if self._pending_by_ip[ip] >= self.host.settings.max_pending_per_address:
                self._counters["refused_per_address"] += 1
                raise _Refused(f"{ip} already has {self._pending_by_ip[ip]} connections in their handshake")
            if len(self._pending) >= self.host.settings.max_pending:
                victim = self._eviction_victim(ip)
                if victim is None:
                    self._counters["refused_pending"] += 1
                    raise _Refused(f"{len(self._pending)} connections are in their handshake")
                self._counters["evicted"] += 1
                victim.drop(busy=True)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tls = self.host.settings.server_tls
            if tls is not None:
                sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            conn = ControlConnection(self.host.loop, sock, name=f"{ip}:{addr[1]}", tls_handshake=tls is not None)
            conn.codec.max_frame_size = PRE_AUTH_MAX_FRAME_SIZE
            sess = ServerSession(self, conn, addr, listener)
        except _Refused as exc:
            listener.refused += 1
            _log.debug("llmdd.link.connection_refused", peer=ip, reason=str(exc))
            refuse_busy(sock, self.host.settings.server_tls is not None)
            return
        except Exception as exc:  # noqa: BLE001 - no memory, no TLS, a bad socket: refuse this one and go on
            listener.refused += 1
            self._counters["admit_failures"] += 1
            _log.warning("llmdd.link.connection_refused", peer=ip, error=repr(exc))
            close_quietly(sock)
            return
        self._pending[sess] = None
        self._pending_by_ip[ip] += 1
        sess.conn.attach(sess.on_message, sess.on_closed)

    def _eviction_victim(self, ip: str) -> Optional[ServerSession]:
        """With every pending slot taken, the oldest connection of the address holding the most
        slots makes room, unless the newcomer's address already holds as many (a flood from some
        addresses never locks out another address)."""
        busiest, count = None, self._pending_by_ip[ip]
        for addr, n in self._pending_by_ip.items():
            if n > count:
                busiest, count = addr, n
        if busiest is None:
            return None
        oldest = None
        for sess in self._pending:
            if sess.ip == busiest and (oldest is None or sess.accepted_at < oldest.accepted_at):
                oldest = sess
        return oldest

    def unpend(self, sess: ServerSession) -> None:
        if not sess.pending:
            return
        sess.pending = False
        if self._pending.pop(sess, 0) is None:
            self._pending_by_ip[sess.ip] -= 1
            if self._pending_by_ip[sess.ip] <= 0:
                del self._pending_by_ip[sess.ip]

    def server_accept(self, sess: ServerSession) -> None:
        """Server side, once the peer authenticated (on the pool): choose the transport, adopt the link.

        The rest of the setup runs when the peer's tables arrive (:meth:`server_finish`, on the
        link's strand); the session's deadline bounds all of it."""
        hs, conn, addr = sess.hs, sess.conn, sess.addr
        link: Optional[Link] = None
        accepting: Optional[Waiter] = None
        grant_name: Optional[str] = None
        grant_id: Optional[int] = None
        capability: Optional[bytes] = None
        hello: Optional[m.Hello] = None
        try:
            if sess.done or conn.closed:
                return
            hello = hs.hello
            if hello is None:   # a session is handed here only once its handshake authenticated the peer
                raise ProtocolError(f"link accept from {addr} before the peer authenticated")
            over, cross, accepting = self._table.begin_accept(hello)
            if cross:
                # both engines link to each other at once: the link the lower cluster id starts is the one
                # kept; the peer's own link_clusters returns that link once it is up
                conn.send(hs.refuse(S.LLM_ALREADY_LINK.value, CROSS_LINK_REASON))
                sess.drop()
                return
            if over:
                conn.send(hs.refuse(S.LLM_CLUSTER_NUM_EXCEED_LIMIT.value,
                                    f"this engine has reached its link limit ({self._profile.max_links})"))
                sess.drop()
                return
            offered = {o.name: o for o in hello.transports}
            info = LinkInfo(local_cluster_id=self.host.cluster_id, peer_cluster_id=hello.cluster_id,
                            same_host=self.host.host.same_ipc_domain(hello.host),
                            forced=self.host.settings.forced_transport, peer_transports=tuple(offered))
            candidates = LazyCandidates(self.endpoints.registry, offered)   # probed only as far as the policy looks
            name = self._hooks.select_transport(info, candidates)
            if name is None:
                none_here = "" if self.endpoints.registry.candidates() else f"; the server: {NO_TRANSPORT}"
                conn.send(hs.refuse(S.LLM_LINK_FAILED.value,
                                    f"no common transport (offered {sorted(offered)}, here "
                                    f"{[c.name for c in candidates]}, forced {info.forced}){none_here}"))
                sess.drop()
                return
            ep = self.endpoints.endpoint(name)
            offer = m.TransportOffer(name=name, descriptor=to_wire(ep.describe()))
            if ep.capabilities:
                grant_id, capability = self.endpoints.mint()
                ep.grant(grant_id, capability, ())
                grant_name = name
                offer = msgspec_replace(offer, capability=capability)
            welcome = hs.accept(offer)
            link = self.host.adopt(hs.result(), conn, is_client=False, transport=name,
                                  reason=transport_reason(info, name),
                               start=False)
            link.grant_id, link.capability = grant_id, capability
            link.comm_id = sess.listener.comm_id
            link.session = sess
            link.setup_descriptor = offered[name]
            sess.link = link
            conn.codec.max_frame_size = 16 * 1024 * 1024
            conn.send(welcome)
            frame_key = hs.result().frame_key
            if frame_key is not None and self.host.settings.server_tls is None:
                # a secret and no TLS: every frame after the Welcome carries a MAC with a sequence number
                conn.codec.enable_frame_mac(frame_key, client=False)
            conn.resume(lambda msg: self.host.dispatch(link, msg))
            if sess.done:   # the deadline passed meanwhile
                raise TimeoutError(f"link setup did not finish within {self.host.settings.handshake_s} s")
        except (TimeoutError, ProtocolError, HandshakeRefused, TransportError, LLMException, OSError) as exc:
            _log.warning("llmdd.link.accept_failed", peer=str(addr), error=str(exc))
            if link is not None:
                if link.grant_id is None:
                    self.endpoints.revoke(grant_name, grant_id)
                self.host.submit(link, self.abort_setup, link, exc)
            else:
                self.endpoints.revoke(grant_name, grant_id)
                sess.drop()
        finally:
            if accepting is not None and hello is not None:   # accepting is set only after hello is
                self._table.end_accept(hello.cluster_id, accepting)

    def server_finish(self, link: Link) -> None:
        """Server side, on the link's strand once the peer's tables are in: data channel, our tables, LINKED."""
        sess = link.session
        try:
            if not link.fsm.in_(LINK_SETTING_UP) or sess is None or sess.done:
                raise ProtocolError(f"the peer went away during the link setup ({link.last_error})")
            deadline = sess.accepted_at + self.host.settings.handshake_s
            if link.setup_descriptor is None or link.setup_descriptor.deferred:
                raise ProtocolError(f"the peer chose {link.transport!r} from a deferred offer but sent no descriptor")
            self.host.connect_channel(link, endpoint_descriptor(link.setup_descriptor), deadline)
            link.liveness.restart(self.host.loop.monotonic())   # liveness counts from LINKED, not from a slow handshake
            # LINKED before our tables leave: the peer is LINKED only once they arrive, so by the time its
            # link_clusters returns this side already is
            link.fsm.fire("handshake_succeeded", transport=link.transport, reason=link.transport_reason)
            link.settled.set()
            self._announcements.send_initial_tables(link)
            sess.done = True
            sess.timer.cancel()
            link.session = None
            link.setup_descriptor = None
        except (TimeoutError, ProtocolError, TransportError, LLMException, OSError, InvalidStateError) as exc:
            self.abort_setup(link, exc)

    def abort_setup(self, link: Link, exc: BaseException) -> None:
        """A server-side link whose setup failed leaves nothing behind."""
        if not link.fsm.in_(LINK_SETTING_UP):
            return
        _log.warning("llmdd.link.accept_failed", peer=link.peer_cluster_id, error=str(exc))
        sess = link.session
        if sess is not None:
            sess.done = True
            sess.timer.cancel()
        self.host.fail(link, exc, trigger="handshake_failed")
        self.host.close_link(link, trigger="force_unlink", reason=f"link setup failed: {exc}")

    def serve_link_descriptor(self, link: Link, args: dict) -> tuple[int, dict]:
        """Server side: the descriptor of the client's endpoint for a transport it offered deferred."""
        try:
            offer: Optional[m.TransportOffer] = offer_from_args(args)
        except (TypeError, ValueError):   # InvalidMessage(Type): not an offer the wire could carry
            offer = None
        if (link.is_client or not link.fsm.in_(LINK_SETTING_UP) or link.session is None or offer is None
                or offer.name != link.transport or link.setup_descriptor is None
                or not link.setup_descriptor.deferred):
            return S.LLM_PARAM_INVALID.value, {"error": "no deferred transport offer waits for a descriptor"}
        link.setup_descriptor = offer
        return 0, {}

    def drop_pending(self) -> None:
        """Finalize: every connection still in its handshake is dropped."""
        for sess in list(self._pending):
            sess.drop()

    def statistics(self) -> dict:
        """Pending handshakes and refusals (``LinkManager.io_statistics``)."""
        return {"pending": len(self._pending), "pending_addresses": len(self._pending_by_ip),
                "counters": dict(self._counters)}
