"""TLS settings of links (issue 14, item 2): TLS without a CA is refused at init unless
``llmdd.tls_insecure`` says so, and a client checks the server certificate's name when a name is
given (``llmdd.tls_server_name``).  Real processes over loopback; certificates made with the
openssl CLI (its absence fails the test under CI, where .ci installs it, and skips it elsewhere).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llmdd import LLMException, LLMStatusCode
from llmdd.testing._harness import peers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peers as P  # noqa: E402

S = LLMStatusCode
HOST = "127.0.0.1"
ENV = {"LLMDD_AUTH_SECRET": None}
NAME = "llmdd-node.test"

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    openssl = shutil.which("openssl")
    if openssl is None:
        if os.environ.get("CI"):
            pytest.fail("the TLS tests need the openssl CLI, which CI must install")
        pytest.skip("the TLS tests need the openssl CLI")
    d = tmp_path_factory.mktemp("tls_settings")

    def run(*args):
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=llmdd-settings-ca")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", f"/CN={NAME}")
    (d / "ext.cnf").write_text(f"basicConstraints=CA:FALSE\nsubjectAltName=DNS:{NAME},IP:127.0.0.1\n"
                               "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf")
    return {"llmdd.tls_cert": str(d / "node.pem"), "llmdd.tls_key": str(d / "node.key"),
            "ca": str(d / "ca.pem")}


def _cert_only(certs) -> dict:
    return {"llmdd.tls_cert": certs["llmdd.tls_cert"], "llmdd.tls_key": certs["llmdd.tls_key"]}


def _mutual(certs, **more) -> dict:
    return dict(_cert_only(certs), **{"llmdd.tls_ca": certs["ca"]}, **more)


def _pull_ok(client, remote_id: int, seed: int) -> None:
    assert client.call(P.pull, remote_id, [1], [0])[0] == "LLM_SUCCESS"
    np.testing.assert_array_equal(client.call(P.blocks)[:, 0], P.pattern(remote_id, seed)[:, 1])


def test_tls_without_a_ca_is_refused_at_init_unless_insecure_is_explicit(certs):
    with peers("p", "d", env=ENV) as c:
        for extra in (_cert_only(certs), dict(_cert_only(certs), **{"llmdd.tls_insecure": "0"})):
            with pytest.raises(LLMException) as refused:
                c["p"].call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=extra)
            assert refused.value.status_code == S.LLM_PARAM_INVALID, refused.value
            assert "llmdd.tls_insecure" in str(refused.value) and "llmdd.tls_ca" in str(refused.value)
        # a name to check needs a CA to check it with
        with pytest.raises(LLMException) as refused:
            c["d"].call(P.start, "DECODER", 2, extra=dict(_cert_only(certs), **{"llmdd.tls_insecure": "1",
                                                                              "llmdd.tls_server_name": NAME}))
        assert refused.value.status_code == S.LLM_PARAM_INVALID
        # the explicit opt-out: both sides come up and a link works (encrypted, unverified)
        insecure = dict(_cert_only(certs), **{"llmdd.tls_insecure": "1"})
        port = c["p"].call(P.start, "PROMPT", 1, f"{HOST}:0", seed=1, extra=insecure)
        c["d"].call(P.start, "DECODER", 2, extra=insecure)
        assert c["d"].call(P.link, [(1, HOST, port)], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_ok(c["d"], 1, 1)


def test_client_checks_the_server_certificate_name_when_one_is_given(certs):
    with peers("p", "right", "wrong", "ip", env=ENV) as c:
        c["right"].call(P.capture_logs)
        port = c["p"].call(P.start, "PROMPT", 1, f"{HOST}:0", seed=3, extra=_mutual(certs))
        target = [(1, HOST, port)]
        c["wrong"].call(P.start, "DECODER", 3, extra=_mutual(certs, **{"llmdd.tls_server_name": "other.test"}))
        assert c["wrong"].call(P.link, target, 3000) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
        assert c["p"].call(P.link_states) == {}
        c["right"].call(P.start, "DECODER", 2, extra=_mutual(certs, **{"llmdd.tls_server_name": NAME}))
        assert c["right"].call(P.link, target, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        _pull_ok(c["right"], 1, 3)
        # TLS does not cover tcp data connections yet: the engine says so at run time
        assert any("llmdd.transport.data_not_tls" in line for line in c["right"].call(P.logs))
        # the certificate's IP address entry is a name too
        c["ip"].call(P.start, "DECODER", 4, extra=_mutual(certs, **{"llmdd.tls_server_name": HOST}))
        assert c["ip"].call(P.link, target, 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
