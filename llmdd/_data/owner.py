"""This engine as the owner of caches that linked peers read and write.

A peer's data plane asks the owner to reserve and consume its ``CacheKey`` entries, to describe its memory pools,
and tells it which of its caches it finished reading or writing (one-way notices, or acknowledged ones
with a transfer's tag).  :class:`OwnerSide` serves all of that for :class:`~llmdd._data.engine.TransferEngine`
(the engine's :class:`~llmdd._protocol.port.DataService`).  Every number a peer sends is checked against this
engine's tables before any work proportional to it (:mod:`llmdd._data.peer_input`); docs/reliability.md lists
what each violation does to the link.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from llmdd._base.config import parse_mem_pool_cfg
from llmdd._base.log import get_logger
from llmdd._base.options import EngineOptions
from llmdd._data.fence import FenceTable
from llmdd._data.peer_input import U64_MAX, PeerInputError, covered, peer_int, peer_key_index, peer_bounds, peer_range, peer_spans
from llmdd._protocol.port import ControlPort, DataNotice, LinkView, RequestOp
from llmdd._protocol import messages as m
from llmdd._base.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from llmdd._memory.manager import CacheRecord, MemoryManager
    from llmdd._base.profiles import ChipProfile

__all__ = ["OwnerSide", "device_pool_bytes", "MAX_NOTES"]

_log = get_logger("llmdd.transfer")
S = LLMStatusCode
#: the most notes one ``peer_note`` request carries
MAX_NOTES = 1024


def device_pool_bytes(options: EngineOptions) -> int:
    """The device memory pool (``llm.MemPoolConfig``) of an engine's options, in bytes (0 without one)."""
    text = options.raw.get("llm.MemPoolConfig") or ""
    return parse_mem_pool_cfg(text)[0] if text else 0


