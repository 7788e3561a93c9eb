"""The child side of the multi-process test harness: the command loop a peer runs, and checkpoints.

The parent side is :mod:`llmdd.testing._harness` (its docstring describes calls, faults and
checkpoints); what crosses the pipe is in :mod:`llmdd.testing._calls`.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Mapping, Optional

from llmdd.testing._calls import CheckpointError, PeerCallError, _error_message, _loads_call

__all__ = ["checkpoint", "checkpoint_hits"]

# --------------------------------------------------------------------------- child side

_IN_PEER = False
_ARMED: dict[str, list[Any]] = {}  # name -> [action, remaining hits before firing]
_HITS: dict[str, int] = {}
_CP_LOCK = threading.Lock()
_CONN: Optional[Connection] = None  # the child's end of the pipe, once in a peer
_SEND_LOCK = threading.Lock()  # checkpoints may fire in any thread of the child


def _send(msg: tuple[Any, ...]) -> None:
    conn = _CONN
    assert conn is not None, "_send outside a peer"   # only the peer's own code sends (_IN_PEER)
    with _SEND_LOCK:
        conn.send(msg)


def checkpoint(name: str) -> None:
    """Mark a named point in code that may run inside a peer.

    Outside a peer, or when ``name`` is not armed, this only counts the hit (cheap).  When the
    parent armed ``name`` with :meth:`PeerHandle.arm`, the child SIGKILLs itself (``"kill"``),
    SIGSTOPs itself until :meth:`PeerHandle.resume` (``"stall"``), or raises
    :class:`CheckpointError` (``"raise"``) on the armed hit.  An armed checkpoint fires once.
    """
    with _CP_LOCK:
        _HITS[name] = _HITS.get(name, 0) + 1
        entry = _ARMED.get(name)
        if entry is None or not _IN_PEER:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _ARMED[name]
        action = entry[0]
    try:
        _send(("fired", name, action))  # before acting: the parent learns the fault fired
    except OSError:
        pass
    if action == "kill":
        _flush_stdio()
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stall":
        _flush_stdio()
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise CheckpointError(f"checkpoint {name!r} armed to raise")


def checkpoint_hits(state: dict[str, Any]) -> dict[str, int]:
    """Peer function: how many times each checkpoint was reached in this child so far."""
    with _CP_LOCK:
        return dict(_HITS)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or odd stream must not prevent the fault
            pass



def _peer_main(conn: Connection, name: str, env: Mapping[str, str | None] | None) -> None:
    """Entry point of the child: apply env, then serve the command loop until stop or EOF."""
    global _IN_PEER, _CONN
    _IN_PEER = True
    _CONN = conn
    faulthandler.enable()
    if env:  # already applied at spawn for spawn/fork; this covers forkserver
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    state: dict[str, Any] = {"peer_name": name}
    _send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "arm":
            _, cp_name, action, nth = msg
            with _CP_LOCK:
                _ARMED[cp_name] = [action, nth]
            continue
        if kind == "disarm":
            with _CP_LOCK:
                if msg[1] is None:
                    _ARMED.clear()
                else:
                    _ARMED.pop(msg[1], None)
            continue
        # kind == "call"
        _, cid, payload = msg
        try:
            fn, args, kwargs = _loads_call(payload)
        except BaseException as exc:  # module not importable here, etc.
            reply = _error_message(cid, PeerCallError(f"cannot load the call in peer {name!r}: {exc!r}"))
        else:
            try:
                value = fn(state, *args, **kwargs)
            except BaseException as exc:  # everything goes back to the parent, even SystemExit
                reply = _error_message(cid, exc)
            else:
                try:
                    reply = ("ok", cid, pickle.dumps(value))
                except Exception as exc:
                    reply = _error_message(cid, PeerCallError(
                        f"result of {getattr(fn, '__qualname__', fn)!r} is not picklable: {exc!r}"))
        try:
            _send(reply)
        except (BrokenPipeError, OSError):
            return
