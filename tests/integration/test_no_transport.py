"""With no transport available, a link failure says so and how to fix it (issue 24), on either side.

Real processes over loopback: one engine has every transport plugin disabled
(``LLMDD_DISABLED_PLUGINS``), the other has its usual ones; the log line of the failed
``link_clusters`` carries the library's error text.  The control pair (both with transports)
links and pulls the server's bytes.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from llmdd import LLMStatusCode
from llmdd.testing._harness import free_port, peers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402  (children load it from its file: see the harness)

HOST = "127.0.0.1"
BASE = {"LLMDD_AUTH_SECRET": None, "LLMDD_DISABLED_PLUGINS": None}
NONE = dict(BASE, LLMDD_DISABLED_PLUGINS="shm,tcp,ucx")

pytestmark = pytest.mark.timeout(90)


def link_and_capture(state: dict, targets: list, timeout: int = 3000) -> tuple:
    """``link_clusters`` (in the peer) with its llmdd log captured: ``(status, codes, [error texts])``."""
    from llmdd.testing import capture_log_output

    with capture_log_output() as out:
        status, codes = P.link(state, targets, timeout)
    return status.name, [c.name for c in codes], [e.get("error", "") for e in out.events("llmdd.link.failed")]


@pytest.mark.parametrize("side", ["client", "server"])
def test_link_failure_names_the_missing_transport_and_the_fix(side):
    port = free_port()
    server_env, client_env = (BASE, NONE) if side == "client" else (NONE, BASE)
    with peers("s", env=server_env) as (s,), peers("c", env=client_env) as (c,):
        assert s.call(P.start, "PROMPT", 11, f"{HOST}:{port}", seed=5) == port
        c.call(P.start, "DECODER", 12, key=False)
        status, codes, errors = c.call(link_and_capture, [(11, HOST, port)])
    assert status == "LLM_LINK_FAILED" and codes == ["LLM_LINK_FAILED"], (status, codes, errors)
    [error] = errors
    assert "no transport is available in this process" in error, error
    assert "pip install llmdd brings llmdd-transport-shm and llmdd-transport-tcp" in error, error
    if side == "server":
        assert "the server: no transport" in error, error   # the server's refusal, relayed
    else:
        assert error.startswith(f"cannot link to {HOST}:{port}"), error


def test_control_both_sides_with_transports_link_and_pull():
    port = free_port()
    with peers("s", "c", env=BASE) as (s, c):
        assert s.call(P.start, "PROMPT", 21, f"{HOST}:{port}", seed=9) == port
        c.call(P.start, "DECODER", 22, key=False)
        status, codes, errors = c.call(link_and_capture, [(21, HOST, port)])
        assert (status, codes, errors) == ("LLM_SUCCESS", ["LLM_SUCCESS"], [])
        status, _ = c.call(P.pull, 21, [0, 1, 3], [0, 1, 2])
        assert status == LLMStatusCode.LLM_SUCCESS.name, status
        got = c.call(P.blocks)
    assert np.array_equal(got[:, :3], P.pattern(21, 9)[:, [0, 1, 3]])   # the server's bytes
    assert np.array_equal(got[:, 3], P.pattern(22, 0)[:, 3])             # a block not pulled: untouched
