"""The shipped conformance suite against the tcp transport, one test per check."""

from __future__ import annotations

import contextlib
import functools
import threading

import pytest

from llmdd.testing import CONFORMANCE_CHECKS, run_check
from llmdd_tcp import TcpTransport


def make_pair():
    t = TcpTransport({"llm.RdmaTrafficClass": "132"})
    return t.open_endpoint(host="127.0.0.1"), t.open_endpoint(host="127.0.0.1")


def make_pair_with_secret():
    t = TcpTransport({})
    return t.open_endpoint(secret=b"s3cret"), t.open_endpoint(secret=b"s3cret")


@contextlib.contextmanager
def stall(endpoint):
    """While inside, ``endpoint`` accepts requests but serves none (a hung peer): its Python serving and
    its C path's (a request waits unread in the stream)."""
    release = threading.Event()
    originals = {name: getattr(endpoint, name) for name in ("_serve_request", "_serve_native")}

    def stalling(original):
        def stalled(*args):
            release.wait()
            return original(*args)
        return stalled

    for name, original in originals.items():
        setattr(endpoint, name, stalling(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(endpoint, name, original)
        release.set()


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance(check):
    run_check(check, make_pair, stall=stall, transport=functools.partial(TcpTransport, {}))


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS[:2], ids=lambda c: c.__name__)
def test_conformance_authenticated(check):
    run_check(check, make_pair_with_secret)


# ---------------------------------------------------------------------- controls of check_prepared

class _Endpoint:
    """An endpoint whose channels' prepared transfers are bent by ``bend(inner_prepared)``."""

    def __init__(self, inner, bend) -> None:
        self._inner, self._bend = inner, bend

    def connect(self, peer, *, timeout):
        ch = self._inner.connect(peer, timeout=timeout)
        inner_prepare, bend = ch.prepare, self._bend

        def prepare(*args, **kwargs):
            got = inner_prepare(*args, **kwargs)
            return None if got is None else bend(got)
        ch.prepare = prepare
        return ch

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _bent_pair(bend):
    a, b = make_pair()
    return _Endpoint(a, bend), b


def _lies(prepared):
    """Says it moved the blocks, moves nothing."""
    return lambda src, dst: 2 * len(dst) * 4096


def _never_declines(prepared):
    """Moves while current, and reports success when its tables went stale."""
    return lambda src, dst: max(prepared(src, dst), 0)


@pytest.mark.parametrize("bend, message", [(_lies, "landed different bytes"), (_never_declines, "must decline")],
                         ids=["moves_nothing", "never_declines"])
def test_check_prepared_fails_a_prepared_path_that_breaks_the_seam(bend, message):
    """Controls: the check fails a prepared transfer that reports bytes it did not move, and one that
    does not decline once its tables went stale; the unbent transport passes (test_conformance)."""
    check = next(c for c in CONFORMANCE_CHECKS if c.__name__ == "check_prepared")
    with pytest.raises(AssertionError, match=message):
        check(functools.partial(_bent_pair, bend))