class OwnerSide:
    """The owner-side requests and notices of one engine, and what each linked peer reserved."""

    def __init__(self, *, port: ControlPort, memory: "MemoryManager", options: EngineOptions,
                 profile: "ChipProfile") -> None:
        self._lm = port
        self._memory = memory
        self._options = options
        self._profile = profile
        self._lock = threading.Lock()
        # id(link) -> {key index a peer reserved and still holds: its cache id}
        self._reservations: dict[int, dict[tuple, int]] = {}
        self._refused: set = set()  # (id(link), message type) already logged
        self.fences = FenceTable(memory)   # the generations of its blocks (llmdd._data.fence)
        self._servers = {RequestOp.RESERVE_KEY: self._serve_reserve_key, RequestOp.CONSUME_KEY: self._serve_consume_key,
                         RequestOp.ENGINE_INFO: self._serve_engine_info, RequestOp.FENCE_CHECK: self._serve_fence_check,
                         RequestOp.PEER_NOTE: self._serve_peer_note}
        self._notices: dict[type, tuple[str, Callable[..., tuple[int, dict]]]] = {
            m.ReadDone: ("read_done", self._serve_read_done),
            m.KeyConsumed: ("key_consumed", self._serve_key_consumed),
            m.ReleaseKey: ("release_key", self._serve_release_key),
            m.PushDone: ("push_done", self._serve_push_done)}

    def serve(self, link: LinkView, op: RequestOp, args: dict) -> tuple[int, dict]:
        """A peer's data request: ``(status, result)``; a violating one raises (and may fail the link)."""
        return self._guard(link, args, what=op.value, handler=self._servers[op])

    def serve_tagged(self, link: LinkView, message: m.TaggedDone) -> tuple[int, dict]:
        """A peer's tagged transfer on one of this engine's caches ended (acknowledged by the reply)."""
        what = "push_done" if message.push else "read_done"
        return self._guard(link, message.entry, what=what,
                           handler=functools.partial(self._serve_transfer_done, what=what))

    def on_notice(self, link: LinkView, message: DataNotice) -> None:
        """A one-way notice of the peer's data plane (a refused one is answered with a fatal Error)."""
        what, handler = self._notices[type(message)]
        self._guard(link, message, what=what, handler=handler, notice=True)

    def link_down(self, link: LinkView) -> None:
        """Give back what the link's peer reserved (a puller that is gone never consumes or releases)."""
        with self._lock:
            orphaned = self._reservations.pop(id(link), {})
            self._refused = {k for k in self._refused if k[0] != id(link)}
        for index in orphaned:
            self._memory.finish_reserved(index, None, pulled=False)

    def _serve_engine_info(self, link: LinkView, args: dict) -> tuple[int, dict]:
        return 0, {"device_pool_bytes": device_pool_bytes(self._options), "profile": self._profile.name}

    def _serve_fence_check(self, link: LinkView, args: Any) -> tuple[int, dict]:
        if not isinstance(args, dict):
            raise PeerInputError("fence_check arguments must be a map")
        return self.fences.serve_check(link, args, self._served_record(link, args.get("cache_id"), "fence_check"))

    def _serve_peer_note(self, link: LinkView, args: Any) -> tuple[int, dict]:
        """A peer's notes about one of this engine's caches (``peer_note`` cache event, one per request):
        at most MAX_NOTES texts or byte strings of at most MAX_TAG_BYTES bytes each."""
        if not isinstance(args, dict):
            raise PeerInputError("peer_note arguments must be a map")
        notes = args.get("notes")
        if not isinstance(notes, (list, tuple)) or not 0 < len(notes) <= MAX_NOTES:
            raise PeerInputError(f"peer_note notes must be a list of 1 to {MAX_NOTES} notes")
        for note in notes:
            size = len(note.encode("utf-8", "surrogatepass")) if isinstance(note, str) else (
                len(note) if isinstance(note, bytes) else -1)
            if not 0 <= size <= m.MAX_TAG_BYTES:
                raise PeerInputError(f"a peer_note note must be text or bytes of at most {m.MAX_TAG_BYTES} bytes")
        rec = self._served_record(link, args.get("cache_id"), "peer_note")
        if rec is None:
            return S.LLM_KV_CACHE_NOT_EXIST.value, {"error": "the cache was released"}
        self._cache_event(rec, "peer_note", peer=link.peer_cluster_id, notes=list(notes))
        return 0, {}

    # ------------------------------------------------------------------ the handlers
    def _refuse_peer(self, link: LinkView, what: str, exc: PeerInputError, *, notice: bool) -> None:
        """Log a violating message once per link and message type; fail the link when it says so.
        A refused *notice* (no reply travels back) is answered with a fatal Error message."""
        key = (id(link), what)
        with self._lock:
            first = key not in self._refused
            if first:
                self._refused.add(key)
        if first:
            _log.warning("llmdd.transfer.peer_input_refused", peer=link.peer_cluster_id, message=what,
                         error=str(exc), fails_link=exc.fail_link)
        if notice or exc.fail_link:
            self._lm.notify(link, m.Error(status_code=exc.status_code.value,
                                          message=f"{what} refused: {exc}", fatal=exc.fail_link))
        if exc.fail_link:
            self._lm.fail_link(link, exc, status=S.LLM_LINK_FAILED)

    def _guard(self, link: LinkView, args: Any, *, what: str, handler: Callable[..., tuple[int, dict]],
               notice: bool = False) -> tuple[int, dict]:
        try:
            return handler(link, args)
        except PeerInputError as exc:
            self._refuse_peer(link, what, exc, notice=notice)
            if notice:
                return exc.status_code.value, {}
            raise

    def _served_record(self, link: LinkView, cache_id: Any, what: str) -> Optional["CacheRecord"]:
        """The live record of a cache id a peer named, if this engine announces it to that peer.
        None when unknown (a benign race: the cache went after the peer read it); a cache the peer
        was never told about is a violation."""
        cache_id = peer_int(cache_id, f"{what} cache_id", 0, 2**63 - 1)
        rec = self._memory.get(cache_id)
        if rec is None:
            return None
        if not (rec.remote_accessible or not self._options.remote_cache_accessible):
            raise PeerInputError(f"{what}: cache {cache_id} is not served to this peer")
        return rec

    def _held(self, link: LinkView, index: tuple) -> Optional[int]:
        """The cache id of ``index`` if this link reserved it and holds it still."""
        with self._lock:
            return self._reservations.get(id(link), {}).get(index)

    def _serve_reserve_key(self, link: LinkView, args: Any) -> tuple[int, dict]:
        index = peer_key_index(args)
        hit = self._memory.reserve_key(index)
        if hit is None:
            return S.LLM_KV_CACHE_NOT_EXIST.value, {}
        with self._lock:
            # recorded only while the link serves its peer: the control plane moves a link to FAILED
            # or CLOSED before it calls link_down (which takes this lock), so a reservation recorded
            # here is given back by it, and one on a link already down is given back at once
            live = link.serves_peer
            if live:
                self._reservations.setdefault(id(link), {})[index] = int(hit[0])
        if not live:
            self._memory.finish_reserved(index, None, pulled=False)
            return (getattr(link, "failure_status", None) or S.LLM_LINK_FAILED).value, {
                "error": "reserve_key refused: the link is down"}
        return 0, {"cache_id": int(hit[0]), "batch_index": int(hit[1])}

    def _end_reservation(self, link: LinkView, index: tuple) -> bool:
        """Forget ``index`` among the link's reservations; False when the link did not hold it."""
        with self._lock:
            held = self._reservations.get(id(link))
            if held is None or index not in held:
                return False
            del held[index]
            if not held:
                del self._reservations[id(link)]
            return True

    def _serve_release_key(self, link: LinkView, msg: m.ReleaseKey) -> tuple[int, dict]:
        index = (msg.id, msg.model_id)
        # a release of a key this link does not hold is benign (a puller that gave up on a reserve
        # the owner never granted) and must never touch another link's reservation
        if self._end_reservation(link, index):
            self._memory.finish_reserved(index, None, pulled=False)
        return 0, {}

    def _consumed(self, link: LinkView, index: tuple, cache_id: Any, spans: Optional[list], what: str) -> None:
        """A pull of ``index`` ended: check it against the link's reservation and the cache's tensors,
        then consume (``spans`` None or empty = every tensor)."""
        held = self._held(link, index)
        if held is None:
            raise PeerInputError(f"{what}: key {index} is not reserved by this peer", fail_link=False)
        if peer_int(cache_id, f"{what} cache_id", 0, 2**63 - 1) != held:
            raise PeerInputError(f"{what}: key {index} was reserved for cache {held}, not {cache_id}")
        rec = self._memory.get(held)
        tensors = None
        if spans and rec is not None:
            ranges = peer_spans(spans, f"{what} tensors", len(rec.addrs))
            tensors = covered(ranges)
        self._end_reservation(link, index)
        self._memory.finish_reserved(index, tensors, pulled=True)

    def _serve_key_consumed(self, link: LinkView, msg: m.KeyConsumed) -> tuple[int, dict]:
        self._consumed(link, (msg.key.id, msg.key.model_id), msg.cache_id, list(msg.tensor_spans), "key_consumed")
        return 0, {}

    def _serve_consume_key(self, link: LinkView, args: Any) -> tuple[int, dict]:
        index = peer_key_index(args)
        tensors = args.get("tensors")
        spans = None
        if tensors is not None:
            pair = peer_range(tensors, "consume_key tensors", U64_MAX)
            # never len(pair): a range past sys.maxsize raises OverflowError (an untyped LLM_FAILED
            # that kept the link); the span is bounded by the cache's tensors in _consumed
            spans = [tensors] if pair.stop > pair.start else None
        self._consumed(link, index, args.get("cache_id"), spans, "consume_key")
        return 0, {}

    def _cache_event(self, rec: "CacheRecord", trigger: str, **info: Any) -> None:
        rec.tracked.offer(trigger, **info)   # a cache released meanwhile absorbs a late notice

    def _block_spans(self, rec: "CacheRecord", spans: Any, what: str) -> list:
        """Block (or batch) spans of a notice, inside the cache's rows."""
        return [[r.start, r.stop] for r in peer_spans(list(spans), what, rec.rows)]

    def _serve_read_done(self, link: LinkView, msg: m.ReadDone) -> tuple[int, dict]:
        checked = []
        for entry in msg.entries:   # validate the whole notice before any event fires
            rec = self._served_record(link, entry.cache_id, "read_done")
            if rec is not None:
                checked.append((rec, peer_bounds(entry.block_bounds, "read_done blocks", rec.rows)))
        for rec, blocks in checked:
            self._cache_event(rec, "peer_read", peer=link.peer_cluster_id, blocks=blocks)
        return 0, {}

    def _serve_push_done(self, link: LinkView, msg: m.PushDone) -> tuple[int, dict]:
        # several untagged pushes' notices in one message (queued by the pusher, in order): the
        # whole batch is validated before any of its events fires
        if not msg.entries:
            raise PeerInputError(f"push_done batch must hold 1 to {m.MAX_NOTICE_BATCH} notices")
        checked = [self._check_transfer_done(link, entry, "push_done") for entry in msg.entries]
        for item in checked:
            if item is not None:
                self._cache_event(item[0], "peer_written", error=item[1], **item[2])
        return 0, {}

    def _serve_transfer_done(self, link: LinkView, entry: m.TransferDone, what: str) -> tuple[int, dict]:
        """A peer's transfer on one of this engine's caches ended (``read_done``: it read, ``push_done``:
        it wrote): one "peer finished reading/writing" event, with the transfer's tag when it has one."""
        checked = self._check_transfer_done(link, entry, what)
        if checked is not None:
            self._cache_event(checked[0], "peer_written" if what == "push_done" else "peer_read", error=checked[1],
                              **checked[2])
        return 0, {}

    def _check_transfer_done(self, link: LinkView, entry: m.TransferDone, what: str) -> Optional[tuple]:
        """A transfer-done notice checked against this engine's tables: ``(record, error, event info)``,
        or None when its cache is gone (a benign race); a violation raises PeerInputError.  The
        message's types and sizes were checked by the codec; its numbers are checked here."""
        tag: Any = entry.tag
        if tag is not None and entry.tag_str:
            try:
                tag = tag.decode("utf-8")
            except UnicodeDecodeError:
                raise PeerInputError(f"{what} tag is not UTF-8 text") from None
        rec = self._served_record(link, entry.cache_id, what)
        if rec is None:
            return None
        blocks = self._block_spans(rec, entry.block_spans, f"{what} blocks")
        info: dict = {"peer": link.peer_cluster_id, "blocks": blocks}
        if entry.tensors is not None:
            r = peer_range(entry.tensors, f"{what} tensors", len(rec.addrs))
            info["tensors"] = [r.start, r.stop]
        elif what == "push_done":
            info["tensors"] = None
        if tag is not None:
            info["tag"] = tag
        error = None
        if entry.failed:
            code = S.LLM_FAILED
            try:
                code = S(entry.status) if entry.status else S.LLM_FAILED
            except ValueError:
                pass
            verb = "push to" if what == "push_done" else "pull from"
            error = LLMException(f"a {verb} this cache by cluster {link.peer_cluster_id} failed"
                                 + ("; these blocks may be partially written" if what == "push_done" else ""),
                                 status_code=code)
        return rec, error, info
