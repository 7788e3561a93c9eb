"""Each link's messages once it exists: dispatch in order, their handlers, requests and replies.

:class:`LinkExchange` receives every message of a link's control connection (loop thread): cheap
ones are handled at once when the link's strand is idle, the rest on the strand, in order.  The
handlers apply the peer's tables, answer keepalives, serve the data plane's requests and notices
(through the :class:`~llmdd._protocol.port.DataService` the composition root binds), end a link the peer
unlinks, and fail one whose peer sent an error or closed.  :meth:`LinkExchange.request` sends a
request and waits for its reply until a deadline.  Failing and closing a link is the link manager's
(the :class:`~llmdd._control.linking.LinkHost` given here); a server-side link still in its setup
goes back to :class:`~llmdd._control.admission.Admission`.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Union

from msgspec.structs import replace as msgspec_replace

from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._control.admission import Admission
from llmdd._control.endpoints import peer_region_descriptor
from llmdd._control.link import Link, Pending
from llmdd._control.linking import LINK_DESCRIPTOR_OP, LinkHost
from llmdd._protocol import messages as m
from llmdd._protocol.codec import ProtocolError
from llmdd._protocol.port import DataNotice, DataService, RequestOp, request_op
from llmdd._extension.manager import Hooks
from llmdd._lifecycle.tables import LINK_DOWN, LINK_SETTING_UP, LINK_UNLINKING

__all__ = ["LinkExchange", "sync_remote_regions"]

_log = get_logger("llmdd.link")

S = LLMStatusCode


class LinkExchange:
    """The messages of every live link: dispatch, handlers, requests and their replies."""

    def __init__(self, *, host: LinkHost, hooks: Hooks, admission: Admission) -> None:
        self.host = host
        self._hooks = hooks
        self._admission = admission
        self._data: Optional[DataService] = None   # bound once by the composition root (bind_data_service)
        self._request_ids = itertools.count(1)
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

    def bind_data_service(self, service: DataService) -> None:
        """The data plane that serves the requests and notices of its vocabulary."""
        self._data = service

    def new_request_id(self) -> int:
        """A request id of this engine (unique among the requests waiting on any link)."""
        return next(self._request_ids)

    def request(self, link: Link, op: RequestOp, args: dict, *, deadline: float) -> tuple[int, dict]:
        """Send a data-plane request (a TransferRequest) and wait for its reply until ``deadline``."""
        return self._exchange(link, op.value, lambda rid: m.TransferRequest(request_id=rid, op=op.value, args=args),
                              deadline)

    def ask(self, link: Link, message: m.TaggedDone, *, deadline: float) -> tuple[int, dict]:
        """Send an acknowledged notice (its request id is this side's) and wait for the reply."""
        return self._exchange(link, message.op, lambda rid: msgspec_replace(message, request_id=rid), deadline)

    def _exchange(self, link: Link, op: str, build: Callable[[int], Any], deadline: float) -> tuple[int, dict]:
        rid = self.new_request_id()
        pending = Pending(self.host.loop.event())
        link.pending[rid] = pending
        try:
            # registered first, then checked: a failure either releases this waiter or is seen here
            # (a request on a link that already failed must not wait out its deadline)
            if link.fsm.in_(LINK_DOWN):
                raise LLMException(f"link to {link.peer_cluster_id} is {link.state.value}",
                                   status_code=link.failure_status or S.LLM_LINK_FAILED)
            link.control.send(build(rid))
            if not pending.event.wait(max(0.0, deadline - self.host.loop.monotonic())):
                raise LLMException(f"peer {link.peer_cluster_id} did not answer {op!r} in time",
                                   status_code=S.LLM_TIMEOUT)
            reply = pending.reply
            if reply is None:
                raise LLMException(f"link to {link.peer_cluster_id} went down during {op!r}",
                                   status_code=S.LLM_LINK_FAILED)
            if not isinstance(reply, m.TransferReply):   # the peer answered a request with an unlink's ack
                raise LLMException(f"peer {link.peer_cluster_id} answered {op!r} with {type(reply).__name__}",
                                   status_code=S.LLM_LINK_FAILED)
            return reply.status_code, dict(reply.result)
        except ProtocolError as exc:
            # the connection is gone: the link is FAILED by the time the caller hears it
            self.host.fail(link, LLMException(f"control connection lost: {exc}", status_code=S.LLM_LINK_FAILED),
                           trigger="peer_lost")
            raise LLMException(f"link to {link.peer_cluster_id} failed: {exc}",
                               status_code=S.LLM_LINK_FAILED) from None
        finally:
            link.pending.pop(rid, None)

    def notify(self, link: Link, msg: m.Message) -> None:
        """Best-effort one-way message (ReadDone, KeyConsumed...)."""
        try:
            link.control.send(msg)
        except ProtocolError as exc:
            _log.debug("llmdd.link.notify_failed", peer=link.peer_cluster_id, error=str(exc))

    #: cheap messages handled on the loop thread when the link's strand has nothing queued (in order)
    _INLINE = frozenset({m.Keepalive, m.KeepaliveAck, m.TransferReply, m.UnlinkAck})

    def dispatch(self, link: Link, msg: m.Message) -> None:
        """A message arrived (loop thread): cheap ones now, the rest on the link's strand, in order."""
        if self._hooks.drops_control_message(link.peer_cluster_id, msg):
            return  # a plugin (fault injection) dropped it: as if the network lost it
        link.liveness.received(self.host.loop.monotonic())
        if type(msg) in self._INLINE and link.strand.idle():
            self._handle(link, msg)
        else:
            self.host.submit(link, self._handle_on_strand, link, msg)

    def _handle(self, link: Link, msg: m.Message) -> None:
        handler = self._message_handlers.get(type(msg))
        if handler is None:
            _log.warning("llmdd.link.unexpected_message", peer=link.peer_cluster_id, type=type(msg).__name__)
            return
        handler(link, msg)

    def _handle_on_strand(self, link: Link, msg: m.Message) -> None:
        try:
            self._handle(link, msg)
        except (OSError, ProtocolError, ValueError) as exc:   # e.g. a table update that does not apply
            self.on_closed(link, exc)   # fails the link and tells the peer (a fatal Error) first
            link.control.close()
        except Exception as exc:  # a handler bug must not kill the link silently
            _log.error("llmdd.link.handler_failed", peer=link.peer_cluster_id, error=repr(exc))
            self.on_closed(link, exc)
            link.control.close()

    def _on_tables(self, link: Link, msg: Union[m.RegionsUpdate, m.CacheTableUpdate]) -> None:
        link.tables.apply(msg)  # raises TableUpdateError (a ProtocolError): the link fails
        if isinstance(msg, m.CacheTableUpdate) and link.tables.regions_version > 0:
            first = not link.tables_ready.is_set()
            link.tables_ready.set()
            if first and link.session is not None:
                self._admission.server_finish(link)   # server side: the peer's tables were the last thing missing
                return
        if link.channel is not None and isinstance(msg, m.RegionsUpdate):
            sync_remote_regions(link)
        if link.linked and isinstance(msg, m.RegionsUpdate):
            link.fsm.fire("regions_updated", version=msg.version)

    def _on_keepalive(self, link: Link, msg: m.Keepalive) -> None:
        self.notify(link, m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns,
                                         sent_at_ns=self.host.loop.monotonic_ns()))

    def _on_keepalive_ack(self, link: Link, msg: m.KeepaliveAck) -> None:
        link.liveness.acked(self.host.loop.monotonic_ns(), msg.echo_sent_at_ns)

    def _on_reply(self, link: Link, msg: Union[m.UnlinkAck, m.TransferReply]) -> None:
        pending = link.pending.get(msg.request_id)
        if pending is not None:
            pending.reply = msg
            pending.event.set()

    def _on_unlink_request(self, link: Link, msg: m.UnlinkRequest) -> None:
        decision = self.host.peer_unlinks(link, force=msg.force)
        if decision == "kept":
            # this side still holds the link: only the peer's hold went, the link stays up for this side
            self.notify(link, m.UnlinkAck(request_id=msg.request_id, status_code=S.LLM_EXIST_LINK.value))
            return
        self.notify(link, m.UnlinkAck(request_id=msg.request_id, status_code=0))
        if decision == "close":
            self.host.close_link(link, trigger="peer_unlinked", reason=msg.reason or "peer unlinked")
        # "crossed": this side's own unlink, waiting for the peer's answer, ends the link

    def _fenced(self, link: Link, request_id: Optional[int], what: str) -> bool:
        """A request or notice on a link that does not serve its peer (FAILED, closed, not yet
        accepted) is neither served nor recorded; a request is answered with the link's status."""
        if link.serves_peer:
            return False
        _log.debug("llmdd.link.fenced", peer=link.peer_cluster_id, what=what, state=link.state.value)
        if request_id is not None:
            status = link.failure_status or (S.LLM_LINK_FAILED if link.fsm.in_(LINK_DOWN) else S.LLM_NOT_YET_LINK)
            self.notify(link, m.TransferReply(request_id=request_id, status_code=status.value,
                                              result={"error": f"{what} refused: the link is {link.state.value}"}))
        return True

    def _on_transfer_request(self, link: Link, msg: m.TransferRequest) -> None:
        if msg.op == LINK_DESCRIPTOR_OP:   # the control plane's own request (deferred transport offers)
            self._reply(link, msg.request_id, msg.op, self._admission.serve_link_descriptor, link, dict(msg.args))
            return
        if self._fenced(link, msg.request_id, str(msg.op)[:64]):
            return
        op = request_op(msg.op)
        if op is None or self._data is None:
            self.notify(link, m.TransferReply(request_id=msg.request_id, status_code=S.LLM_PARAM_INVALID.value,
                                              result={"error": f"unknown op {msg.op!r}"}))
            return
        self._reply(link, msg.request_id, msg.op, self._data.serve, link, op, dict(msg.args))

    def _on_tagged_done(self, link: Link, msg: m.TaggedDone) -> None:
        if self._data is not None and not self._fenced(link, msg.request_id, "tagged_done"):
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

    def _on_data_notice(self, link: Link, msg: DataNotice) -> None:
        if self._data is not None and not self._fenced(link, None, type(msg).__name__):
            self._data.on_notice(link, msg)

    def _on_refuse(self, link: Link, msg: m.Refuse) -> None:
        """The client refused our Welcome (e.g. it requires a secret this side does not use)."""
        _log.warning("llmdd.link.refused_by_peer", peer=link.peer_cluster_id, reason=msg.reason)
        if link.fsm.in_(LINK_SETTING_UP):
            if link.session is not None:
                self._admission.abort_setup(link, ProtocolError(f"the peer refused the link: {msg.reason}"))
            else:
                self.host.fail(link, ProtocolError(f"the peer refused the link: {msg.reason}"), trigger="handshake_failed")

    def _on_error(self, link: Link, msg: m.Error) -> None:
        _log.warning("llmdd.link.peer_error", peer=link.peer_cluster_id, code=msg.status_code, message=msg.message)
        if msg.fatal:
            self.host.fail(link, LLMException(msg.message, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")

    def on_closed(self, link: Link, error: BaseException | None) -> None:
        if link.fsm.is_final:
            return
        reason = f"control connection lost: {error}" if error else "peer closed the control connection"
        if link.session is not None and link.fsm.in_(LINK_SETTING_UP):
            # a server-side link still in its setup leaves nothing behind
            self._admission.abort_setup(link, ProtocolError(f"the peer went away during the link setup ({reason})"))
            return
        if link.fsm.in_(LINK_UNLINKING):
            # the peer acknowledged our unlink (or unlinked at the same moment) and closed: the unlink
            # in progress ends the link
            for pending in list(link.pending.values()):
                pending.event.set()
            return
        self.host.fail(link, LLMException(reason, status_code=S.LLM_LINK_FAILED), trigger="peer_lost")
        if isinstance(error, ProtocolError):
            # the peer sent something this side refuses (a bad frame, an invalid table update): tell it
            # the link is dead at once, instead of letting it find out from its liveness timeout
            self.notify(link, m.Error(status_code=S.LLM_LINK_FAILED.value, message=f"link failed: {error}",
                                      fatal=True))


def sync_remote_regions(link: Link) -> None:
    """Make the link's data channel know the peer's regions its tables now name (on its strand)."""
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
        if rid not in link.remote_regions:
            rdesc = peer_region_descriptor(desc, name)
            if rdesc is None:    # the owner registered it without this transport
                continue
            channel.add_remote_region(rid, desc.size, rdesc)
            link.remote_regions.add(rid)

