"""A large ucx batch on several cores: cut into parts by bytes (:data:`PARTS_PER_THREAD` per thread),
each part one batch of its own (:class:`~llmdd_ucx._xfer.Xfer`) that one of the endpoint's
persistent posting threads takes from their queue, posts and polls, each thread bound to a UCX
worker of its own; :class:`Split` is the caller's completion over the parts.

Why threads and workers: over ``cma`` UCX completes every get inside NIXL's post call, one
``process_vm_readv`` per descriptor, on the calling thread; one thread is one core.  NIXL's UCX
backend binds each thread to one of its ``num_workers`` workers at the thread's first transfer
request (round robin, for the thread's life), and with the agent in ``NIXL_THREAD_SYNC_RW`` mode
requests on different workers do not serialise.  The endpoint starts its posting threads before any
other thread uses the agent and has each make one request in turn, so they hold distinct workers
(:class:`PostThreads`).  ``bench/results-committed/issue22/ucx-threads/`` has the probe that measured it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional, Protocol, Union

from llmdd.abc import Completion
from llmdd.lowlevel import lazy_numpy as np
from llmdd.lowlevel import Cancelled, TransportError, TransportTimeout, get_logger


class Posted(Protocol):
    """A part of a split batch as a posting thread sees it (:class:`~llmdd_ucx._xfer.Xfer`): posted and
    polled to its end by ``run_posted`` (which records its own error)."""

    def run_posted(self) -> None: ...

_log = get_logger("llmdd.transport.ucx")


#: a split batch is cut into this many parts per posting thread, which the threads take from one
#: queue as each finishes its last: a thread the scheduler preempts holds back one small part, not half
#: the batch (the other threads run the rest)
PARTS_PER_THREAD = 4


class PostThreads:
    """``n`` persistent daemon threads, thread ``i`` bound to UCX worker ``i`` of the agent, taking
    parts from one queue, one at a time.  Idle threads wait on the queue (no CPU)."""

    def __init__(self, n: int, bind: Callable[[], None], name: str) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self.threads: list = []
        self.ok = True
        for i in range(n):   # one at a time: thread i makes its binding request before thread i+1 starts
            bound = threading.Event()
            result: list = []
            t = threading.Thread(target=self._loop, args=(self._q, bind, bound, result),
                                 name=f"llmdd-ucx-post-{name}-{i}", daemon=True)
            t.start()
            self.threads.append(t)
            if not bound.wait(30.0) or result != [True]:
                self.ok = False
                break

    @staticmethod
    def _loop(q: "queue.SimpleQueue", bind: Callable[[], None], bound: threading.Event, result: list) -> None:
        try:
            bind()
            result.append(True)
        except Exception as exc:  # noqa: BLE001 - reported to the endpoint (no split then)
            result.append(repr(exc))
        del bind   # it holds the agent: an endpoint dropped without close() must not be kept alive by this thread
        bound.set()
        while True:
            part = q.get()
            if part is None:
                return
            try:
                part.run_posted()
            except BaseException as exc:  # noqa: BLE001 - a part records its own error; the thread must live on
                _log.error("llmdd.transport.ucx.post_thread_failed", error=repr(exc))
            part = None

    def submit(self, part: Posted) -> None:
        self._q.put(part)

    def stop(self) -> None:
        """Tell the threads to end once the parts queued before are run; does not wait."""
        for _ in self.threads:
            self._q.put(None)

    def close(self) -> None:
        """Stop the threads and wait for them (each part ends by its batch's deadline)."""
        self.stop()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(5.0)


def split_bounds(lens: "np.ndarray", parts: int) -> list:
    """Indices cutting descriptors of lengths ``lens`` into at most ``parts`` consecutive runs of about
    equal bytes (each run non-empty): ``[0, i1, ..., len(lens)]``."""
    n = len(lens)
    ends = np.cumsum(lens, dtype=np.uint64)
    total = int(ends[-1]) if n else 0
    cuts = [0]
    for k in range(1, parts):
        i = int(np.searchsorted(ends, (total * k) // parts, side="left")) + 1
        if cuts[-1] < i < n:
            cuts.append(i)
    cuts.append(n)
    return cuts


class Split(Completion):
    """The completion of a batch run as parts: done when every part is; its error is the first part's
    error (the others are failed with it and drained)."""

    def __init__(self, op: str, nbytes: int, nops: int, deadline: float) -> None:
        self.op = op
        self.nbytes = nbytes
        self.nops = nops
        self.quick = False
        self._deadline = deadline
        self.parts: list = []
        self.left = 0
        self.first_err: Optional[TransportError] = None
        self._changed = threading.Event()   # set whenever a part finishes

    # called by the channel under its lock as each part finishes; True when it was the last one
    def note(self, err: Optional[TransportError]) -> bool:
        if err is not None and self.first_err is None:
            self.first_err = err
        self.left -= 1
        return self.left == 0

    def part_finished(self) -> None:
        self._changed.set()

    def _fail_rest(self) -> None:
        err = self.first_err
        if err is not None:
            for p in self.parts:
                if not p.finished:
                    p.fail(err)

    def done(self) -> bool:
        if self.first_err is not None:
            self._fail_rest()
        return all(p.finished for p in self.parts)

    def wait(self, timeout: Union[float, None] = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            self._changed.clear()   # before looking: a part finishing after this sets it again
            if self.first_err is not None:
                self._fail_rest()
            if all(p.finished for p in self.parts):
                return True
            now = time.monotonic()
            if now >= self._deadline:
                self.fail(TransportTimeout("batch missed its deadline"))
                return True
            if end is not None and now >= end:
                return False
            self._changed.wait(min(x for x in (end, self._deadline) if x is not None) - now)

    @property
    def error(self) -> Union[TransportError, None]:
        return self.first_err if all(p.finished for p in self.parts) else None

    def fail(self, err: TransportError) -> None:
        """Fail every part not finished (each drains); returns when no byte of the batch lands any more."""
        for p in self.parts:
            p.fail(err)

    def cancel(self) -> None:
        self.fail(Cancelled("batch cancelled"))

    def __repr__(self) -> str:
        return f"<ucx split batch {self.op} {self.nbytes} B in {len(self.parts)} parts>"


def bind_request(agent: Any, name: str, scratch: "np.ndarray") -> Callable[[], None]:
    """A request that binds the calling thread to its UCX worker: a loopback transfer request between
    two halves of ``scratch`` (registered with ``agent``), made and released, never posted."""
    half = scratch.nbytes // 2
    base = scratch.ctypes.data

    def bind() -> None:
        h = agent.initialize_xfer("READ", agent.get_xfer_descs(np.array([[base, half, 0]], np.uint64), "DRAM"),
                                  agent.get_xfer_descs(np.array([[base + half, half, 0]], np.uint64), "DRAM"), name)
        agent.release_xfer_handle(h)
    return bind
