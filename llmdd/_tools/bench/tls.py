"""The ``tcp+tls`` row of ``llmdd bench``: the tcp transport with ``llmdd.tls_*`` set, so that control
and data connections are TLS (mutual, verified against a CA), measured like any transport.

The bench makes a throwaway CA and one node certificate for ``127.0.0.1`` (both sides use it) in a
private temporary directory, with the trustme package when it is installed, else the openssl CLI;
with neither the row fails with that reason (recorded in ``errors``, the other rows still run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

#: rows measured on request only (``--transport NAME``): a transport under other settings
VARIANTS = {"tcp+tls": "tcp"}


class TlsFiles:
    """A CA and a node certificate in a temporary directory, removed with this object."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="llmdd-bench-tls-")
        d = self._dir.name
        try:
            import trustme
        except ImportError:
            trustme = None
        if trustme is not None:
            ca = trustme.CA()
            ca.cert_pem.write_to_path(os.path.join(d, "ca.pem"))
            node = ca.issue_cert("127.0.0.1")
            node.cert_chain_pems[0].write_to_path(os.path.join(d, "node.pem"))
            node.private_key_pem.write_to_path(os.path.join(d, "node.key"))
        elif shutil.which("openssl"):
            _openssl(shutil.which("openssl"), d)
        else:
            self._dir.cleanup()
            raise RuntimeError("the tcp+tls row needs a certificate: install the trustme package or the openssl CLI")
        self.options = {"llmdd.tls_cert": os.path.join(d, "node.pem"), "llmdd.tls_key": os.path.join(d, "node.key"),
                        "llmdd.tls_ca": os.path.join(d, "ca.pem")}


def _openssl(openssl: str, d: str) -> None:
    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n"
                "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=llmdd-bench-ca")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "node.pem", "-days", "2", "-extfile", "ext.cnf")
