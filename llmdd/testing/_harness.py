"""Multi-process test harness: peers in child processes that run arbitrary callables.

A *peer* is a child process (``multiprocessing`` spawn context by default) running a small
command loop.  The parent sends ``handle.call(fn, *args)``; ``fn`` must be an importable,
module-level function (it is pickled by reference) and is executed in the child as
``fn(state, *args, **kwargs)``, where ``state`` is a dict private to that child that survives
between calls (create an engine in one call, use it in the next).

Every call has a deadline: the parent raises :class:`TimeoutError` when the child does not
answer in time, and never blocks on a dead, stalled or busy child.  Exceptions raised in the
child are re-raised in the parent with the child's traceback text attached (``__cause__`` is a
:class:`RemoteTraceback`, and ``exc.remote_traceback`` holds the text when the exception accepts
attributes); ``LLMException.status_code`` survives the trip.

Faults: ``handle.kill()`` (SIGKILL), ``handle.stall()`` / ``handle.resume()`` (SIGSTOP /
SIGCONT), and named checkpoints: code running in the child calls ``checkpoint("mid_payload")``
and the parent arms it beforehand with ``handle.arm("mid_payload", "kill")``.  Arming travels on
the same ordered pipe as calls, so it takes effect before every call sent after it (a call that
is already running in the child does not see it).  The child reports each firing before acting;
``handle.fired`` lists them and ``handle.wait_fired(name)`` waits for one (for ``"stall"``, until
the child is really stopped, so that ``resume()`` cannot overtake it).

Children are never daemonic but always reaped: ``close()`` stops gracefully then kills, the
:func:`peers` context manager closes every child it started even when the test fails, and an
``atexit`` hook kills whatever is left (before ``multiprocessing`` would join, and hang on, a
stalled child).
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.context
import os
import pickle
import queue
import signal
import socket
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Iterator, Literal, Mapping, Union

from llmdd.testing._calls import CheckpointError, PeerCallError, PeerExitedError, RemoteTraceback, _dumps_call
from llmdd.testing._peer import _peer_main, checkpoint, checkpoint_hits

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "CheckpointError",
    "Cluster",
    "PeerCallError",
    "PeerExitedError",
    "PeerFuture",
    "PeerHandle",
    "RemoteTraceback",
    "checkpoint",
    "checkpoint_hits",
    "free_port",
    "peers",
    "spawn_peer",
]

DEFAULT_CALL_TIMEOUT = 10.0
#: no fixed deadline on a peer's startup by default: it is CPU-bound work (the interpreter and the
#: imports), which a busy machine slows down without bound, so a fixed number of seconds failed
#: healthy children (issue 41).  The parent waits while the child lives and fails at once when it
#: dies (:class:`PeerExitedError`); under pytest, the test's own timeout bounds the wait.
_DEFAULT_STARTUP_TIMEOUT: float | None = None
_REAP_TIMEOUT = 5.0

Action = Literal["kill", "stall", "raise"]
_ACTIONS = ("kill", "stall", "raise")


# --------------------------------------------------------------------------- free port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close).

    Another process may take it before you bind it; when the code under test can listen on
    port 0 itself, prefer that and return ``sock.getsockname()`` from a peer call.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- parent side


class PeerFuture:
    """Result of :meth:`PeerHandle.call_async`; ``result(timeout)`` raises ``TimeoutError``."""

    def __init__(self, peer: str, what: str) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self._peer = peer
        self._what = what

    def _set_result(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def _set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> Any:
        """Wait at most ``timeout`` seconds; ``None``: as long as the peer lives (its death fails the
        future at once), for CPU-bound work of the child, which the test's own timeout bounds."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"peer {self._peer!r}: {self._what} did not answer within {timeout} s")
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: float | None = DEFAULT_CALL_TIMEOUT) -> BaseException | None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"peer {self._peer!r}: {self._what} did not answer within {timeout} s")
        return self._exc


_LIVE: "set[PeerHandle]" = set()  # strong refs: a dropped handle is still reaped at exit
#: a multiprocessing start method (``multiprocessing.get_context``)
StartMethod = Literal["spawn", "fork", "forkserver"]


def _mp_context(start_method: StartMethod) -> Union[
        multiprocessing.context.SpawnContext, multiprocessing.context.ForkContext,
        multiprocessing.context.ForkServerContext]:
    """``multiprocessing.get_context(start_method)``, typed as the context that has ``Process``."""
    if start_method == "fork":
        return multiprocessing.get_context("fork")
    if start_method == "forkserver":
        return multiprocessing.get_context("forkserver")
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    raise ValueError(f"unknown start method {start_method!r}")

_LIVE_LOCK = threading.Lock()
_ENV_LOCK = threading.Lock()


