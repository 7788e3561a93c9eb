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
