"""One ucx batch as NIXL requests: cut into chunks, at most ``llmdd.ucx.inflight`` in flight, polled
with a spin-then-sleep backoff, failed by draining (never releasing a request in flight).  A part of a
split batch (:mod:`llmdd_ucx._lanes`) is the same object, posted and polled by a posting thread."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Protocol, Union

from llmdd.abc import Completion
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import Cancelled, PeerGone, TransportError, TransportTimeout, get_logger

from ._nixl import nixl_error
from ._options import OPT_DRAIN_TIMEOUT, OPT_INFLIGHT, OPT_SPIN_US

from ._lanes import Split

_log = get_logger("llmdd.transport.ucx")


class XferEndpoint(Protocol):
    """What a batch uses of the endpoint (:class:`~llmdd_ucx._endpoint.UcxEndpoint`): its NIXL agent, the
    batch settings read from its options (:func:`xfer_settings`), and where requests that did not drain
    are kept (``strand``)."""

    @property
    def agent(self) -> Any: ...

    @property
    def xfer_settings(self) -> tuple[int, float, float]: ...

    def strand(self, requests: list) -> None: ...


class XferChannel(Protocol):
    """What a batch uses of the channel that made it (:class:`~llmdd_ucx._channel.UcxChannel`): its endpoint,
    the peer agent's name, the error a failed request means (``gone_error``, ``transfer_error``) and
    the batch's end (``batch_done``)."""

    @property
    def endpoint(self) -> XferEndpoint: ...

    @property
    def peer_name(self) -> str: ...

    def gone_error(self) -> Optional[TransportError]: ...

    def transfer_error(self) -> TransportError: ...

    def batch_done(self, batch: Xfer, err: Optional[TransportError]) -> None: ...


