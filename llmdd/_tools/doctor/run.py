"""``run_doctor``: every check its arguments ask for, and the self-test of every available transport."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

from llmdd._tools.doctor.config import (
    check_cross_memory_attach,
    check_dev_shm,
    check_listen,
    check_pools,
    check_shm_leftovers,
)
from llmdd._tools.doctor.info import _plugin_manager, collect_info
from llmdd._tools.doctor.peer import check_engine, check_peer
from llmdd._tools.doctor.report import Check, DoctorReport, SelfTestResult
from llmdd._tools.doctor.selftest import self_test
from llmdd._tools.doctor.util import FAIL, OK, SKIP, WARN


def run_doctor(*, profile: str = "generic", seconds: float = 3.0, listen: Optional[str] = None,
               secret: Optional[str] = None, peer: Optional[str] = None, mem_pool_cfg: Optional[str] = None,
               host_mem_pool_cfg: Optional[str] = None, register_bytes: Optional[int] = None,
               peer_timeout: float = 5.0, processes: str = "auto", reclaim_shm: bool = False,
               progress: Optional[Callable[[str, Any], None]] = None) -> DoctorReport:
    """Everything :func:`collect_info` reports, a self-test per available transport, and the
    checks the arguments ask for.  ``seconds <= 0`` skips the self-tests.  Crash leftovers in
    /dev/shm are listed first (removed with ``reclaim_shm``), before anything here creates an engine.

    ``progress(kind, item)``, when given, sees each part as soon as it is known, in report order:
    ``("info", dict)`` once, then per self-test ``("start", "self-test <name>")`` and
    ``("selftest", SelfTestResult)``, then every :class:`Check` of the report as ``("check", Check)``
    (a slow one announced by a ``("start", what)`` first).  What it raises propagates."""
    def note(kind: str, item: object) -> None:
        if progress is not None:
            progress(kind, item)

    checks: list[Check] = []
    shown = 0

    def flush() -> None:   # report the checks found so far, in order
        nonlocal shown
        while shown < len(checks):
            note("check", checks[shown])
            shown += 1

    checks.append(check_shm_leftovers(reclaim_shm))
    note("start", "plugins and transports")
    info = collect_info(profile)
    note("info", info)
    plugins_error = info["plugins"]["error"]
    if plugins_error:
        checks.append(Check(name="plugins", status=FAIL, message=f"the plugins could not be loaded: {plugins_error}",
                            fix="reinstall or fix the plugin, or block it with LLMDD_DISABLED_PLUGINS=<name>"))
    available = [t["name"] for t in info["transports"] if t["available"]]
    if not plugins_error:
        if available:
            checks.append(Check(name="transports", status=OK, message=f"available: {', '.join(available)}"))
            # an installed transport that cannot run here: why, and its fix where the plugin names one
            for t in info["transports"]:
                if not t["available"]:
                    checks.append(Check(name=f"transport {t['name']}", status=WARN,
                                        message=f"installed but unavailable: {t['reason'] or 'no reason given'}",
                                        fix=str(t["details"].get("fix") or "see `llmdd info` and docs/transports.md")))
        else:
            checks.append(Check(name="transports", status=FAIL, message=no_transport_message(info["transports"]),
                                fix=NO_TRANSPORT_FIX))
    selftests: list[SelfTestResult] = []
    if seconds > 0 and available:
        try:
            _, registry = _plugin_manager()
        except Exception as exc:  # noqa: BLE001 - loaded a moment ago; reported, never raised
            checks.append(Check(name="plugins", status=FAIL, message=f"the plugins could not be loaded: {exc}"))
        else:
            for name in available:
                note("start", f"self-test {name}")
                selftests.append(self_test(name, seconds, registry=registry, processes=processes))
                note("selftest", selftests[-1])
    flush()
    cma = check_cross_memory_attach(info["transports"])
    if cma is not None:
        checks.append(cma)
    if listen is not None:
        note("start", f"listen address {listen}")
        checks.extend(check_listen(listen))
    if secret is not None and peer is None:
        checks.append(Check(name="secret", status=SKIP,
                            message="--secret is only tested against a server: pass --peer ip:port too"))
    flush()
    if peer is not None:
        note("start", f"link to {peer}")
        checks.append(check_peer(peer, secret, peer_timeout))
        flush()
    note("start", "memory pools and /dev/shm")
    pool_checks, pool_bytes = check_pools(mem_pool_cfg, host_mem_pool_cfg, register_bytes, profile)
    checks.extend(pool_checks)
    checks.append(check_dev_shm(pool_bytes))
    checks.extend(check_engine())
    flush()
    return DoctorReport(info=info, selftests=selftests, checks=checks)


NO_TRANSPORT_FIX = ("pip install llmdd brings the standard transports (llmdd-transport-shm, "
                    "llmdd-transport-tcp): reinstall it, or pip install llmdd-transport-tcp llmdd-transport-shm")


def no_transport_message(transports: Sequence[Mapping[str, Any]]) -> str:
    """Why no transport is available, from :func:`collect_info`'s ``transports``."""
    from llmdd._extension.manager import ENV_DISABLE_AUTOLOAD, ENV_DISABLED_PLUGINS

    if not transports:
        disabled = os.environ.get(ENV_DISABLED_PLUGINS, "")
        blocked = f" ({ENV_DISABLED_PLUGINS}={disabled})" if disabled else ""
        autoload = f" ({ENV_DISABLE_AUTOLOAD} is set)" if os.environ.get(ENV_DISABLE_AUTOLOAD) else ""
        return f"no transport is available here: no transport plugin is installed or loaded{blocked}{autoload}"
    why = "; ".join(f"{t['name']}: {t.get('reason') or 'unavailable'}" for t in transports)
    return f"no transport is available here ({why})"
