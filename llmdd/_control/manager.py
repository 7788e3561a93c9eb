"""The link manager: the link table and each link's protocol (requests, notices, keepalive, unlink).

One :class:`LinkManager` per initialized engine: the control plane's assembly and its entry points.
A link to a peer cluster is a TCP control connection carrying the sans-io protocol of
:mod:`llmdd._protocol`, plus a data channel of the transport both sides agreed on.  The
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

Threads: the engine's I/O loop (:mod:`llmdd._runtime.ioloop`) drives listeners, handshakes, every
link's control connection, keepalives and deadlines from one thread; blocking work (transport
plugins, hook subscribers, memory calls) runs on the loop's bounded pool, in order per link
(a :class:`~llmdd._runtime.ioloop.Strand`), and endpoint registrations and table announcements on one
registrar thread.  The thread count does not grow with links or connections.  All are daemon
threads: they never keep the interpreter alive, and the exit handler's ``finalize`` closes them.

Locks: the link table's lock (``LinkTable._lock``) guards the link, alias and pending tables and each
link's holds only; nothing is called while it is held (no memory manager, region table, plugin,
hook, listener or socket call).  ``ControlConnection._lock`` is a leaf held around non-blocking socket calls.  The
order is written in docs/architecture.md ("Locks").
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Optional

from llmdd._base.enums import LLMRole
from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions
from llmdd._base.profiles import ChipProfile
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._control.admission import Admission
from llmdd._control.announce import Announcements
from llmdd._control.connection import ControlConnection
from llmdd._control.dialer import Dialer
from llmdd._control.exchange import LinkExchange, sync_remote_regions
from llmdd._control.endpoints import Registrar, TransportEndpoints
from llmdd._runtime.runtime import PoolFull, Runtime
from llmdd._runtime.ioloop import Strand
from llmdd._control.link import CLUSTERS_HOLD, Link, Pending
from llmdd._control.linking import LINK_DESCRIPTOR_OP
from llmdd._control.listener import Listeners
from llmdd._control.liveness import Liveness, PeerLost
from llmdd._protocol import messages as m
from llmdd._protocol.codec import ProtocolError
from llmdd._protocol.handshake import HandshakeConfig, PeerInfo, new_incarnation
from llmdd._control.settings import MAX_CLUSTERS_PER_CALL, LinkSettings
from llmdd._control.table import LinkTable
from llmdd._protocol.port import DataService, LinkView, RequestOp
from llmdd._extension.manager import Hooks
from llmdd._lifecycle.machines import Lifecycle, Tracked
from llmdd._lifecycle.tables import (
    LINK_BUSY, LINK_FAILED, LINK_KEEPS_ALIVE, LINK_REPORTED, Machine,
)
from llmdd._memory.manager import MemoryManager
from llmdd._seam.abc import Endpoint, EndpointDescriptor, TransportError

__all__ = ["LinkManager", "Link", "LinkSettings", "LINK_DESCRIPTOR_OP"]

_log = get_logger("llmdd.link")

S = LLMStatusCode


def _own(link: LinkView) -> Link:
    """The record behind a link the data plane hands back through its port (one of this manager's)."""
    if type(link) is not Link:
        raise _not_ours(link)
    return link


def _not_ours(link: LinkView) -> TypeError:
    return TypeError(f"not a link of this engine: {link!r}")


class LinkManager:
    """Links of one engine, server side and client side."""

    def __init__(self, *, cluster_id: int, role: Callable[[], LLMRole], options: EngineOptions, hooks: Hooks,
                 links: Lifecycle, memory: MemoryManager, profile: ChipProfile,
                 loop: Runtime, engine: Optional[Tracked] = None, listeners: Optional[Lifecycle] = None) -> None:
        self._options = options
        self.loop = loop   # the engine's I/O loop: its clock, timers, pool, waiters and sockets
        self._hooks = hooks
        self._lc = links
        self._memory = memory
        self._role = role   # the engine's role, read when a handshake offers it (the engine owns it)
        self._data: Optional[DataService] = None   # bound once by the composition root (bind_data_service)
        self.settings = LinkSettings.from_options(options)
        self.cluster_id = cluster_id
        self.incarnation = new_incarnation()
        self.host = m.HostIdentity.local()
        self._table = LinkTable(cluster_id=cluster_id, max_links=profile.max_links, event=loop.event)
        self._closed = False
        self._io_error: Optional[str] = None
        # endpoint registrations and table announcements, one at a time, in order, with no lock held
        self._registrar = Registrar(f"registrar-{self.cluster_id & 0xffff:x}", loop)
        self.endpoints = TransportEndpoints(
            registry=self._hooks.register_transports(), options=options, settings=self.settings, memory=memory,
            registrar=self._registrar, data_host=self._data_host, on_data_port_failed=self._data_listener_failed)
        self.announcements = Announcements(memory=memory, endpoints=self.endpoints, registrar=self._registrar,
                                           table=self._table)
        self.admission = Admission(host=self, table=self._table, endpoints=self.endpoints, hooks=hooks,
                                    announcements=self.announcements, profile=profile)
        self.exchange = LinkExchange(host=self, hooks=hooks, admission=self.admission)
        self.dialer = Dialer(host=self, table=self._table, endpoints=self.endpoints,
                              announcements=self.announcements)
        # the engine's listening sockets (control port, comm group ports, failed data ports)
        self.listeners = Listeners(loop=self.loop,
                                   lifecycle=listeners if listeners is not None else Lifecycle(Machine.LISTENER),
                                   engine=engine, admit=self.admission.admit)
        self.loop.on_dead(self._on_loop_dead)
        self._keepalive = self.loop.call_later(self.settings.keepalive_s, self._keepalive_tick)
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
        self.exchange.bind_data_service(service)

    @property
    def role(self) -> LLMRole:
        """The engine's role now (``switch_role`` changes it on the engine; handshakes offer it)."""
        return self._role()

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
        return self.dialer.client_host or "127.0.0.1"

    def _data_listener_failed(self, name: str, ep: Endpoint, error: str) -> None:
        """An endpoint's data port cannot continue (on the endpoint's thread; never blocks): the
        registrar records it, fails the links over it typed and drops it, so the next link opens a
        fresh endpoint (a new data port)."""
        # finalizing (the endpoint closes with the engine) or no registrar thread to be had: here
        self._registrar.post(self._retire_endpoint, name, ep, error, run_here_if_full=not self._closed)

    def _retire_endpoint(self, name: str, ep: Endpoint, error: str) -> None:
        try:
            address = ep.listen_address() or ("?", "?")
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
        return self.dialer.link_clusters(clusters, timeout_ms)

    def link_failures(self) -> dict:
        """remote_cluster_id -> {"status", "error", "at"} of its last failed link_clusters attempt
        (kept until a later attempt succeeds)."""
        return self._table.link_failures()

    def connect_peer(self, host: str, port: int, deadline: float, *, comm_id: Optional[int] = None) -> Link:
        """Client side of one link (:meth:`Dialer.connect_peer`)."""
        return self.dialer.connect_peer(host, port, deadline, comm_id=comm_id)

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
                    transfer_lock=self.loop.lock(),
                    tables_ready=self.loop.event(), settled=self.loop.event(), created_at=self.loop.monotonic(),
                    liveness=Liveness(peer=peer.cluster_id, timeout_s=self.settings.peer_timeout_s,
                                      last_rx=self.loop.monotonic()))
        old = self._table.put(link)
        if old is not None:
            # the peer relinks: it has no entity any more (restart = new incarnation, or a force unlink)
            self.close_link(old, trigger="force_unlink", reason="replaced by a new link from the same cluster")
        fsm.fire("link" if is_client else "accept", transport=transport)
        on_closed = lambda err: self.submit(link, self.exchange.on_closed, link, err)  # noqa: E731
        if start:
            conn.attach(lambda msg: self.dispatch(link, msg), on_closed)
        else:
            conn.attach(None, on_closed)
        return link

    def connect_channel(self, link: Link, peer_desc: EndpointDescriptor, deadline: float) -> None:
        ep = self.endpoint(link.transport)
        channel = ep.connect(peer_desc, timeout=max(0.1, deadline - self.loop.monotonic()))
        link.channel = channel
        sync_remote_regions(link)

    # ------------------------------------------------------------------ lookups for the data plane
    def get(self, cluster_id: int) -> Optional[Link]:
        return self._table.get(cluster_id)

    def require(self, cluster_id: int) -> Link:
        """The LINKED link to ``cluster_id``, or the contract's error."""
        link = self.get(cluster_id)
        if link is None:
            failed = self._table.link_failures().get(cluster_id)
            why = f" (its last link_clusters failed: {failed['error']})" if failed else ""
            raise LLMException(f"cluster {cluster_id} is not linked{why}", status_code=S.LLM_NOT_YET_LINK)
        if link.released:
            raise LLMException(f"cluster {cluster_id} is not linked (this side unlinked it; the peer still holds "
                               f"its link)", status_code=S.LLM_NOT_YET_LINK)
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

    # ------------------------------------------------------------------ messages (LinkExchange)
    def request(self, link: LinkView, op: RequestOp, args: dict, *, deadline: float) -> tuple[int, dict]:
        """Send a data-plane request (a TransferRequest) and wait for its reply until ``deadline``."""
        return self.exchange.request(_own(link), op, args, deadline=deadline)

    def ask(self, link: LinkView, message: m.TaggedDone, *, deadline: float) -> tuple[int, dict]:
        """Send an acknowledged notice (its request id is this side's) and wait for the reply."""
        return self.exchange.ask(_own(link), message, deadline=deadline)

    def notify(self, link: LinkView, msg: m.Message) -> None:
        """Best-effort one-way message (ReadDone, KeyConsumed...)."""
        self.exchange.notify(_own(link), msg)

    def dispatch(self, link: Link, msg: m.Message) -> None:
        """A message arrived (loop thread): :meth:`LinkExchange.dispatch`."""
        self.exchange.dispatch(link, msg)

    # ------------------------------------------------------------------ failure and teardown
    def fail_link(self, link: LinkView, error: BaseException, *,
                  status: LLMStatusCode = S.LLM_LINK_FAILED) -> None:
        """The link can no longer be trusted (its data channel broke, its peer sent out-of-table
        numbers): FAILED, its waiters released and its transfers cancelled; a link already down
        stays as it is."""
        self.fail(_own(link), error, trigger="peer_lost", status=status)

    def record_transfer(self, link: LinkView, *, read: int = 0, written: int = 0, failed: bool = False) -> None:
        """Count one transfer on the link's statistics: bytes read or written, or a failure."""
        if type(link) is not Link:   # _own inline: once per transfer, on the one-block path's clock
            raise _not_ours(link)
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

    def transfer_timed_out(self, link: LinkView, error: BaseException) -> None:
        """A transfer exceeded ``sync_kv_timeout``: the link is unusable until relinked (contract)."""
        self.fail(_own(link), error, trigger="transfer_timed_out", status=S.LLM_TIMEOUT)

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
        deadline = self.loop.monotonic() + timeout_ms / 1000.0
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

    def unlink_one(self, cluster_id: int, deadline: float, *, force: bool,
                   hold: object = CLUSTERS_HOLD) -> LLMStatusCode:
        """Give back this side's ``hold`` (its ``link_clusters``, or a comm group's id) on the link to
        ``cluster_id``.  Non-force: the link ends when neither side holds it any more: a hold of this
        side that remains keeps it without a message; otherwise the peer is asked, and keeps the link
        when it still holds it (this side has then released it: served, not used here).  Both sides
        unlinking at once each answer the other's request, and both succeed (docs/links.md, "Unlink")."""
        link = self.get(cluster_id)
        if link is None:
            return S.LLM_SUCCESS if force else S.LLM_NOT_YET_LINK
        if force:
            self.close_link(link, trigger="force_unlink", reason="force unlink")
            return S.LLM_SUCCESS
        if link.released:
            return S.LLM_NOT_YET_LINK   # this side unlinked it already; the peer still holds it
        if link.fsm.in_(LINK_BUSY):
            return S.LLM_PROCESSING_LINK
        if link.fsm.in_(LINK_FAILED):
            # the peer cannot be told: tear down here; the other side must unlink too
            self.close_link(link, trigger="force_unlink", reason="unlink of a failed link")
            return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        if self._table.drop_shared_hold(link, hold):
            return S.LLM_SUCCESS        # another hold of this side (a comm group, link_clusters) keeps it
        deliver: list[Callable[[], None]] = []
        holds: list[bool] = []

        def unlink() -> None:   # UNLINKING now; its event once the data plane's locks are released
            holds.append(self._table.begin_unlink(link, hold))
            link.fsm.fire("unlink", defer=deliver.append)

        if self._data is None:
            unlink()
        elif not self._data.quiesce(link, unlink):
            return S.LLM_LINK_BUSY
        for event in deliver:
            event()
        held = holds[0]
        rid = self.exchange.new_request_id()
        pending = Pending(self.loop.event())
        link.pending[rid] = pending
        try:
            # ``force`` in the request: this side never held the link (a server the peer linked to), so
            # its unlink ends the link whatever the peer holds, as before holds existed
            link.control.send(m.UnlinkRequest(request_id=rid, force=not held, reason="unlink_clusters"))
            answered = pending.event.wait(max(0.0, deadline - self.loop.monotonic()))
        except ProtocolError:
            answered = False
        finally:
            link.pending.pop(rid, None)
        reply = pending.reply if answered else None
        outcome = self._table.end_unlink(link, kept=reply is not None and reply.status_code == S.LLM_EXIST_LINK.value)
        if outcome == "kept":   # RELEASED (unlink_kept, fired by the table with the holds it read)
            return S.LLM_SUCCESS
        if outcome == "crossed" or reply is not None:
            self.close_link(link, trigger="unlink_succeeded", reason="unlinked")
            return S.LLM_SUCCESS
        # the peer could not be told: the link failed (the event says why), and is torn down here
        # anyway (the peer finds out by its liveness, or unlinks itself)
        reason = "the peer did not acknowledge the unlink before the deadline"
        self.fail(link, LLMException(reason, status_code=S.LLM_NOTIFY_PROMPT_UNLINK_FAILED), trigger="unlink_failed",
                  status=S.LLM_NOTIFY_PROMPT_UNLINK_FAILED)
        self.close_link(link, trigger="force_unlink", reason=reason)
        return S.LLM_NOTIFY_PROMPT_UNLINK_FAILED

    def hold(self, link: Link, token: object) -> None:
        """``token`` (a comm id) holds ``link`` from now on (comm groups)."""
        self._table.hold(link, token)

    def peer_unlinks(self, link: Link, *, force: bool) -> str:
        """The peer asks to unlink (on the link's strand): :meth:`LinkTable.peer_unlinks`."""
        return self._table.peer_unlinks(link, force=force)

    # ------------------------------------------------------------------ liveness
    def _keepalive_tick(self) -> None:
        """Every ``keepalive_s`` on the loop thread: silent peers fail, live ones get a keepalive."""
        if self._closed:
            return
        now = self.loop.monotonic()
        for link in self.links():
            if not link.fsm.in_(LINK_KEEPS_ALIVE):
                continue
            action = link.liveness.tick(now, link.control.stalled_since)
            if isinstance(action, PeerLost):
                self.submit(link, self._check_liveness, link)   # failing a link is blocking work
                continue
            self.notify(link, m.Keepalive(seq=action.seq, sent_at_ns=self.loop.monotonic_ns()))
        self._keepalive = self.loop.call_later(self.settings.keepalive_s, self._keepalive_tick)

    def _check_liveness(self, link: Link) -> None:
        """On the link's strand: still lost now (a message may have arrived meanwhile)? Fail it."""
        reason = link.liveness.lost(self.loop.monotonic(), link.control.stalled_since)
        if reason is not None:
            self.fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Finalize: stop listening, tear every link down silently, close endpoints and the loop."""
        if self._closed:
            return
        self._closed = True
        self._keepalive.cancel()   # no timer of the engine outlives it
        self.listeners.close()
        for link in self.links():
            self.close_link(link, trigger="finalize", reason="finalize")
        self.admission.drop_pending()
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
                "state": LINK_REPORTED[link.state], "transport": link.transport, "transport_reason": link.transport_reason,
                "client": link.is_client, "bytes_read": link.bytes_read, "bytes_written": link.bytes_written,
                "transfers": link.transfers, "failures": link.failures, "last_error": link.last_error,
                "rtt_s": link.rtt_s, "comm_id": link.comm_id, "released": link.released,
            }
        return out

    def io_statistics(self) -> dict:
        """The loop's view: listeners, pending handshakes, refusals, threads (``llmdd doctor``, tests)."""
        admission = self.admission.statistics()
        return {"listeners": self.listener_status(), "pending": admission["pending"],
                "pending_addresses": admission["pending_addresses"], "io_error": self._io_error,
                "threads": self.loop.threads() + self._registrar.threads(),
                "watched": self.loop.watched(), **admission["counters"]}
