"""Deferred transport offers (issue 21, target 3): in automatic mode a client offers the transports
whose endpoints are not open yet by name only; the server probes its candidates only as far as its
policy looks; the chosen transport alone is probed and opened on each side.

Two engines in two processes over 127.0.0.1; bytes pulled and compared on the other side."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from llmdd import BlocksCacheKey

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402
import _deferred_peers as D  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster():
    from llmdd.testing._harness import Cluster

    with Cluster(env=ENV) as c:
        yield c


def _pull_and_compare(p, d, nl=2, nb=8, bs=4096):
    p.call(P.register, "src", nl, [nb, bs], blocks=True, seed=251, key=BlocksCacheKey(PROMPT, 0))
    d.call(P.register, "dst", nl, [nb, bs], blocks=True)
    d.call(P.cm, "pull_blocks", BlocksCacheKey(PROMPT, 0), P.Ref("dst"), [5, 1], [0, 7],
           src_layer_range=range(nl), dst_layer_range=range(nl), tensor_num_per_layer=1)
    src = p.call(P.snapshot, "src").reshape(nl, nb, bs)
    dst = d.call(P.snapshot, "dst").reshape(nl, nb, bs)
    assert np.array_equal(dst[:, [0, 7]], src[:, [5, 1]])
    assert not dst[:, 1:7].any()


def test_automatic_first_link_opens_and_probes_only_the_chosen_transport(cluster):
    p, d = cluster.spawn("auto-server", "auto-client")
    port = p.call(D.setup, "PROMPT", PROMPT, listen=True)
    d.call(D.setup, "DECODER", DECODER)
    before = d.call(D.transports)
    # nothing probed or opened before the first link; every registered transport offered deferred
    assert before["open"] == [] and "ucx" not in before["probed"]
    assert before["offers"] and all(desc == {"deferred": True} for desc in before["offers"].values())
    got = d.call(D.timed_link, PROMPT, port)
    assert got["status"] == ["LLM_SUCCESS", "LLM_SUCCESS"] and got["transport"] == "shm", got
    client, server = d.call(D.transports), p.call(D.transports)
    assert client["open"] == ["shm"] and server["open"] == ["shm"]
    assert "ucx" not in client["probed"] and "ucx" not in server["probed"]
    # the open endpoint is now offered with its descriptor, the others still by name
    assert "deferred" not in client["offers"]["shm"] and client["offers"]["shm"]
    assert all(desc == {"deferred": True} for name, desc in client["offers"].items() if name != "shm")
    _pull_and_compare(p, d)
    # a descriptor request on an established link is refused; the link stays up
    assert d.call(D.descriptor_request, PROMPT) != 0
    assert d.call(P.link_state, PROMPT) == "linked"


def test_forced_transport_is_offered_with_its_descriptor(cluster):
    p, d = cluster.spawn("forced-server", "forced-client")
    port = p.call(D.setup, "PROMPT", PROMPT, listen=True, transport="tcp")
    d.call(D.setup, "DECODER", DECODER, transport="tcp")
    offers = d.call(D.transports)["offers"]
    assert list(offers) == ["tcp"] and "deferred" not in offers["tcp"] and offers["tcp"]
    got = d.call(D.timed_link, PROMPT, port)
    assert got["status"] == ["LLM_SUCCESS", "LLM_SUCCESS"] and got["transport"] == "tcp", got
    _pull_and_compare(p, d)


def test_a_deferred_transport_the_client_cannot_run_is_dropped_and_the_link_retried(cluster):
    # the server can run 'unusable' and its policy picks it whenever offered; the client registered
    # it too, but its probe says it cannot run: the client must offer again without it
    p, d = cluster.spawn("fallback-server", "fallback-client")
    port = p.call(D.setup, "PROMPT", PROMPT, listen=True, fake="usable", prefer_fake=True)
    d.call(D.setup, "DECODER", DECODER, fake="unusable")
    assert "unusable" in d.call(D.transports)["offers"]          # offered by name: not probed yet
    got = d.call(D.timed_link, PROMPT, port)
    assert got["status"] == ["LLM_SUCCESS", "LLM_SUCCESS"], got
    assert got["transport"] == "shm", got                         # the server's policy fell through to shm
    after = d.call(D.transports)
    assert after["unusable"] == ["unusable"] and "unusable" not in after["offers"]
    assert "unusable" not in after["open"]
    _pull_and_compare(p, d)
    # control: the server did pick 'unusable' first (it opened that endpoint for the first Welcome),
    # and the link it keeps is the second one, on shm
    assert p.call(D.transports)["idle_endpoints_opened"] == 1
    assert p.call(P.link_info, DECODER)["transport"] == "shm"
