"""Leases on handed-over blocks, the decoder's renewals and abort notices, and the fences that make a
late read fail (docs/vllm.md, "Leases and fencing").

Prefill side (:class:`Leases`, one per worker rank): a finished request's blocks are held under a
lease of ``lease_s`` seconds from the step that handed them over.  They go back to vLLM (the rank
reports ``finished_sending``) at the first of: every decode rank that reads from this rank had its
read acknowledged (the read's tag), a decode rank sent an ``abort`` note for the request, or the
lease expired (no renewal within ``lease_s``).  Before they go back the rank *fences* them
(``cache_manager.fence_blocks``: their llmdd generations go up), so that any pull still expecting
the old generations fails its check (``LLM_KV_CACHE_NOT_EXIST``) instead of reporting bytes of the
blocks' next user.

Decode side (:class:`Renewer`, one thread per worker rank): while a request's pull is queued or
running it sends ``renew`` notes to the prefill ranks of the request every third of their lease;
when vLLM aborts the request, an ``abort`` note at once.  Notes ride llmdd's own link
(``cache_manager.notify_owner``: one acknowledged request carrying up to 1024 notes, authenticated
and bounded like every message of the link) and reach the prefill rank as a ``peer_note`` event of
its KV cache.  A note is ``"renew:<request id>"`` or ``"abort:<request id>"`` (the prefill's request id).

Generations travel in ``kv_transfer_params["llmdd_fence"]``: the epoch of each prefill rank's
registration and the generation of each block at the request's finish.  The scheduler keeps them
(:class:`Generations`): every block's generation is the number of times a handed-over request
holding it was given back, which is exactly how often each rank fenced it (every rank fences a
request's blocks once, when it reports ``finished_sending``; vLLM frees them when all ranks did).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Optional

__all__ = ["RENEW", "ABORT", "MAX_LEASE_S", "MAX_NOTES", "Leases", "Renewer", "Generations", "note", "parse_note",
           "units_of"]

_log = logging.getLogger("vllm.llmdd_vllm")

RENEW, ABORT = "renew", "abort"
#: the longest lease a prefill instance may announce (kv_transfer_params are bounded by the decoder)
MAX_LEASE_S = 3600.0
#: notes per notify_owner request (llmdd's bound)
MAX_NOTES = 1024
#: after a renewal that was not delivered (the pull's link is not up yet, or broke), the next round
#: comes this soon instead of a third of the lease later
RETRY_S = 1.0


def note(kind: str, request_id: str) -> str:
    return f"{kind}:{request_id}"


def parse_note(text: object) -> Optional[tuple]:
    """``(kind, request id)`` of a note, or None for anything else (a foreign or malformed note)."""
    if not isinstance(text, str):
        return None
    kind, sep, rid = text.partition(":")
    return (kind, rid) if sep and kind in (RENEW, ABORT) and rid else None


def units_of(blocks: Iterable[int], local_heads: int) -> list:
    """The llmdd units (one head of one block) of vLLM blocks ``blocks`` on a rank holding ``local_heads``."""
    return [b * local_heads + j for b in blocks for j in range(local_heads)]


class Generations:
    """Scheduler side of a prefill instance: the fence generation of each block, as every rank counts it."""

    def __init__(self) -> None:
        self.gens: dict = {}        # block id -> times given back after a handover
        self.held: dict = {}        # request id -> its handed-over blocks

    def handed_over(self, req_id: str, blocks: list) -> list:
        """The request's blocks are held for a decoder: their generations now (for kv_transfer_params)."""
        self.held[req_id] = list(blocks)
        return [self.gens.get(b, 0) for b in blocks]

    def given_back(self, req_ids: Iterable[str]) -> None:
        """vLLM reports these requests' ``finished_sending``: every rank fenced their blocks once."""
        for req_id in req_ids:
            for b in self.held.pop(req_id, ()):
                self.gens[b] = self.gens.get(b, 0) + 1


class _Held:
    __slots__ = ("blocks", "lease_s", "deadline", "aborted")

    def __init__(self, blocks: list, lease_s: float, now: float) -> None:
        self.blocks, self.lease_s, self.deadline, self.aborted = blocks, lease_s, now + lease_s, False


class Leases:
    """Prefill worker rank: the requests whose blocks it holds for a decoder, and why each goes back."""

    def __init__(self) -> None:
        self.held: dict = {}        # request id -> _Held

    def hold(self, req_id: str, blocks: list, lease_s: float, now: float) -> None:
        self.held[req_id] = _Held(list(blocks), float(lease_s), now)

    def on_notes(self, notes: Iterable, now: float) -> None:
        """A decoder's notes: renew extends a held request's lease from now, abort gives it back."""
        for text in notes:
            parsed = parse_note(text)
            if parsed is None:
                continue
            kind, rid = parsed
            h = self.held.get(rid)
            if h is None:
                continue            # given back already, or not ours (a stale or foreign note)
            if kind == RENEW:
                h.deadline = max(h.deadline, now + h.lease_s)
            else:
                h.aborted = True

    def due(self, read: Callable[[str], bool], now: float) -> list:
        """``(request id, blocks, why)`` of every held request to give back now (``why``: "tag" when
        ``read(req_id)`` says its readers were acknowledged, "abort", "lease"); they are forgotten."""
        out = []
        for rid, h in list(self.held.items()):
            if read(rid):
                why = "tag"
            elif h.aborted:
                why = "abort"
            elif now >= h.deadline:
                why = "lease"
            else:
                continue
            del self.held[rid]
            out.append((rid, h.blocks, why))
        return out