class Xfer(Completion):
    """One batch: a list of NIXL requests (chunks), at most ``window`` in flight."""

    def __init__(self, ch: XferChannel, op: str, chunks: list, deadline: float, nbytes: int, nops: int,
                 local_ids: frozenset, remote_ids: frozenset, *, quick: bool = False,
                 parent: Optional[Split] = None) -> None:
        self._ch = ch
        ep = ch.endpoint
        self._agent = ep.agent
        self.op = op
        self._chunks = chunks
        self._next = 0
        self._posted: list = []
        self._deadline = deadline
        self.nbytes = nbytes
        self.nops = nops
        self.local_ids = local_ids
        self.remote_ids = remote_ids
        self.quick = quick   # posted by the one-call path (llmdd_ucx._quick): counted as quick_batches
        self._window, self._spin, self._drain_timeout = ep.xfer_settings
        self._lock = threading.RLock()
        self.finished = False   # set once, by _finish
        # what a driver thread's waiters sleep on; made only when a driver starts (a batch of one
        # chunk, the one-call path's, is finished by the thread that waits for it: no event to make)
        self._wake: Optional[threading.Event] = None
        self._error: Optional[TransportError] = None
        self._driver: Optional[threading.Thread] = None
        # a part of a split batch: posted and polled by a posting thread (run_posted), never by a waiter
        self.parent = parent
        if parent is not None:
            self._wake = threading.Event()

    # ---------------------------------------------------------------- driving

    def start(self) -> None:
        with self._lock:
            self._step()
        if not self.finished and self._next < len(self._chunks):
            self._wake = threading.Event()
            self._driver = threading.Thread(target=self._drive, name="llmdd-ucx-xfer", daemon=True)
            self._driver.start()

    def run_posted(self) -> None:
        """Post and poll this part to its end in the calling (posting) thread.  A part failed before
        (DRAIN, deregistration, cancel, a sibling's error) posts nothing."""
        parent = self.parent
        if parent is not None and parent.first_err is not None:
            self.fail(parent.first_err)   # a sibling failed before this part started: post nothing
            return
        with self._lock:
            if not self.finished:
                self._step()
        backoff = _Backoff(self._spin)
        while not self.finished:
            if parent is not None and parent.first_err is not None:
                self.fail(parent.first_err)   # first error wins: stop posting, drain
                return
            if self.poll():
                return
            backoff.pause(self._deadline)

    def _drive(self) -> None:
        backoff = _Backoff(self._spin)
        while not self.finished:
            if self.poll():
                return
            backoff.pause(self._deadline)

    def poll(self) -> bool:
        """One non-blocking step; True once the batch is finished."""
        if self.finished:
            return True
        if not self._lock.acquire(blocking=False):
            return self.finished
        try:
            if not self.finished:
                self._step()
        finally:
            self._lock.release()
        return self.finished

    def _step(self) -> None:
        """Check posted requests, post more; fail on error or deadline (lock held)."""
        if time.monotonic() >= self._deadline:
            self._fail_locked(TransportTimeout("batch missed its deadline"))
            return
        agent = self._agent
        posted = self._posted
        still = []
        for i, h in enumerate(posted):
            try:
                st = agent.check_xfer_state(h)
            except Exception:  # noqa: BLE001 - treated like ERR
                st = "ERR"
            if st == "PROC":
                still.append(h)
            elif st == "DONE":
                agent.release_xfer_handle(h)
            else:
                self._posted = still + posted[i:]
                self._fail_locked(self._ch.transfer_error())
                return
        self._posted = still
        while self._next < len(self._chunks) and len(self._posted) < self._window:
            ldesc, rdesc = self._chunks[self._next]
            try:
                h = agent.initialize_xfer(self.op, agent.get_xfer_descs(ldesc, "DRAM"),
                                          agent.get_xfer_descs(rdesc, "DRAM"), self._ch.peer_name)
            except Exception as exc:  # noqa: BLE001
                self._fail_locked(self._ch.gone_error() or nixl_error(exc, "creating the transfer"))
                return
            self._chunks[self._next] = None
            self._next += 1
            try:
                st = agent.transfer(h)
            except Exception as exc:  # noqa: BLE001
                self._posted.append(h)
                self._fail_locked(self._ch.gone_error() or nixl_error(exc, "posting the transfer"))
                return
            if st == "DONE":
                agent.release_xfer_handle(h)
            elif st == "PROC":
                self._posted.append(h)
            else:
                self._posted.append(h)
                self._fail_locked(self._ch.transfer_error())
                return
        if self._next >= len(self._chunks) and not self._posted:
            self._finish(None)

    def _fail_locked(self, err: TransportError) -> None:
        """Post nothing more, drain every request still in flight, release, finish with ``err``."""
        self._next = len(self._chunks)
        self._chunks = []
        agent = self._agent
        end = time.monotonic() + self._drain_timeout
        backoff = _Backoff(self._spin)
        pending = self._posted
        while pending:
            left = []
            for h in pending:
                try:
                    st = agent.check_xfer_state(h)
                except Exception:  # noqa: BLE001 - a failed query means the request is over
                    st = "ERR"
                if st == "PROC":
                    left.append(h)
                else:
                    try:
                        agent.release_xfer_handle(h)
                    except Exception as exc:  # noqa: BLE001
                        _log.warning("llmdd.transport.ucx.release_failed", error=repr(exc))
            pending = left
            if pending:
                if time.monotonic() >= end:
                    # never release a request in flight (nixl#2067): keep it alive with the endpoint
                    self._ch.endpoint.strand(pending)
                    _log.error("llmdd.transport.ucx.drain_timeout", requests=len(pending))
                    err = PeerGone(f"{err}; {len(pending)} request(s) did not drain within "
                                   f"{self._drain_timeout:.0f}s")
                    break
                backoff.pause(end)
        self._posted = []
        self._finish(err)

    def _finish(self, err: Optional[TransportError]) -> None:
        if self.finished:
            return
        self._error = err
        self._ch.batch_done(self, err)
        self.finished = True
        if self._wake is not None:
            self._wake.set()
        if self.parent is not None:
            self.parent.part_finished()

    # ---------------------------------------------------------------- Completion API

    def fail(self, err: TransportError) -> None:
        """Fail (unless done) and drain; returns when no byte of the batch lands any more."""
        if self.finished:
            return
        with self._lock:
            if not self.finished:
                self._fail_locked(err)
        if self._driver is not None and self._driver is not threading.current_thread():
            self._driver.join()

    def done(self) -> bool:
        if self._driver is None and self.parent is None:
            return self.poll()
        return self.finished

    def wait(self, timeout: Union[float, None] = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        backoff = _Backoff(self._spin)
        while True:
            if self._driver is None and self.parent is None:
                if self.poll():
                    return True
            elif self.finished:
                return True
            now = time.monotonic()
            if now >= self._deadline:
                self.fail(TransportTimeout("batch missed its deadline"))
                return True
            if end is not None and now >= end:
                return False
            wake = self._wake   # made before the driver (a part's: with the part)
            if wake is not None:
                wake.wait(min(x for x in (end, self._deadline, now + 0.05) if x is not None) - now)
            else:
                backoff.pause(min(self._deadline, end) if end is not None else self._deadline)

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error if self.finished else None

    def cancel(self) -> None:
        self.fail(Cancelled("batch cancelled"))

    def touches(self, region_id: int) -> bool:
        """Whether the batch uses local region ``region_id`` (its deregistration fails the batch)."""
        return region_id in self.local_ids

    def __repr__(self) -> str:
        return f"<ucx batch {self.op} {self.nbytes} B {'done' if self.finished else 'running'}>"


def xfer_settings(cfg: dict) -> tuple[int, float, float]:
    """(window, spin budget in seconds, drain timeout in seconds) of the batches of an endpoint with options ``cfg``."""
    return max(1, int(cfg[OPT_INFLIGHT])), float(cfg[OPT_SPIN_US]) * 1e-6, float(cfg[OPT_DRAIN_TIMEOUT])


class _Backoff:
    """Spin for a budget, then sleep 20 us doubling up to 1 ms: never starve the other core."""

    __slots__ = ("_spin_end", "_sleep")

    def __init__(self, spin_s: float) -> None:
        self._spin_end = time.monotonic() + spin_s
        self._sleep = 20e-6

    def pause(self, until: float) -> None:
        now = time.monotonic()
        if now < self._spin_end:
            return
        time.sleep(max(0.0, min(self._sleep, until - now)))
        self._sleep = min(self._sleep * 2, 1e-3)



def split_big(ldesc: np.ndarray, rdesc: np.ndarray, max_bytes: int) -> tuple:
    """The descriptor arrays with every descriptor longer than ``max_bytes`` cut into consecutive
    pieces of at most ``max_bytes`` (the arrays themselves when none is)."""
    lens = ldesc[:, 1]
    if int(lens.max()) <= max_bytes:
        return ldesc, rdesc
    reps = ((lens + np.uint64(max_bytes - 1)) // np.uint64(max_bytes)).astype(np.int64)
    idx = np.repeat(np.arange(len(lens)), reps)
    first = np.concatenate(([0], np.cumsum(reps)[:-1]))
    k = (np.arange(len(idx)) - np.repeat(first, reps)).astype(np.uint64)
    off = k * np.uint64(max_bytes)
    piece = np.minimum(lens[idx] - off, np.uint64(max_bytes))
    return (np.stack([ldesc[idx, 0] + off, piece, ldesc[idx, 2]], axis=1),
            np.stack([rdesc[idx, 0] + off, piece, rdesc[idx, 2]], axis=1))


def chunk(ldesc: np.ndarray, rdesc: np.ndarray, max_bytes: int, max_descs: int) -> list:
    """Cut descriptor arrays into consecutive pieces of at most ``max_bytes`` / ``max_descs``.

    A single descriptor larger than ``max_bytes`` is split too, so that a drain after cancel or
    deadline waits for at most ``inflight x max_bytes`` of traffic.
    """
    ldesc, rdesc = split_big(ldesc, rdesc, max_bytes)
    lens = ldesc[:, 1]
    if len(lens) <= max_descs and int(lens.sum(dtype=np.uint64)) <= max_bytes:
        return [(ldesc, rdesc)]
    ends = np.cumsum(lens, dtype=np.uint64)
    out = []
    start = 0
    n = len(lens)
    while start < n:
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + max_bytes, side="right"))
        stop = min(max(stop, start + 1), n, start + max_descs)
        out.append((np.ascontiguousarray(ldesc[start:stop]), np.ascontiguousarray(rdesc[start:stop])))
        start = stop
    return out
