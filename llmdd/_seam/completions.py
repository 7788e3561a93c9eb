"""Ready-made :class:`~llmdd._seam.abc.Completion` implementations (public in :mod:`llmdd.lowlevel`)."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from llmdd._base.log import get_logger
from llmdd._base.status import TransportError
from llmdd._seam.abc import Completion
from llmdd._seam.errors import Cancelled, Corrupt, PeerGone, TransportTimeout

__all__ = ["DoneCompletion", "ThreadCompletion", "CompletionThreads", "submitted"]

_log = get_logger("llmdd.abc")


class DoneCompletion(Completion):
    """An already finished batch (synchronous transports, inline small batches)."""

    __slots__ = ("_error",)

    def __init__(self, error: Union[TransportError, None] = None) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: Union[float, None] = None) -> bool:
        return True

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error

    def cancel(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<DoneCompletion error={self._error!r}>"


def submitted(submit: Callable[..., Completion], *args: Any) -> Completion:
    """``submit(*args)`` as the seam's one refusal path (llmdd/_seam/abc.py): a ``TransportError`` it
    raises (a refusal or failure found before any byte moved) becomes the returned completion's
    error, so a ``Channel.read``/``write`` never raises one.  A transport's ``read`` is then
    ``return submitted(self._submit, READ, ops, deadline)``."""
    try:
        return submit(*args)
    except TransportError as exc:
        return DoneCompletion(exc)


def _wrap_error(exc: BaseException) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, (ConnectionError, EOFError)):  # reset, broken pipe, refused, aborted
        return PeerGone(f"peer connection lost: {exc!r}")
    if isinstance(exc, (TimeoutError,)):
        return TransportTimeout(f"transport worker timed out: {exc!r}")
    return Corrupt(f"transport worker failed: {exc!r}")


class _Flag(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: Optional[float] = None) -> bool: ...


class _Joinable(Protocol):
    def join(self, timeout: Optional[float] = None) -> None: ...


class CompletionThreads(Protocol):
    """What a :class:`ThreadCompletion` needs of the runtime it runs on (the engine's
    ``llmdd._runtime.runtime.Threads`` is one; ``llmdd.lowlevel.ThreadCompletion`` hands it the real
    threads by default): its clock, its waiting, its workers."""

    def monotonic(self) -> float: ...

    def event(self) -> _Flag: ...

    def local(self) -> Any: ...

    def start_worker(self, name: str, fn: Callable, *args: Any) -> _Joinable: ...


class ThreadCompletion(Completion):
    """A batch run by one or more workers; reusable by any transport.

    ``workers`` are callables, each run in its own daemon thread, or, with ``pool``, the first in
    the thread that calls :meth:`start` and the others handed to ``pool(fn)`` (a persistent thread
    pool's submit: no thread start per batch).  ``abort`` must make every worker return promptly
    (shut its sockets down, set a flag it checks between chunks); it is called once, on the first
    worker error, on :meth:`cancel`, and when ``deadline`` passes during :meth:`wait`.  ``on_done``
    runs once, after every worker has returned and before ``done()`` turns true (release resources
    there; :attr:`recorded_error` is the batch's error then).  The first error wins, except that an
    error set by :meth:`fail` (cancel, deadline, deregistration) wins over what the aborted workers
    raise.  A worker's exception becomes a typed error through ``map_error`` (default: a
    :class:`~llmdd.lowlevel.TransportError` as it is, a lost connection :class:`PeerGone`, a timeout
    :class:`TransportTimeout`, anything else :class:`Corrupt`); an interrupt (``KeyboardInterrupt``)
    fails the batch :class:`Cancelled` and, in the caller's own part, goes on.  With ``start=False``
    nothing runs before :meth:`start` (publish the completion first, e.g. where a concurrent
    deregistration finds it).  ``threads`` is where its workers, clock and waits come from
    (:class:`CompletionThreads`; the public ``llmdd.lowlevel.ThreadCompletion`` defaults it to the
    real threads).
    """

    def __init__(self, workers: Sequence[Callable[[], None]], *, deadline: Union[float, None] = None,
                 abort: Union[Callable[[], None], None] = None,
                 on_done: Union[Callable[["ThreadCompletion"], object], None] = None,
                 name: str = "llmdd-io",
                 pool: Union[Callable[[Callable[[], None]], Any], None] = None,
                 map_error: Union[Callable[[BaseException], TransportError], None] = None,
                 start: bool = True, threads: CompletionThreads) -> None:
        self._rt = threads
        self._deadline = deadline
        self._abort = abort
        self._on_done = on_done
        self._name = name
        self._pool = pool
        self._map_error = map_error if map_error is not None else _wrap_error
        self._lock = threading.Lock()   # a short critical section, never held across a wait
        self._done = threads.event()
        self._error: Union[TransportError, None] = None
        self._forced: Union[TransportError, None] = None
        self._aborted = False
        self._pending = len(workers)
        self._workers: list = list(workers)
        self._threads: list[_Joinable] = []
        self._part = threads.local()   # .index: the part the current worker runs now (-1: none)
        if start:
            self.start()

    def start(self) -> "ThreadCompletion":
        """Run the workers (once); returns self, which may already be done (pool mode)."""
        workers, self._workers = self._workers, []
        if not workers:
            if self._pending == 0 and not self._done.is_set():
                self._finish()
            return self
        if self._pool is None:
            self._threads = [self._rt.start_worker(f"{self._name}-{i}", self._run, w, False, i)
                             for i, w in enumerate(workers)]
            return self
        for w in workers[1:]:
            self._pool(functools.partial(self._run, w))
        self._run(workers[0], inline=True)
        return self

    @property
    def recorded_error(self) -> Union[TransportError, None]:
        """The error recorded so far (what ``error`` will be; readable in ``on_done``)."""
        return self._error

    # worker side
    def _run(self, work: Callable[[], None], inline: bool = False, index: int = 0) -> None:
        self._part.index = index
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes the batch's error
            if isinstance(exc, Exception):
                self._record(self._map_error(exc))
            else:
                self._record(Cancelled(f"interrupted: {exc!r}"))
                if inline:
                    raise
        finally:
            self._part.index = -1
            with self._lock:
                self._pending -= 1
                last = self._pending == 0
            if last:
                self._finish()

    def _record(self, err: TransportError) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
        self._do_abort()

    def _do_abort(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        if self._abort is not None:
            try:
                self._abort()
            except Exception as exc:  # noqa: BLE001
                _log.warning("llmdd.transport.abort_failed", error=repr(exc))

    def _finish(self) -> None:
        with self._lock:
            if self._forced is not None:
                self._error = self._forced
        if self._on_done is not None:
            try:
                self._on_done(self)
            except Exception as exc:  # noqa: BLE001
                _log.warning("llmdd.transport.on_done_failed", error=repr(exc))
        self._done.set()

    # caller side
    def fail(self, err: TransportError) -> None:
        """Fail the batch with ``err`` (unless already done), abort and drain it."""
        with self._lock:
            if self._done.is_set():
                return
            if self._forced is None and self._error is None:
                self._forced = err
        self._do_abort()
        self._join()

    def _join(self) -> None:
        mine = getattr(self._part, "index", -1)   # the part this worker runs now, if it runs one
        for i, t in enumerate(self._threads):
            if i != mine:
                t.join()
        if mine >= 0:
            return   # a part failing its own batch: the others drain (or are joined), it returns
        self._done.wait()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Union[float, None] = None) -> bool:
        end = None if timeout is None else self._rt.monotonic() + timeout
        while not self._done.is_set():
            now = self._rt.monotonic()
            limits = [t for t in (end, self._deadline) if t is not None]
            until = min(limits) if limits else None
            if until is not None and now >= until:
                if self._deadline is not None and now >= self._deadline:
                    self.fail(TransportTimeout("batch missed its deadline"))
                    return True
                return False
            self._done.wait(None if until is None else until - now)
        return True

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error if self._done.is_set() else None

    def cancel(self) -> None:
        if not self._done.is_set():
            self.fail(Cancelled("batch cancelled"))

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "running"
        return f"<ThreadCompletion {state} error={self.error!r}>"
