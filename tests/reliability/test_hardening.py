"""Regressions of the hardening issue, one named test per finding.

* registration churn on a server while clients link, pull and unlink: no deadlock, every call by
  its deadline, right bytes (the region table and memory manager never call out under a lock);
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _hardening_peers as H  # noqa: E402
import _rel_peers as R  # noqa: E402

from llmdd.testing._harness import Cluster  # noqa: E402

ENV = {"LLMDD_AUTH_SECRET": None, "LLMDD_FAULTS": None}
PROMPT, DECODER = 1, 2
NT, NB, BS = 2, 8, 4096

#: length of the churn (the whole test stays near 20 s on a 2-core machine)
CHURN_S = 12.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_registration_churn_while_clients_link_pull_and_unlink_never_deadlocks(transport):
    with Cluster(env=ENV) as cluster:
        server, client = cluster.spawn("churn_server", "churn_client")
        port = server.call(R.setup, "PROMPT", PROMPT, listen=True, transport=transport)
        server.call(R.register_blocks, "src", NT, NB, BS, seed=3, key=(PROMPT, 0))
        client.call(R.setup, "DECODER", DECODER, transport=transport)
        client.call(R.register_blocks, "dst", NT, NB, BS)
        server.call(H.churn_start, NT, NB, BS)
        try:
            out = client.call(H.link_pull_unlink_loop, PROMPT, port, CHURN_S, NT, NB, BS, 3,
                              timeout=CHURN_S + 30)
        finally:
            churn = server.call(H.churn_stop, 10.0, timeout=20)
        assert churn["joined"], f"a register/unregister call on the server never returned: {churn}"
        assert churn["rounds"] > 20, churn
        assert not churn["errors"], churn
        assert not out["over_deadline"], out
        assert out["rounds"] >= 5, out
        assert out["linked"] >= 0.8 * out["rounds"], out
        assert out["pulled"] == out["linked"], out      # the stable cache is never touched by the churn
        assert out["wrong_bytes"] == 0, out
        print(f"churn {transport}: server rounds {churn['rounds']}, client {out}")
        # the server is still healthy afterwards: a fresh link and a verified pull
        res = client.call(H.link_pull_unlink_loop, PROMPT, port, 0.01, NT, NB, BS, 3)
        assert res["pulled"] >= 1 and res["pulled"] == res["linked"] and res["wrong_bytes"] == 0, res
