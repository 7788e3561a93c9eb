"""The shipped conformance suite against the ucx transport, for UCX's default transport choice
(cma between processes of this host, shm/self in-process) and for ``UCX_TLS=tcp``.

UCX reads ``UCX_TLS`` when a context is created; the plugin applies ``llmdd.ucx.tls`` around
its agent's creation only, so both variants run in this one process.
"""

from __future__ import annotations

import functools

import pytest

from llmdd.testing import CONFORMANCE_CHECKS, run_check
from llmdd_ucx import UcxTransport

_INFO = UcxTransport.probe()
pytestmark = pytest.mark.skipif(not _INFO.available, reason=f"ucx transport unavailable: {_INFO.reason}")

TLS = {"default": "", "tcp": "tcp"}


def _options(tls: str) -> dict:
    return {"llmdd.ucx.tls": tls, "llm.RdmaTrafficClass": "132", "llm.RdmaServiceLevel": "3"}


def pair_factory(tls: str):
    def make_pair():
        t = UcxTransport(_options(tls))
        return t.open_endpoint(), t.open_endpoint()
    return make_pair


@pytest.mark.parametrize("tls", list(TLS), ids=lambda t: f"UCX_TLS={t}")
@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance(check, tls):
    # check_deadline runs without a stall hook: one-sided UCX has no server loop to stall;
    # a deadline that passes with requests in flight is covered in test_ucx.py
    run_check(check, pair_factory(TLS[tls]), transport=functools.partial(UcxTransport, _options(TLS[tls])))
