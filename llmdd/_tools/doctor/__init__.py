"""The checks behind ``llmdd info`` and ``llmdd doctor``, as a library function with structured results.

:func:`collect_info` gathers what this machine runs (versions, plugins, transports and their
probes, the chip-family profile, the memory backends); :func:`run_doctor` adds a loopback
self-test of every available transport and the misconfiguration checks its arguments ask
for.  Nothing here prints or configures logging: :mod:`llmdd._tools.cli.doctor` renders the results.

Every check ends in a :class:`Check` (``ok``, ``warn``, ``fail`` or ``skip``) with a message in
plain words and, for a problem, the fix.  A check never raises: an unexpected error becomes a
failed check carrying its reason.

The package: :mod:`.report` (results), :mod:`.util`, :mod:`.info`, :mod:`.selftest`,
:mod:`.config` (configuration checks), :mod:`.peer` (peer and engine checks), :mod:`.run`.

Helper processes (a fresh ``python -c`` interpreter talking JSON lines over its stdin/stdout;
never fork, since the parent may run threads; not ``multiprocessing`` spawn, which re-imports
the parent's ``__main__``):

* the peer check (``--peer``) links from a fresh :class:`llmdd.LLMDataDist` engine in a child,
  because an engine is one per process and the caller may already run one;
* a transport's self-test runs in one process (two endpoints) unless that fails for a
  same-host-only transport, which is then retried with the region owned by a child process
  (``processes="two"`` forces that).
"""

from __future__ import annotations

from llmdd._tools.doctor.config import (
    check_cross_memory_attach,
    check_dev_shm,
    check_listen,
    check_pools,
    check_shm_leftovers,
)
from llmdd._tools.doctor.info import collect_info
from llmdd._tools.doctor.peer import check_engine, check_peer
from llmdd._tools.doctor.report import Check, DoctorReport, SelfTestResult, report_json
from llmdd._tools.doctor.run import NO_TRANSPORT_FIX, no_transport_message, run_doctor
from llmdd._tools.doctor.selftest import self_test
from llmdd._tools.doctor.util import (
    FAIL,
    OK,
    SELF_TEST_BYTES,
    SELF_TEST_OP_BYTES,
    SKIP,
    WARN,
    format_bytes,
    local_ipv4_addresses,
    parse_size,
)

__all__ = [
    "Check",
    "SelfTestResult",
    "DoctorReport",
    "collect_info",
    "run_doctor",
    "self_test",
    "check_listen",
    "check_pools",
    "check_dev_shm",
    "check_shm_leftovers",
    "check_cross_memory_attach",
    "check_peer",
    "check_engine",
    "local_ipv4_addresses",
    "parse_size",
    "format_bytes",
    "report_json",
    "SELF_TEST_BYTES",
    "SELF_TEST_OP_BYTES",
    "OK",
    "WARN",
    "FAIL",
    "SKIP",
    "NO_TRANSPORT_FIX",
    "no_transport_message",
]
