"""The link manager: the link table and each link's protocol (requests, notices, keepalive, unlink).

One :class:`LinkManager` per initialized engine: the control plane's assembly and its entry points.
A link to a peer cluster is a TCP control connection carrying the sans-io protocol of
:mod:`llmdd._control.protocol`, plus a data channel of the transport both sides agreed on.  The
link's state lives in the link lifecycle (``_lifecycle/tables.py``); this module does the per-link
I/O and fires the outcome triggers.  Its parts, each a module of one concept built here with its
typed dependencies:

* :class:`~llmdd._control.table.LinkTable`: the links by peer, aliases, links being made (the lock);
* :class:`~llmdd._control.listener.Listeners`: the listening sockets and the failed ones;
* :class:`~llmdd._control.admission.Admission`: the server side of link setup;
* :class:`~llmdd._control.dialer.Dialer`: the client side of link setup (``link_clusters``);
* :class:`~llmdd._control.announce.Announcements`: this engine's tables, announced to every peer;
* :class:`~llmdd._control.endpoints.TransportEndpoints`: the transports' endpoints and grants.

The two setup sides see the manager as a :class:`~llmdd._control.linking.LinkHost` (it adopts, runs,
fails and closes a link once it exists), so they never import this module.

Threads: the engine's I/O loop (:mod:`llmdd._control.ioloop`) drives listeners, handshakes, every
link's control connection, keepalives and deadlines from one thread; blocking work (transport
plugins, hook subscribers, memory calls) runs on the loop's bounded pool, in order per link
(a :class:`~llmdd._control.ioloop.Strand`), and endpoint registrations and table announcements on one
registrar thread.  The thread count does not grow with links or connections.  All are daemon
threads: they never keep the interpreter alive, and the exit handler's ``finalize`` closes them.

Locks: the link table's lock (``LinkTable._lock``) guards the link, alias and pending tables only;
nothing is called while it is held (no memory manager, region table, plugin, hook, listener or
socket call).  ``ControlConnection._lock`` is a leaf held around non-blocking socket calls.  The
order is written in docs/architecture.md ("Locks").
"""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any, Callable, Optional

from msgspec.structs import replace as msgspec_replace

from llmdd._base.enums import LLMRole
from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions
from llmdd._base.profiles import ChipProfile
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._control.admission import Admission
from llmdd._control.announce import Announcements
from llmdd._control.connection import ControlConnection
from llmdd._control.dialer import Dialer
from llmdd._control.endpoints import Registrar, TransportEndpoints
from llmdd._control.ioloop import IoLoop, PoolFull, Strand
from llmdd._control.link import Link, Pending
from llmdd._control.linking import LINK_DESCRIPTOR_OP
from llmdd._control.listener import Listeners
from llmdd._control.liveness import Liveness, PeerLost
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.codec import ProtocolError
from llmdd._control.protocol.handshake import HandshakeConfig, PeerInfo, new_incarnation
from llmdd._control.settings import MAX_CLUSTERS_PER_CALL, LinkSettings
from llmdd._control.table import LinkTable
from llmdd._data.port import DataService, RequestOp, request_op
from llmdd._extension.manager import Hooks
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import (
    LINK_BUSY, LINK_DOWN, LINK_FAILED, LINK_KEEPS_ALIVE, LINK_SETTING_UP, LINK_UNLINKING, Machine,
)
from llmdd._memory.manager import MemoryManager
from llmdd._seam.abc import Endpoint, TransportError

__all__ = ["LinkManager", "Link", "LinkSettings", "LINK_DESCRIPTOR_OP"]

_log = get_logger("llmdd.link")

S = LLMStatusCode