class _Pulling:
    __slots__ = ("remote_id", "clusters", "lease_s")

    def __init__(self, remote_id: str, clusters: list, lease_s: float) -> None:
        self.remote_id, self.clusters, self.lease_s = remote_id, clusters, lease_s


class _Outbox:
    """The notes waiting for one prefill rank, and whether its sender thread is sending."""

    __slots__ = ("aborts", "renews", "thread")

    def __init__(self) -> None:
        self.aborts: list = []          # remote request ids, in order
        self.renews: dict = {}          # remote request ids (a dict: ordered, each once)
        self.thread: Optional[threading.Thread] = None


class Renewer:
    """Decode worker rank: renews the leases of the requests whose pulls are queued or running, and
    sends abort notes.  One thread decides what to send (an abort at once; a new pull's first renewal
    at once, since its lease has run since the prefill finished; then every pull every third of the
    shortest lease); one sender thread per prefill rank sends it (``notify(cluster id, notes)`` may
    block up to llmdd's sync_kv_timeout when that rank is stalled or gone: the other ranks' renewals
    do not wait for it).  vLLM's step loop never waits for any of them."""

    def __init__(self, notify: Callable[[int, list], None]) -> None:
        self._notify = notify
        self._cond = threading.Condition()
        self._pulling: dict = {}    # decode request id -> _Pulling
        self._fresh: list = []      # pulls registered since the last round: renewed at once
        self._out: dict = {}        # cluster id -> _Outbox
        self._closed = False
        self._retry: Optional[float] = None     # a renewal failed: the next round by then
        self._thread: Optional[threading.Thread] = None
        self.stats = {"renewals_sent": 0, "aborts_sent": 0, "notes_failed": 0}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llmdd-vllm-leases", daemon=True)
        self._thread.start()

    def pulling(self, req_id: str, remote_id: str, clusters: list, lease_s: float) -> None:
        with self._cond:
            self._pulling[req_id] = _Pulling(remote_id, list(clusters), float(lease_s))
            self._fresh.append(req_id)
            self._cond.notify_all()

    def ended(self, req_id: str) -> None:
        with self._cond:
            self._pulling.pop(req_id, None)

    def abort(self, req_id: str) -> bool:
        """vLLM aborted the request: tell its prefill ranks at once; False when no pull of it is known."""
        with self._cond:
            p = self._pulling.pop(req_id, None)
            if p is None:
                return False
            for c in p.clusters:
                self._box(c).aborts.append(p.remote_id)
            self._cond.notify_all()
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = [t for t in [self._thread, *(b.thread for b in self._out.values())] if t is not None]
        for t in threads:
            t.join(10)

    def _box(self, cluster: int) -> _Outbox:
        """(under ``_cond``) the outbox of ``cluster``, its sender thread started on first use."""
        box = self._out.get(cluster)
        if box is None:
            box = self._out[cluster] = _Outbox()
            box.thread = threading.Thread(target=self._sender, args=(cluster, box),
                                          name=f"llmdd-vllm-notes-{cluster}", daemon=True)
            box.thread.start()
        return box

    def _sender(self, cluster: int, box: _Outbox) -> None:
        while True:
            with self._cond:
                while not (self._closed or box.aborts or box.renews):
                    self._cond.wait()
                if self._closed:
                    return
                aborts, gone = box.aborts, set(box.aborts)
                renews = [rid for rid in box.renews if rid not in gone]    # an abort ends its renewals
                box.aborts, box.renews = [], {}
            self._send(cluster, ABORT, aborts)
            self._send(cluster, RENEW, renews)

    def _send(self, cluster: int, kind: str, rids: list) -> None:
        for i in range(0, len(rids), MAX_NOTES):
            chunk = [note(kind, rid) for rid in rids[i:i + MAX_NOTES]]
            try:
                self._notify(cluster, chunk)
            except Exception as exc:  # noqa: BLE001 - a lost note: the lease decides (never raised)
                with self._cond:
                    self.stats["notes_failed"] += 1
                    if kind == RENEW:
                        soon = time.monotonic() + RETRY_S
                        self._retry = soon if self._retry is None else min(self._retry, soon)
                        self._cond.notify_all()
                _log.info("llmdd_vllm: %d %s note(s) to cluster %d not delivered: %s", len(chunk), kind,
                          cluster, exc)
                continue
            with self._cond:
                self.stats["aborts_sent" if kind == ABORT else "renewals_sent"] += len(chunk)

    def _run(self) -> None:
        next_round: Optional[float] = None
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                if not self._pulling:
                    next_round = None
                elif next_round is None:
                    next_round = now + min(p.lease_s for p in self._pulling.values()) / 3
                if self._retry is not None:
                    if next_round is not None:
                        next_round = min(next_round, self._retry)
                    self._retry = None
                if next_round is not None and now >= next_round:
                    due = list(self._pulling.values())
                    next_round = now + min(p.lease_s for p in self._pulling.values()) / 3
                else:
                    due = [p for rid in self._fresh if (p := self._pulling.get(rid)) is not None]
                self._fresh = []
                for p in due:
                    for c in p.clusters:
                        self._box(c).renews[p.remote_id] = None
                if due:
                    self._cond.notify_all()
                if not self._fresh:
                    self._cond.wait(None if next_round is None else max(0.0, next_round - time.monotonic()))
