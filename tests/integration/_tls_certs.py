"""Certificates for the TLS tests: from the trustme package (the test extra installs it), else from
the openssl CLI.  With neither, the test FAILS under CI (env ``CI`` set: CI must be able to run every
TLS test) and skips, saying why, elsewhere.

``make_certs(directory)`` writes and returns the paths of

* ``ca.pem``: a CA; ``node.pem`` / ``node.key``: a certificate it signed for ``127.0.0.1`` and
  ``NODE_NAME`` (server and client use);
* ``rogue.pem`` / ``rogue.key``: an unrelated self-signed CA, whose own key serves as a certificate
  nobody trusts; ``rogue_node.pem`` / ``rogue_node.key``: a node certificate that rogue CA signed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

NODE_NAME = "llmdd-node.test"
FILES = ("ca.pem", "node.pem", "node.key", "rogue.pem", "rogue.key", "rogue_node.pem", "rogue_node.key")


def _missing(why: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the TLS tests need certificates and {why}; CI must provide trustme (the test extra) "
                    "or the openssl CLI", pytrace=False)
    pytest.skip(f"the TLS tests need certificates and {why}")


def make_certs(directory) -> dict:
    d = pathlib.Path(directory)
    try:
        import trustme
    except ImportError:
        trustme = None
    if trustme is not None:
        _with_trustme(trustme, d)
    elif shutil.which("openssl"):
        _with_openssl(shutil.which("openssl"), d)
    else:
        _missing("neither the trustme package nor the openssl CLI is installed")
    out = {name: str(d / name) for name in FILES}
    assert all(os.path.getsize(p) > 0 for p in out.values()), out
    return out


def _with_trustme(trustme, d: pathlib.Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    node = ca.issue_cert("127.0.0.1", NODE_NAME)
    node.cert_chain_pems[0].write_to_path(str(d / "node.pem"))
    node.private_key_pem.write_to_path(str(d / "node.key"))
    rogue = trustme.CA()
    rogue.cert_pem.write_to_path(str(d / "rogue.pem"))
    rogue.private_key_pem.write_to_path(str(d / "rogue.key"))
    rogue_node = rogue.issue_cert("127.0.0.1", NODE_NAME)
    rogue_node.cert_chain_pems[0].write_to_path(str(d / "rogue_node.pem"))
    rogue_node.private_key_pem.write_to_path(str(d / "rogue_node.key"))


def _with_openssl(openssl: str, d: pathlib.Path) -> None:
    def run(*args):
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (d / "ext.cnf").write_text(f"basicConstraints=CA:FALSE\nsubjectAltName=DNS:{NODE_NAME},IP:127.0.0.1\n"
                               "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    for ca, node in (("ca", "node"), ("rogue", "rogue_node")):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=llmdd-{ca}")
        run("req", *ec, "-keyout", f"{node}.key", "-out", f"{node}.csr", "-subj", f"/CN={NODE_NAME}")
        run("x509", "-req", "-in", f"{node}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{node}.pem", "-days", "2", "-extfile", "ext.cnf")