class LinkManager:
    """Links of one engine, server side and client side."""

    def __init__(self, *, cluster_id: int, role: LLMRole, options: EngineOptions, hooks: Hooks,
                 links: Lifecycle, memory: MemoryManager, profile: ChipProfile,
                 engine: Optional[Tracked] = None, listeners: Optional[Lifecycle] = None) -> None:
        self._options = options
        self._hooks = hooks
        self._lc = links
        self._memory = memory
        self.role = role
        self._data: Optional[DataService] = None   # bound once by the composition root (bind_data_service)
        self.settings = LinkSettings.from_options(options)
        self.cluster_id = cluster_id
        self.incarnation = new_incarnation()
        self.host = m.HostIdentity.local()
        self._table = LinkTable(cluster_id=cluster_id, max_links=profile.max_links)
        self._request_ids = itertools.count(1)
        self._closed = False
        self._io_error: Optional[str] = None
        # endpoint registrations and table announcements, one at a time, in order, with no lock held
        self._registrar = Registrar(f"registrar-{self.cluster_id & 0xffff:x}")
        self.endpoints = TransportEndpoints(
            registry=self._hooks.register_transports(), options=options, settings=self.settings, memory=memory,
            registrar=self._registrar, data_host=self._data_host, on_data_port_failed=self._data_listener_failed)
        self._message_handlers: dict[type, Callable[[Link, Any], None]] = {
            m.RegionsUpdate: self._on_tables,
            m.CacheTableUpdate: self._on_tables,
            m.Keepalive: self._on_keepalive,
            m.KeepaliveAck: self._on_keepalive_ack,
            m.UnlinkRequest: self._on_unlink_request,
            m.UnlinkAck: self._on_reply,
            m.TransferReply: self._on_reply,
            m.TransferRequest: self._on_transfer_request,
            m.ReadDone: self._on_data_notice,
            m.KeyConsumed: self._on_data_notice,
            m.ReleaseKey: self._on_data_notice,
            m.PushDone: self._on_data_notice,
            m.TaggedDone: self._on_tagged_done,
            m.Error: self._on_error,
            m.Refuse: self._on_refuse,
        }
        self.loop = IoLoop(f"{self.cluster_id & 0xffff:x}", workers=self.settings.io_workers)
        self.announcements = Announcements(memory=memory, endpoints=self.endpoints, registrar=self._registrar,
                                           table=self._table)
        self._admission = Admission(host=self, table=self._table, endpoints=self.endpoints, hooks=hooks,
                                    announcements=self.announcements, profile=profile)
        self._dialer = Dialer(host=self, table=self._table, endpoints=self.endpoints,
                              announcements=self.announcements)
        # the engine's listening sockets (control port, comm group ports, failed data ports)
        self.listeners = Listeners(loop=self.loop,
                                   lifecycle=listeners if listeners is not None else Lifecycle(Machine.LISTENER),
                                   engine=engine, admit=self._admission.admit)
        self.loop.on_dead(self._on_loop_dead)
        self.loop.call_later(self.settings.keepalive_s, self._keepalive_tick)
        memory.regions.add_listener(self.endpoints.on_regions_changed)
        memory.add_change_listener(self.announcements.announce_all)
        if options.listen is not None:
            try:
                self.listen(*options.listen)
            except BaseException:
                self.close()
                raise

    @property
    def closed(self) -> bool:
        """``close`` has begun: no new link is accepted."""
        return self._closed

    @property
    def io_error(self) -> Optional[str]:
        """Why the engine's I/O loop stopped, or None while it runs."""
        return self._io_error

    def bind_data_service(self, service: DataService) -> None:
        """The data plane that serves this engine's data requests and notices (once, by the engine)."""
        if self._data is not None:
            raise RuntimeError("a data service is bound already")
        self._data = service

    def set_role(self, role: LLMRole) -> None:
        """The engine's role after ``switch_role`` (offered in later handshakes)."""
        self.role = role

    # ------------------------------------------------------------------ transports and endpoints
    @property
    def registry(self):
        return self.endpoints.registry

    def endpoint(self, name: str) -> Endpoint:
        """The endpoint of transport ``name`` (opened when it is not yet): :class:`TransportEndpoints`."""
        return self.endpoints.endpoint(name)

    def offers(self) -> tuple[m.TransportOffer, ...]:
        """The transports this engine offers in a handshake (:meth:`TransportEndpoints.offers`)."""
        return self.endpoints.offers()

    def _data_host(self) -> str:
        """Where network transports' data endpoints bind: the option, the listen IP, the local IP a
        client named in ``append_local_ip_info``, else loopback (never a wildcard by default)."""
        if self.settings.data_host:
            return self.settings.data_host
        listen_addr = self.listeners.listen_address
        if listen_addr is not None and listen_addr[0] not in ("0.0.0.0", ""):
            return listen_addr[0]
        return self._dialer.client_host or "127.0.0.1"

    def _data_listener_failed(self, name: str, ep: Endpoint, error: str) -> None:
        """An endpoint's data port cannot continue (on the endpoint's thread; never blocks): the
        registrar records it, fails the links over it typed and drops it, so the next link opens a
        fresh endpoint (a new data port)."""
        # finalizing (the endpoint closes with the engine) or no registrar thread to be had: here
        self._registrar.post(self._retire_endpoint, name, ep, error, run_here_if_full=not self._closed)

    def _retire_endpoint(self, name: str, ep: Endpoint, error: str) -> None:
        try:
            desc = ep.describe()
            address = (str(desc.get("host", "?")), desc.get("port", "?"))
        except Exception:  # noqa: BLE001 - recorded without its address
            address = ("?", "?")
        self.endpoints.forget(name, ep)
        self.listeners.data_port_failed(name, address, error)
        err = LLMException(f"the {name} data port of this engine cannot continue: {error}",
                           status_code=S.LLM_LINK_FAILED)
        for link in self.links():
            if link.transport == name:
                self.fail(link, err, trigger="peer_lost")
                link.control.close()
        try:
            ep.close()
        except TransportError:
            pass

    # ------------------------------------------------------------------ listening (Listeners, Admission)
    def listen(self, host: str, port: int) -> tuple[str, int]:
        return self.listeners.listen(host, port)

    @property
    def listen_address(self) -> Optional[tuple[str, int]]:
        return self.listeners.listen_address

    def stop_listening(self) -> None:
        self.listeners.stop_listening()

    def listener_status(self) -> list[dict]:
        """Every listener of the engine, live or failed (``llmdd doctor`` and statistics report it)."""
        return self.listeners.status()

    def open_group_listener(self, host: str, port: int, *, comm_id: int) -> socket.socket:
        """A listener for the members of one comm group (links accepted there carry ``comm_id``)."""
        return self.listeners.open_group_listener(host, port, comm_id=comm_id)

    def close_group_listener(self, sock: socket.socket) -> None:
        self.listeners.close_group_listener(sock)

    def _on_loop_dead(self, exc: BaseException) -> None:
        """The I/O loop cannot continue (on its dying thread): every listener and link fails."""
        self._io_error = f"{type(exc).__name__}: {exc}"
        self.listeners.fail_all(exc)
        for link in self.links():
            err = LLMException(f"the engine's I/O loop stopped: {self._io_error}", status_code=S.LLM_LINK_FAILED)
            self.fail(link, err, trigger="peer_lost")
            link.control.close()

    # ------------------------------------------------------------------ link setup (Admission, Dialer)
    def link_clusters(self, clusters: list, timeout_ms: int) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        return self._dialer.link_clusters(clusters, timeout_ms)

    def link_failures(self) -> dict:
        """remote_cluster_id -> {"status", "error", "at"} of its last failed link_clusters attempt
        (kept until a later attempt succeeds)."""
        return self._table.link_failures()

    def connect_peer(self, host: str, port: int, deadline: float, *, comm_id: Optional[int] = None) -> Link:
        """Client side of one link (:meth:`Dialer.connect_peer`)."""
        return self._dialer.connect_peer(host, port, deadline, comm_id=comm_id)

    def handshake_config(self, role: LLMRole, *, offers: Optional[tuple] = None) -> HandshakeConfig:
        return HandshakeConfig(cluster_id=self.cluster_id, role=role, incarnation=self.incarnation, host=self.host,
                               transports=self.offers() if offers is None else offers, secret=self.settings.secret)

    def submit(self, link: Link, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` on the link's strand (in order with its other tasks)."""
        try:
            link.strand.submit(fn, *args)
        except PoolFull as exc:
            # no worker can be had: do it here rather than lose a link's state change
            _log.warning("llmdd.link.pool_unavailable", peer=link.peer_cluster_id, error=str(exc))
            fn(*args)

    def adopt(self, peer: PeerInfo, conn: ControlConnection, *, is_client: bool, transport: str, reason: str,
              start: bool = True) -> Link:
        """Create the link object for an authenticated peer, replacing a stale one.

        ``start=False`` (server side): the connection stays paused until the caller sends the
        Welcome and resumes it."""
        fsm = self._lc.create(peer.cluster_id, peer=peer.cluster_id)
        link = Link(peer_cluster_id=peer.cluster_id, fsm=fsm, control=conn, peer=peer, is_client=is_client,
                    transport=transport, transport_reason=reason, strand=Strand(self.loop.pool),
                    liveness=Liveness(peer=peer.cluster_id, timeout_s=self.settings.peer_timeout_s,
                                      last_rx=time.monotonic()))
        old = self._table.put(link)
        if old is not None:
            # the peer relinks: it has no entity any more (restart = new incarnation, or a force unlink)
            self.close_link(old, trigger="force_unlink", reason="replaced by a new link from the same cluster")
        fsm.fire("link" if is_client else "accept", transport=transport)
        on_closed = lambda err: self.submit(link, self._on_closed, link, err)  # noqa: E731
        if start:
            conn.attach(lambda msg: self.dispatch(link, msg), on_closed)
        else:
            conn.attach(None, on_closed)
        return link

    def connect_channel(self, link: Link, peer_desc: dict, deadline: float) -> None:
        ep = self.endpoint(link.transport)
        channel = ep.connect(peer_desc, timeout=max(0.1, deadline - time.monotonic()))
        link.channel = channel
        self._sync_remote_regions(link)

    def _sync_remote_regions(self, link: Link) -> None:
        channel = link.channel
        if channel is None:
            return
        name = link.transport
        current = link.tables.regions
        for rid in list(link.remote_regions):
            desc = current.get(rid)
            if desc is None:
                channel.remove_remote_region(rid)
                link.remote_regions.discard(rid)
        for rid, desc in current.items():
            if rid not in link.remote_regions and name in desc.transports:
                channel.add_remote_region(rid, desc.size, desc.transports[name])
                link.remote_regions.add(rid)

    # ------------------------------------------------------------------ lookups for the data plane
    def get(self, cluster_id: int) -> Optional[Link]:
        return self._table.get(cluster_id)

    def require(self, cluster_id: int) -> Link:
        """The LINKED link to ``cluster_id``, or the contract's error."""
        link = self.get(cluster_id)
        if link is None:
            raise LLMException(f"cluster {cluster_id} is not linked", status_code=S.LLM_NOT_YET_LINK)
        if link.fsm.in_(LINK_FAILED):
            raise LLMException(f"link to cluster {cluster_id} has failed ({link.last_error}); unlink and relink it",
                               status_code=link.failure_status or S.LLM_LINK_FAILED)
        if not link.linked:
            raise LLMException(f"link to cluster {cluster_id} is {link.state.value}",
                               status_code=S.LLM_PROCESSING_LINK if link.fsm.in_(
                                   LINK_BUSY) else S.LLM_NOT_YET_LINK)
        return link

    def links(self) -> list[Link]:
        return self._table.links()

    def has_links(self) -> bool:
        return self._table.has_links()

    def request(self, link: Link, op: RequestOp, args: dict, *, deadline: float) -> tuple[int, dict]:
        """Send a data-plane request (a TransferRequest) and wait for its reply until ``deadline``."""
        return self._exchange(link, op.value, lambda rid: m.TransferRequest(request_id=rid, op=op.value, args=args),
                              deadline)

    def ask(self, link: Link, message: m.TaggedDone, *, deadline: float) -> tuple[int, dict]:
        """Send an acknowledged notice (its request id is this side's) and wait for the reply."""
        return self._exchange(link, message.op, lambda rid: msgspec_replace(message, request_id=rid), deadline)

    def _exchange(self, link: Link, op: str, build: Callable[[int], Any], deadline: float) -> tuple[int, dict]:
        rid = next(self._request_ids)
        pending = Pending()
        link.pending[rid] = pending
        try:
            # registered first, then checked: a failure either releases this waiter or is seen here
            # (a request on a link that already failed must not wait out its deadline)
            if link.fsm.in_(LINK_DOWN):
                raise LLMException(f"link to {link.peer_cluster_id} is {link.state.value}",
                                   status_code=link.failure_status or S.LLM_LINK_FAILED)
            link.control.send(build(rid))
            if not pending.event.wait(max(0.0, deadline - time.monotonic())):
                raise LLMException(f"peer {link.peer_cluster_id} did not answer {op!r} in time",
                                   status_code=S.LLM_TIMEOUT)
            reply = pending.reply
            if reply is None:
                raise LLMException(f"link to {link.peer_cluster_id} went down during {op!r}",
                                   status_code=S.LLM_LINK_FAILED)
            return reply.status_code, dict(reply.result)
        except ProtocolError as exc:
            # the connection is gone: the link is FAILED by the time the caller hears it
            self.fail(link, LLMException(f"control connection lost: {exc}", status_code=S.LLM_LINK_FAILED),
                       trigger="peer_lost")
            raise LLMException(f"link to {link.peer_cluster_id} failed: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None
        finally:
            link.pending.pop(rid, None)

    def notify(self, link: Link, msg: Any) -> None:
        """Best-effort one-way message (ReadDone, KeyConsumed...)."""
        try:
            link.control.send(msg)
        except ProtocolError as exc:
            _log.debug("llmdd.link.notify_failed", peer=link.peer_cluster_id, error=str(exc))

    # ------------------------------------------------------------------ message dispatch
    #: cheap messages handled on the loop thread when the link's strand has nothing queued (in order)
    _INLINE = frozenset({m.Keepalive, m.KeepaliveAck, m.TransferReply, m.UnlinkAck})

    def dispatch(self, link: Link, msg: Any) -> None:
        """A message arrived (loop thread): cheap ones now, the rest on the link's strand, in order."""
        if self._hooks.drops_control_message(link.peer_cluster_id, msg):
            return  # a plugin (fault injection) dropped it: as if the network lost it
        link.liveness.received(time.monotonic())
        if type(msg) in self._INLINE and link.strand.idle():
            self._handle(link, msg)
        else:
            self.submit(link, self._handle_on_strand, link, msg)

    def _handle(self, link: Link, msg: Any) -> None:
        handler = self._message_handlers.get(type(msg))
        if handler is None:
            _log.warning("llmdd.link.unexpected_message", peer=link.peer_cluster_id, type=type(msg).__name__)
            return
        handler(link, msg)

    def _handle_on_strand(self, link: Link, msg: Any) -> None:
        try:
            self._handle(link, msg)
        except (OSError, ProtocolError, ValueError) as exc:   # e.g. a table update that does not apply
            self._on_closed(link, exc)   # fails the link and tells the peer (a fatal Error) first
            link.control.close()
        except Exception as exc:  # a handler bug must not kill the link silently
            _log.error("llmdd.link.handler_failed", peer=link.peer_cluster_id, error=repr(exc))
            self._on_closed(link, exc)
            link.control.close()

    def _on_tables(self, link: Link, msg: Any) -> None:
        link.tables.apply(msg)  # raises TableUpdateError (a ProtocolError): the link fails
        if isinstance(msg, m.CacheTableUpdate) and link.tables.regions_version > 0:
            first = not link.tables_ready.is_set()
            link.tables_ready.set()
            if first and link.session is not None:
                self._admission.server_finish(link)   # server side: the peer's tables were the last thing missing
                return
        if link.channel is not None and isinstance(msg, m.RegionsUpdate):
            self._sync_remote_regions(link)
        if link.linked and isinstance(msg, m.RegionsUpdate):
            link.fsm.fire("regions_updated", version=msg.version)

    def _on_keepalive(self, link: Link, msg: m.Keepalive) -> None:
        self.notify(link, m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns,
                                         sent_at_ns=time.monotonic_ns()))

    def _on_keepalive_ack(self, link: Link, msg: m.KeepaliveAck) -> None:
        link.liveness.acked(time.monotonic_ns(), msg.echo_sent_at_ns)

    def _on_reply(self, link: Link, msg: Any) -> None:
        pending = link.pending.get(msg.request_id)
        if pending is not None:
            pending.reply = msg
            pending.event.set()

    def _on_unlink_request(self, link: Link, msg: m.UnlinkRequest) -> None:
        self.notify(link, m.UnlinkAck(request_id=msg.request_id, status_code=0))
        self.close_link(link, trigger="peer_unlinked", reason=msg.reason or "peer unlinked")

    def _on_transfer_request(self, link: Link, msg: m.TransferRequest) -> None:
        if msg.op == LINK_DESCRIPTOR_OP:   # the control plane's own request (deferred transport offers)
            self._reply(link, msg.request_id, msg.op, self._admission.serve_link_descriptor, link, dict(msg.args))
            return
        op = request_op(msg.op)
        if op is None or self._data is None:
            self.notify(link, m.TransferReply(request_id=msg.request_id, status_code=S.LLM_PARAM_INVALID.value,
                                              result={"error": f"unknown op {msg.op!r}"}))
            return
        self._reply(link, msg.request_id, msg.op, self._data.serve, link, op, dict(msg.args))

    def _on_tagged_done(self, link: Link, msg: m.TaggedDone) -> None:
        if self._data is not None:
            self._reply(link, msg.request_id, "tagged_done", self._data.serve_tagged, link, msg)

    def _reply(self, link: Link, request_id: int, op: str, serve: Callable[..., tuple[int, dict]],
               *args: Any) -> None:
        """Run a request's server and send its TransferReply (an exception answers its status)."""
        try:
            status, result = serve(*args)
        except LLMException as exc:
            status, result = exc.status_code.value, {"error": str(exc)}
        except Exception as exc:
            _log.error("llmdd.link.request_failed", op=op, error=repr(exc))
            status, result = S.LLM_FAILED.value, {"error": repr(exc)}
        self.notify(link, m.TransferReply(request_id=request_id, status_code=status, result=result))

    def _on_data_notice(self, link: Link, msg: Any) -> None:
        if self._data is not None:
            self._data.on_notice(link, msg)

    def _on_refuse(self, link: Link, msg: m.Refuse) -> None:
        """The client refused our Welcome (e.g. it requires a secret this side does not use)."""
        _log.warning("llmdd.link.refused_by_peer", peer=link.peer_cluster_id, reason=msg.reason)
        if link.fsm.in_(LINK_SETTING_UP):
            if link.session is not None:
                self._admission.abort_setup(link, ProtocolError(f"the peer refused the link: {msg.reason}"))
            else:
                self.fail(link, ProtocolError(f"the peer refused the link: {msg.reason}"), trigger="handshake_failed")

    def _on_error(self, link: Link, msg: m.Error) -> None:
        _log.warning("llmdd.link.peer_error", peer=link.peer_cluster_id, code=msg.status_code, message=msg.message)
        if msg.fatal:
            self.fail(link, LLMException(msg.message, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    def _on_closed(self, link: Link, error: BaseException | None) -> None:
        if link.fsm.is_final:
            return
        reason = f"control connection lost: {error}" if error else "peer closed the control connection"
        if link.session is not None and link.fsm.in_(LINK_SETTING_UP):
            # a server-side link still in its setup leaves nothing behind
            self._admission.abort_setup(link, ProtocolError(f"the peer went away during the link setup ({reason})"))
            return
        if link.fsm.in_(LINK_UNLINKING):
            # the peer acknowledged our unlink and closed: the unlink in progress ends the link
            for pending in list(link.pending.values()):
                pending.event.set()
            return
        self.fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")
        if isinstance(error, ProtocolError):
            # the peer sent something this side refuses (a bad frame, an invalid table update): tell it
            # the link is dead at once, instead of letting it find out from its liveness timeout
            self.notify(link, m.Error(status_code=S.LLM_LINK_FAILED.value, message=f"link failed: {error}",
                                      fatal=True))

    # ------------------------------------------------------------------ failure and teardown
    def fail_link(self, link: Link, error: BaseException, *, status: LLMStatusCode = S.LLM_LINK_FAILED) -> None:
        """The link can no longer be trusted (its data channel broke, its peer sent out-of-table
        numbers): FAILED, its waiters released and its transfers cancelled; a link already down
        stays as it is."""
        self.fail(link, error, trigger="peer_lost", status=status)

    def record_transfer(self, link: Link, *, read: int = 0, written: int = 0, failed: bool = False) -> None:
        """Count one transfer on the link's statistics: bytes read or written, or a failure."""
        if failed:
            link.failures += 1
            return
        link.bytes_read += read
        link.bytes_written += written
        link.transfers += 1

    def fail(self, link: Link, error: BaseException, *, trigger: str,
             status: LLMStatusCode = S.LLM_LINK_FAILED) -> None:
        """Move a link to FAILED, release waiters, cancel its transfers (no lock held).  A link that
        is down already (or not set up) absorbs the trigger (``ABSORBED``) and stays as it is."""

        def record() -> None:   # visible no later than FAILED (the data plane reads failure_status)
            link.last_error = str(error)
            link.failure_status = status

        if not link.fsm.offer(trigger, error=error, reason=str(error), on_accept=record):
            return
        # the capability dies with the link: the peer's data connections to us are closed now
        self.endpoints.revoke(link.transport, link.grant_id)
        for pending in list(link.pending.values()):
            pending.event.set()
        link.tables_ready.set()
        link.settled.set()
        if self._data is not None:
            self._data.on_link_down(link)

    def transfer_timed_out(self, link: Link, error: BaseException) -> None:
        """A transfer exceeded ``sync_kv_timeout``: the link is unusable until relinked (contract)."""
        self.fail(link, error, trigger="transfer_timed_out", status=S.LLM_TIMEOUT)

    def close_link(self, link: Link, *, trigger: str, reason: str) -> None:
        self._table.remove(link)
        # a link always ends CLOSED: when the wanted trigger no longer applies (the state moved
        # meanwhile, e.g. FAILED), the teardown is a force unlink; a closed link absorbs both
        link.fsm.offer_first((trigger, "force_unlink"), reason=reason)
        sess = link.session
        if sess is not None:
            sess.done = True
            sess.timer.cancel()
        for pending in list(link.pending.values()):
            pending.event.set()
        link.tables_ready.set()
        link.settled.set()
        if self._data is not None:
            self._data.on_link_down(link)
        self.endpoints.revoke(link.transport, link.grant_id)
        channel, link.channel = link.channel, None
        if channel is not None:
            try:
                channel.close()
            except TransportError:
                pass
        link.control.close()

    def unlink_clusters(self, clusters: list, timeout_ms: int, force: bool) -> tuple[LLMStatusCode, list]:
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            return S.LLM_CLUSTER_NUM_EXCEED_LIMIT, [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters)
        deadline = time.monotonic() + timeout_ms / 1000.0
        codes = []
        for cluster in clusters:
            try:
                codes.append(self.unlink_one(cluster.remote_cluster_id, deadline, force=force))
            except Exception as exc:  # never raise out of unlink_clusters
                _log.warning("llmdd.link.unlink_failed", remote=cluster.remote_cluster_id, error=repr(exc))
                codes.append(S.LLM_UNLINK_FAILED)
        overall = S.LLM_SUCCESS
        for code in codes:
            if code is not S.LLM_SUCCESS:
                overall = code
        return overall, codes

    def unlink_one(self, cluster_id: int, deadline: float, *, force: bool) -> LLMStatusCode:
        link = self.get(cluster_id)
        if link is None:
            return S.LLM_SUCCESS if force else S.LLM_NOT_YET_LINK
        if force:
            self.close_link(link, trigger="force_unlink", reason="force unlink")
            return S.LLM_SUCCESS
        if link.fsm.in_(LINK_BUSY):
            return S.LLM_PROCESSING_LINK
        if link.fsm.in_(LINK_FAILED):
            # the peer cannot be told: tear down here; the other side must unlink too
            self.close_link(link, trigger="force_unlink", reason="unlink of a failed link")
            return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        if self._data is not None and not self._data.quiesce(link):
            return S.LLM_LINK_BUSY
        link.fsm.fire("unlink")   # no lock held: the data plane starts no transfer on a quiesced link
        rid = next(self._request_ids)
        pending = Pending()
        link.pending[rid] = pending
        try:
            link.control.send(m.UnlinkRequest(request_id=rid, force=False, reason="unlink_clusters"))
            acked = pending.event.wait(max(0.0, deadline - time.monotonic())) and pending.reply is not None
        except ProtocolError:
            acked = False
        if acked:
            self.close_link(link, trigger="unlink_succeeded", reason="unlinked")
            return S.LLM_SUCCESS
        self.close_link(link, trigger="force_unlink", reason="peer did not acknowledge the unlink")
        return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED

    # ------------------------------------------------------------------ liveness
    def _keepalive_tick(self) -> None:
        """Every ``keepalive_s`` on the loop thread: silent peers fail, live ones get a keepalive."""
        if self._closed:
            return
        now = time.monotonic()
        for link in self.links():
            if not link.fsm.in_(LINK_KEEPS_ALIVE):
                continue
            action = link.liveness.tick(now, link.control.stalled_since)
            if isinstance(action, PeerLost):
                self.submit(link, self._check_liveness, link)   # failing a link is blocking work
                continue
            self.notify(link, m.Keepalive(seq=action.seq, sent_at_ns=time.monotonic_ns()))
        self.loop.call_later(self.settings.keepalive_s, self._keepalive_tick)

    def _check_liveness(self, link: Link) -> None:
        """On the link's strand: still lost now (a message may have arrived meanwhile)? Fail it."""
        reason = link.liveness.lost(time.monotonic(), link.control.stalled_since)
        if reason is not None:
            self.fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Finalize: stop listening, tear every link down silently, close endpoints and the loop."""
        if self._closed:
            return
        self._closed = True
        self.listeners.close()
        for link in self.links():
            self.close_link(link, trigger="finalize", reason="finalize")
        self._admission.drop_pending()
        try:
            self._memory.regions.remove_listener(self.endpoints.on_regions_changed)
        except (KeyError, ValueError):
            pass
        self._memory.remove_change_listener(self.announcements.announce_all)
        self._registrar.close()
        self.endpoints.close()
        self.loop.close()

    def statistics(self) -> dict:
        out = {}
        for link in self.links():
            out[link.peer_cluster_id] = {
                "state": link.state.value, "transport": link.transport, "transport_reason": link.transport_reason,
                "client": link.is_client, "bytes_read": link.bytes_read, "bytes_written": link.bytes_written,
                "transfers": link.transfers, "failures": link.failures, "last_error": link.last_error,
                "rtt_s": link.rtt_s, "comm_id": link.comm_id,
            }
        return out

    def io_statistics(self) -> dict:
        """The loop's view: listeners, pending handshakes, refusals, threads (``llmdd doctor``, tests)."""
        admission = self._admission.statistics()
        return {"listeners": self.listener_status(), "pending": admission["pending"],
                "pending_addresses": admission["pending_addresses"], "io_error": self._io_error,
                "threads": self.loop.threads() + self._registrar.threads(),
                "watched": self.loop.watched(), **admission["counters"]}
