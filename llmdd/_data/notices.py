"""The batched notices a puller or pusher sends the owner of the caches it read or wrote.

A successful untagged pull's "read done" and an untagged push's "push done" are queued per link
as plain tuples, and the flusher thread builds and sends them every ``_READ_DONE_FLUSH_S``, in
queue order: consecutive read-done entries as one ReadDone message, consecutive push notices as
one PushDone message (the owner fires one event per pull or push either way).  A tagged
transfer's own notice is acknowledged and sent by the transfer engine after :meth:`flush_link`,
so the owner sees the untagged ones queued before it first.

Lock: ``OwnerNotices._read_done_lock`` (a condition) guards the queue and the batches being sent; nothing
is sent while it is held.  It is a leaf of the data plane (docs/architecture.md, "Locks").
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from llmdd._base.lazy import np
from llmdd._base.log import get_logger
from llmdd._protocol import messages as m
from llmdd._protocol.port import ControlPort, LinkView
from llmdd._runtime.runtime import Threads

__all__ = ["OwnerNotices", "READ", "PUSH", "block_spans"]

_log = get_logger("llmdd.transfer")

_READ_DONE_FLUSH_S = 0.002


def block_spans(blocks: Any) -> tuple:
    """Block indices as sorted disjoint spans (for the owner's "peer finished reading" event)."""
    if isinstance(blocks, (list, tuple)) and len(blocks) <= 16:
        # a few blocks (the latency path): plain Python beats numpy's fixed per-call costs
        out: list[list[int]] = []
        for b in sorted(set(map(int, blocks))):
            if out and out[-1][1] == b:
                out[-1][1] = b + 1
            else:
                out.append([b, b + 1])
        return tuple(m.Span(start=a, stop=b) for a, b in out)
    arr = np.unique(np.asarray(blocks, dtype=np.int64))
    if not len(arr):
        return ()
    breaks = np.flatnonzero(np.diff(arr) != 1)
    starts = np.concatenate(([arr[0]], arr[breaks + 1]))
    stops = np.concatenate((arr[breaks], [arr[-1]])) + 1
    return tuple(m.Span(start=int(a), stop=int(b)) for a, b in zip(starts, stops))


def _bounds(blocks: Any) -> tuple:
    """Block indices as the flat ``(start, stop, ...)`` bounds of sorted disjoint spans (a ReadDone entry)."""
    if isinstance(blocks, (list, tuple)) and len(blocks) <= 16:
        return tuple(x for s in block_spans(blocks) for x in (s.start, s.stop))
    arr = np.unique(np.asarray(blocks, dtype=np.int64))
    if not len(arr):
        return ()
    breaks = np.flatnonzero(np.diff(arr) != 1)
    out = np.empty(2 * (len(breaks) + 1), dtype=np.int64)
    out[0::2] = np.concatenate(([arr[0]], arr[breaks + 1]))
    out[1::2] = np.concatenate((arr[breaks], [arr[-1]])) + 1
    return tuple(out.tolist())


#: the kinds of queued owner notices, and the most of one kind sent in one message
READ, PUSH = 0, 1
MAX_NOTICE_BATCH = m.MAX_NOTICE_BATCH


def _push_done(cache_id: int, dst_blocks: Optional[Sequence[int]], start: int, stop: int, failed: bool) -> m.TransferDone:
    return m.TransferDone(cache_id=cache_id, block_spans=block_spans(dst_blocks) if dst_blocks else (),
                          tensors=m.Span(start=start, stop=stop), failed=failed)


class OwnerNotices:
    """The queued read-done and push-done notices of one engine, per link, and their flusher."""

    def __init__(self, *, port: ControlPort, timeout_s: float, runtime: Threads) -> None:
        self._lm = port
        self._clock = runtime.monotonic
        self.timeout_s = timeout_s
        self._read_done: dict[int, list] = {}   # id(link) -> [link, queued notice, ...]
        self._sending: dict[int, int] = {}       # id(link) -> batches of its notices the flusher is sending
        # the condition's lock, named so the per-call queue enters it without the
        # Condition's Python-level __enter__/__exit__ (two interpreter calls per small transfer)
        self._read_done_mutex = runtime.rlock()
        self._read_done_lock = runtime.condition(self._read_done_mutex)
        self._closed = False
        self._flusher = runtime.start_worker("llmdd-readdone", self._flush_loop)

    def push_done(self, link: LinkView, cache_id: int, dst_blocks: Optional[Sequence[int]], dst_tensors: range, *,
                  failed: bool) -> None:
        """Queue an untagged push's "push done" notice (best effort, sent by the flusher)."""
        blocks = tuple(dst_blocks) if dst_blocks else None  # a copy: the caller may reuse its list
        self.queue(link, (PUSH, int(cache_id), blocks, dst_tensors.start, dst_tensors.stop, failed))

    def queue(self, link: LinkView, item: tuple) -> None:
        """Queue one notice for ``link``'s owner: ``(READ, cache_id, blocks or None)`` or ``(PUSH, cache_id,
        blocks or None, first tensor, stop tensor, failed)``."""
        with self._read_done_mutex:   # == self._read_done_lock (its lock)
            wake = not self._read_done  # the flusher sleeps only while the queue is empty
            queued = self._read_done.get(id(link))
            if queued is None:
                self._read_done[id(link)] = [link, item]
            else:
                queued.append(item)
            if wake:
                self._read_done_lock.notify()

    def _flush_loop(self) -> None:
        sending = self._sending
        while True:
            with self._read_done_lock:
                while not self._read_done and not self._closed:
                    self._read_done_lock.wait()
                if not self._closed:
                    self._read_done_lock.wait(_READ_DONE_FLUSH_S)
                batches, self._read_done = self._read_done, {}
                closed = self._closed
                for lid in batches:
                    sending[lid] = sending.get(lid, 0) + 1
            try:
                for items in batches.values():
                    self._send_notices_safely(items[0], items[1:])
            finally:
                with self._read_done_lock:
                    for lid in batches:
                        left = sending[lid] - 1
                        if left:
                            sending[lid] = left
                        else:
                            del sending[lid]
                    self._read_done_lock.notify_all()   # flush_link may wait for this batch
            if closed:  # what was queued before close has been sent (best effort): done
                return

    def flush_link(self, link: LinkView) -> None:
        """Send ``link``'s queued notices now, after any batch of them the flusher is sending, so that
        what follows on the link (a tagged transfer's acknowledged notice) reaches the owner after
        them.  Waits at most sync_kv_timeout for the flusher; holds no lock while sending."""
        lid = id(link)
        deadline = self._clock() + self.timeout_s
        with self._read_done_lock:
            items = self._read_done.pop(lid, None)
            while self._sending.get(lid):
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._read_done_lock.wait(left)
        if items is not None:
            self._send_notices_safely(link, items[1:])

    def _send_notices_safely(self, link: LinkView, items: list) -> None:
        try:
            self._send_notices(link, items)
        except Exception as exc:  # noqa: BLE001 - best effort: a notice must not kill the flusher
            _log.warning("llmdd.transfer.notice_failed", peer=link.peer_cluster_id, error=repr(exc))

    def _send_notices(self, link: LinkView, items: list) -> None:
        i, n = 0, len(items)
        while i < n:
            kind = items[i][0]
            j = i
            while j < n and j - i < MAX_NOTICE_BATCH and items[j][0] == kind:
                j += 1
            run = items[i:j]
            if kind == READ:
                self._lm.notify(link, m.ReadDone(entries=tuple(
                    m.ReadDoneEntry(cache_id=cache_id, key=None, block_bounds=_bounds(blocks) if blocks else ())
                    for _, cache_id, blocks in run)))
            else:
                self._lm.notify(link, m.PushDone(entries=tuple(_push_done(*item[1:]) for item in run)))
            i = j

    def forget(self, link: LinkView) -> None:
        """The link is down: its queued notices go with it."""
        with self._read_done_lock:
            self._read_done.pop(id(link), None)

    def close(self) -> None:
        """Send what is queued (best effort) and stop the flusher."""
        with self._read_done_lock:
            self._closed = True
            self._read_done_lock.notify_all()
        self._flusher.join(timeout=2.0)