@contextmanager
def _patched_environ(env: Mapping[str, str | None] | None) -> Iterator[None]:
    if not env:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        try:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class PeerHandle:
    """Parent-side handle of one peer process; see the module docstring.  Use :func:`spawn_peer`."""

    def __init__(self, name: str, *, env: Mapping[str, str | None] | None = None,
                 start_method: StartMethod = "spawn") -> None:
        self.name = name
        self._env = dict(env) if env else None
        self._ctx = _mp_context(start_method)
        self._conn, child_conn = self._ctx.Pipe(duplex=True)
        self._process = self._ctx.Process(
            target=_peer_main, args=(child_conn, name, self._env), name=f"llmdd-peer-{name}", daemon=False)
        self._ids = itertools.count(1)
        self._pending: dict[int, PeerFuture] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = PeerFuture(name, "startup")
        self._dead_reason: str | None = None
        self._stalled = False
        self._closed = False
        self._fired: list[tuple[str, str]] = []
        self._fired_cond = threading.Condition()
        self._proc_lock = threading.Lock()  # serializes waitpid between the reader and kill()
        self._released_exitcode: int | None = None
        self._released = False
        with _patched_environ(self._env):
            self._process.start()
        child_conn.close()  # so that the child's death gives EOF here
        pid = self._process.pid
        if pid is None:  # start() returned, so the child exists and has a pid
            raise RuntimeError(f"peer {name!r}: the started process has no pid")
        self._pid: int = pid
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._reader = threading.Thread(target=self._read_loop, name=f"llmdd-peer-{name}-reader", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name=f"llmdd-peer-{name}-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # -- properties
    @property
    def pid(self) -> int:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        """``None`` while running; the exit status, or ``-signal`` when killed by a signal."""
        with self._proc_lock:
            if self._released:
                return self._released_exitcode
            return self._process.exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def _join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the child to exit, and reap it; never holds the lock while waiting."""
        with self._proc_lock:
            if self._released:
                return
            sentinel = self._process.sentinel
        try:
            exiting = bool(mp_wait([sentinel], timeout))
        except (OSError, ValueError):  # released meanwhile by another thread
            exiting = False
        with self._proc_lock:
            if not self._released:
                # the sentinel fires when the child's fds close, a moment before it can be
                # reaped: then wait for the zombie (blocking, as Process.join does), else just poll
                self._process.join(None if exiting else 0)

    @property
    def stalled(self) -> bool:
        return self._stalled

    def __repr__(self) -> str:
        return f"<PeerHandle {self.name!r} pid={self._pid} exitcode={self.exitcode}>"

    # -- background threads
    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a reply the parent cannot even decode: fail everything
                self._dead_reason = f"undecodable message from peer: {exc!r}"
                break
            kind = msg[0]
            if kind == "ready":
                self._ready._set_result(msg[1])
                continue
            if kind == "fired":
                if msg[2] == "stall":  # report it only once the child is really stopped
                    self._stalled = True
                    self._wait_proc_state(lambda st: st in ("T", "t"))
                with self._fired_cond:
                    self._fired.append((msg[1], msg[2]))
                    self._fired_cond.notify_all()
                continue
            with self._lock:
                fut = self._pending.pop(msg[1], None)
            if fut is None:
                continue
            if kind == "ok":
                try:
                    fut._set_result(pickle.loads(msg[2]))
                except Exception as exc:
                    fut._set_exception(PeerCallError(f"cannot unpickle the result in the parent: {exc!r}"))
            else:
                fut._set_exception(self._rebuild_error(msg))
        # EOF: the child is gone (or never answers again); reap it and fail every waiter
        self._join(_REAP_TIMEOUT)
        exitcode = self.exitcode
        err_text = self._dead_reason or f"peer {self.name!r} exited with code {exitcode}"
        with self._lock:
            pending, self._pending = self._pending, {}
            self._closed = True
        with self._fired_cond:
            self._fired_cond.notify_all()
        for fut in [self._ready, *pending.values()]:
            if not fut.done():
                fut._set_exception(PeerExitedError(err_text, exitcode))

    def _rebuild_error(self, msg: tuple[Any, ...]) -> BaseException:
        _, _, blob, tb_text, type_name, text = msg
        exc: BaseException
        if blob is None:
            exc = PeerCallError(f"{type_name}: {text}")
        else:
            try:
                exc = pickle.loads(blob)
            except Exception:
                exc = PeerCallError(f"{type_name}: {text}")
        exc.__cause__ = RemoteTraceback(f"[peer {self.name!r} pid {self._pid}]\n{tb_text}")
        try:
            exc.remote_traceback = tb_text  # type: ignore[attr-defined]  # an ad-hoc attribute on any exception type
        except AttributeError:  # __slots__ exceptions
            pass
        return exc

    def _write_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):
                return  # the reader reports the death

    # -- calls
    def _wait_ready(self, timeout: float | None) -> None:
        try:
            self._ready.result(timeout)
        except BaseException:
            self._request_stop()
            self._finish_close(time.monotonic())
            raise

    def call_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PeerFuture:
        """Send ``fn(state, *args, **kwargs)`` to the child; returns at once with a future.

        ``fn`` and the arguments are pickled here, so an unpicklable call fails immediately.
        Calls run one at a time in the child, in the order they were sent.
        """
        what = f"call {getattr(fn, '__qualname__', repr(fn))}"
        payload = _dumps_call(fn, args, kwargs)
        fut = PeerFuture(self.name, what)
        with self._lock:
            if self._closed:
                raise PeerExitedError(f"peer {self.name!r} is not running (exit code {self.exitcode})",
                                      self.exitcode)
            cid = next(self._ids)
            self._pending[cid] = fut
        self._outbox.put(("call", cid, payload))
        return fut

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = DEFAULT_CALL_TIMEOUT,
             **kwargs: Any) -> Any:
        """Run ``fn(state, *args, **kwargs)`` in the child and return its result.

        Raises ``TimeoutError`` after ``timeout`` seconds (the child may still be running the call; its
        late answer is discarded), :class:`PeerExitedError` if the child dies first, or the child's
        exception (``__cause__``: :class:`RemoteTraceback`).  ``timeout=None`` waits while the child
        lives: for CPU-bound work (a fresh child's imports, an engine's init), which the test's own
        timeout bounds.
        """
        return self.call_async(fn, *args, **kwargs).result(timeout)

    # -- checkpoints
    def arm(self, checkpoint: str, action: Action = "kill", *, nth: int = 1) -> None:
        """Make the child ``action`` itself on the ``nth`` next hit of ``checkpoint(name)``.

        Takes effect before any call sent after this one (not inside a call already running).
        """
        if action not in _ACTIONS:
            raise ValueError(f"action must be one of {_ACTIONS}, not {action!r}")
        if nth < 1:
            raise ValueError("nth must be >= 1")
        self._send_control(("arm", checkpoint, action, nth))

    @property
    def fired(self) -> list[tuple[str, str]]:
        """``(checkpoint, action)`` of every armed checkpoint that fired in the child, in order."""
        with self._fired_cond:
            return list(self._fired)

    def wait_fired(self, checkpoint: str, timeout: float = DEFAULT_CALL_TIMEOUT) -> str:
        """Wait until the armed ``checkpoint`` fired in the child; return its action.

        For ``"stall"`` this returns once the child is actually stopped, so a following
        :meth:`resume` cannot overtake the child's own SIGSTOP.
        """
        def hit() -> str | None:
            return next((a for n, a in self._fired if n == checkpoint), None)

        with self._fired_cond:
            if not self._fired_cond.wait_for(lambda: hit() is not None or self._closed, timeout):
                raise TimeoutError(f"peer {self.name!r}: checkpoint {checkpoint!r} did not fire within {timeout} s")
            action = hit()
        if action is None:
            raise PeerExitedError(f"peer {self.name!r} exited before checkpoint {checkpoint!r} fired", self.exitcode)
        return action

    def disarm(self, checkpoint: str | None = None) -> None:
        """Disarm one checkpoint, or all of them with ``None``."""
        self._send_control(("disarm", checkpoint))

    def _send_control(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            if self._closed:
                raise PeerExitedError(f"peer {self.name!r} is not running", self.exitcode)
        self._outbox.put(msg)

    # -- signals
    def _signal(self, sig: int) -> bool:
        if self.exitcode is not None:
            return False
        try:
            os.kill(self._pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self, timeout: float = _REAP_TIMEOUT) -> None:
        """SIGKILL the child and reap it (``exitcode`` becomes ``-9``)."""
        self._signal(signal.SIGKILL)
        self._join(timeout)
        self._stalled = False

    def stall(self) -> None:
        """SIGSTOP the child; returns once the kernel reports it stopped (Linux) or after 1 s."""
        if self._signal(signal.SIGSTOP):
            self._stalled = True
            self._wait_proc_state(lambda s: s in ("T", "t"))

    def resume(self) -> None:
        """SIGCONT the child (also after a checkpoint armed with ``"stall"``)."""
        if self._signal(signal.SIGCONT):
            self._wait_proc_state(lambda s: s not in ("T", "t"))
        self._stalled = False

    def _wait_proc_state(self, ok: Callable[[str], bool], limit: float = 1.0) -> None:
        path = f"/proc/{self._pid}/stat"
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    stat = f.read()
            except OSError:
                return  # gone, or no procfs
            if ok(stat.rsplit(")", 1)[1].split()[0]):
                return
            time.sleep(0.001)

    # -- shutdown
    def _request_stop(self) -> None:
        self._signal(signal.SIGCONT)  # a stalled child must be able to read "stop"
        self._stalled = False
        self._outbox.put(("stop",))

    def _finish_close(self, deadline: float) -> None:
        self._join(max(0.0, deadline - time.monotonic()))
        if self.exitcode is None:
            self.kill()
        self._outbox.put(None)
        self._writer.join(_REAP_TIMEOUT)
        self._reader.join(_REAP_TIMEOUT)
        if self._reader.is_alive() or self.exitcode is None:
            return  # cannot happen after a reaped SIGKILL; keep it registered for the exit hook
        self._conn.close()
        with self._proc_lock:
            self._released_exitcode = self._process.exitcode
            self._process.close()  # releases the sentinel fd now rather than at garbage collection
            self._released = True
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def close(self, timeout: float = _REAP_TIMEOUT) -> None:
        """Ask the child to stop (after the call it is running), kill it after ``timeout``; reap it.

        Idempotent.  Pending futures fail with :class:`PeerExitedError`.
        """
        if self._released:
            return
        self._request_stop()
        self._finish_close(time.monotonic() + timeout)

    def __enter__(self) -> "PeerHandle":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def spawn_peer(name: str, *, env: Mapping[str, str | None] | None = None, start_method: StartMethod = "spawn",
               startup_timeout: float | None = _DEFAULT_STARTUP_TIMEOUT) -> PeerHandle:
    """Start a peer child process and wait until its command loop answers.

    ``startup_timeout``: ``None`` (the default) waits as long as the child is alive (a child that
    exits during startup raises :class:`PeerExitedError` at once); a number of seconds raises
    ``TimeoutError`` after it.

    ``env`` entries are set (``None``: removed) in the child's environment before the
    interpreter starts (spawn/fork), so code reading the environment at import sees them.
    """
    handle = PeerHandle(name, env=env, start_method=start_method)
    handle._wait_ready(startup_timeout)
    return handle


class Cluster:
    """A named group of peers that are all reaped by :meth:`close` (or on ``with`` exit).

    ``cluster["prompt"]`` gets a handle; iterating yields the handles in spawn order, so
    ``with peers("p", "d") as (p, d):`` unpacks them.
    """

    def __init__(self, *, env: Mapping[str, str | None] | None = None, start_method: StartMethod = "spawn",
                 close_timeout: float = _REAP_TIMEOUT) -> None:
        self._env = env
        self._start_method = start_method
        self._close_timeout = close_timeout
        self._handles: dict[str, PeerHandle] = {}

    def spawn(self, *names: str, env: Mapping[str, str | None] | None = None,
              startup_timeout: float | None = _DEFAULT_STARTUP_TIMEOUT) -> list[PeerHandle]:
        """Start peers concurrently, wait until all answer; returns their handles in order.

        ``startup_timeout`` as :func:`spawn_peer` (``None``: while each child is alive)."""
        for n in names:
            if n in self._handles:
                raise ValueError(f"a peer named {n!r} already exists in this cluster")
        merged = {**(self._env or {}), **(env or {})}
        started = []
        for n in names:
            h = PeerHandle(n, env=merged, start_method=self._start_method)
            self._handles[n] = h
            started.append(h)
        deadline = None if startup_timeout is None else time.monotonic() + startup_timeout
        for h in started:
            h._wait_ready(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return started

    def __getitem__(self, name: str) -> PeerHandle:
        return self._handles[name]

    def __iter__(self) -> Iterator[PeerHandle]:
        return iter(list(self._handles.values()))

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def names(self) -> list[str]:
        return list(self._handles)

    def close(self, timeout: float | None = None) -> None:
        """Stop every peer concurrently (graceful, then SIGKILL after ``timeout``) and reap it."""
        deadline = time.monotonic() + (self._close_timeout if timeout is None else timeout)
        live = [h for h in self._handles.values() if not h._released]
        for h in live:
            h._request_stop()
        for h in live:
            h._finish_close(deadline)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


@contextmanager
def peers(*names: str, env: Mapping[str, str | None] | None = None, start_method: StartMethod = "spawn",
          startup_timeout: float | None = _DEFAULT_STARTUP_TIMEOUT,
          close_timeout: float = _REAP_TIMEOUT) -> Iterator[Cluster]:
    """``with peers("prompt", "decoder") as cluster:`` — every child is reaped at exit, even on failure."""
    cluster = Cluster(env=env, start_method=start_method, close_timeout=close_timeout)
    try:
        cluster.spawn(*names, startup_timeout=startup_timeout)
        yield cluster
    finally:
        cluster.close()


def _reap_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for h in live:
        h.kill(1.0)


# registered after multiprocessing's own hook, so it runs first (atexit is LIFO) and a stalled
# non-daemon child cannot make interpreter exit hang in multiprocessing's join
atexit.register(_reap_all_at_exit)
