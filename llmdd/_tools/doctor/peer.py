"""Checks that need a peer or an engine: a link from a fresh engine in a helper process, a running engine."""

from __future__ import annotations

import secrets
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from llmdd._tools.doctor.config import _parse_addr
from llmdd._tools.doctor.report import Check
from llmdd._tools.doctor.child import _Child, _describe_error
from llmdd._tools.doctor.util import _CHILD_TIMEOUT_S, FAIL, OK, WARN

if TYPE_CHECKING:
    from llmdd._api.datadist import LLMDataDist


def _route_source(host: str, port: int) -> str:
    """The local address this machine would use to reach ``host:port`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _link_outcome(host: str, port: int, secret: Optional[str], timeout_ms: int) -> dict:
    """In a helper process: link a fresh client engine to ``host:port``; return the outcome."""
    import logging

    outcome: dict = {"status": None, "error": None, "transport": None}
    errors: list[str] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "llmdd", None) or {}
            if fields.get("event") == "llmdd.link.failed":
                errors.append(str(fields.get("error", "")))

    handler = _Capture(logging.WARNING)
    link_logger = logging.getLogger("llmdd.link")
    link_logger.addHandler(handler)
    if link_logger.getEffectiveLevel() > logging.WARNING:
        link_logger.setLevel(logging.WARNING)
    dd = None
    try:
        from llmdd import LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole

        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.local_comm_res = ""
        options = dict(cfg.generate_options())
        if secret is not None:
            options["llmdd.auth_secret"] = secret
        options["llmdd.reclaim_leftover_shm"] = "0"  # leftovers are the shm_leftovers check's business
        dd = LLMDataDist(LLMRole.DECODER, secrets.randbits(62))
        dd.init(options)
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 0
        cluster.append_local_ip_info(_route_source(host, port), 0)
        cluster.append_remote_ip_info(host, port)
        status, _ = dd.link_clusters([cluster], timeout_ms)
        outcome["status"] = status.name
        links = dd.statistics().get("links") or {}
        for link in links.values():
            outcome["transport"] = link.get("transport")
        outcome["error"] = errors[-1] if errors else None
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        outcome["error"] = _describe_error(exc)
    finally:
        if dd is not None:
            try:
                dd.finalize()
            except Exception:  # noqa: BLE001
                pass
        link_logger.removeHandler(handler)
    return outcome


def check_peer(peer: str, secret: Optional[str] = None, timeout: float = 5.0) -> Check:
    """Link to the server at ``peer`` from a fresh engine (a child process), with ``secret`` when given.

    Without ``secret`` the engine behaves as a default one: ``LLMDD_AUTH_SECRET`` applies.
    """
    name = "secret" if secret is not None else "peer"
    addr, bad = _parse_addr(name, peer)
    if bad is not None:
        return bad
    assert addr is not None
    host, port = addr
    timeout_ms = max(1, int(timeout * 1000))
    started = time.monotonic()
    try:
        child = _Child({"op": "link", "host": host, "port": port, "secret": secret, "timeout_ms": timeout_ms})
    except OSError as exc:
        return Check(name=name, status=FAIL, message=f"cannot start the link test process: {_describe_error(exc)}",
                     fix=f"check that {sys.executable} can be run")
    try:
        outcome = child.recv(timeout + _CHILD_TIMEOUT_S)
        if outcome is None:
            return Check(name=name, status=FAIL, message=f"the link test to {host}:{port} did not finish: "
                                                         f"{child.failure()}",
                         fix="check that the server is running and reachable")
    finally:
        child.close()
    took = time.monotonic() - started
    details = {"host": host, "port": port, "status": outcome.get("status"), "error": outcome.get("error"),
               "transport": outcome.get("transport"), "secret_given": secret is not None, "seconds": round(took, 3)}
    if outcome.get("status") == "LLM_SUCCESS":
        via = f" over {outcome['transport']}" if outcome.get("transport") else ""
        what = "the server accepted the secret" if secret is not None else "linked"
        return Check(name=name, status=OK, message=f"{host}:{port}: {what}{via}", details=details)
    error = outcome.get("error") or f"link_clusters returned {outcome.get('status')}"
    low = error.lower()
    if "requires authentication" in low:
        return Check(name=name, status=FAIL,
                     message=f"the server at {host}:{port} requires a secret and none was given",
                     fix="pass --secret with the server's llmdd.auth_secret (or set LLMDD_AUTH_SECRET)",
                     details=details)
    if "did not authenticate" in low:
        return Check(name=name, status=FAIL,
                     message=f"the server at {host}:{port} has no secret configured, so it cannot prove it "
                             f"knows ours; llmdd refuses such a link",
                     fix="set llmdd.auth_secret on the server too, or link without a secret",
                     details=details)
    if "authentic" in low:
        return Check(name=name, status=FAIL,
                     message=f"the server refused the secret: {host}:{port} uses another llmdd.auth_secret",
                     fix="use the same llmdd.auth_secret (or LLMDD_AUTH_SECRET) on both sides",
                     details=details)
    if "cannot connect" in low:
        return Check(name=name, status=FAIL, message=f"cannot reach a server at {host}:{port}: "
                                                     f"{error.split(': ', 1)[-1]}",
                     fix="check that the server engine is running with llm.listenIpInfo set to this address, "
                         "and that no firewall is in the way",
                     details=details)
    return Check(name=name, status=FAIL, message=f"the link to {host}:{port} failed: {error}",
                 fix="run with -vv to see the engine's log", details=details)


def check_engine(engine: Optional[LLMDataDist] = None) -> list[Check]:
    """The listeners of the engine living in this process (``engine`` or the initialized one):
    a listener that could not continue is a failed check saying why.  Nothing when no engine
    lives here (``llmdd doctor`` in its own process reports the engines it links to with --peer)."""
    if engine is None:
        from llmdd._api.datadist import LLMDataDist

        engine = LLMDataDist.llm_engine_instance
    core = getattr(engine, "_core", None)
    lm = getattr(core, "link_manager", None)
    if lm is None:
        return []
    try:
        io = lm.io_statistics()
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return [Check(name="engine", status=FAIL, message=f"cannot read the engine's state: {exc!r}")]
    checks = []
    if io.get("io_error"):
        checks.append(Check(name="engine", status=FAIL,
                            message=f"the engine's I/O loop stopped: {io['io_error']}; its links failed",
                            fix="finalize and init the engine again", details=io))
    for lst in io.get("listeners", []):
        if lst["state"] == "failed":
            checks.append(Check(name="listener", status=FAIL,
                                message=f"the {lst['kind']} listener on {lst['address']} cannot continue: "
                                        f"{lst['error']}; no link can reach it",
                                fix="check the process's descriptor and thread limits (ulimit -n, pids.max), "
                                    "then switch_role or finalize and init again to listen anew",
                                details=lst))
        elif lst["state"] == "listening":
            refused = lst["refused"] + lst["accept_errors"]
            checks.append(Check(name="listener", status=WARN if lst["accept_errors"] else OK,
                                message=f"the {lst['kind']} listener on {lst['address']} is listening "
                                        f"({lst['accepted']} accepted, {refused} refused or failed)",
                                details=lst))
    return checks
