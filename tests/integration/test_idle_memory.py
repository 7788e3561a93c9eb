"""Idle engine memory (issue 22, target 5), measured for real in fresh processes (bench/probes/idle_rss.py).

* an idle engine loads neither structlog nor asyncio (the logging shim imports structlog at the first
  enabled log line; control: one warning line does load it);
* an idle engine loads no numpy, with every plugin (llmdd._base.lazy; control: the first read of a numpy
  constant loads it);
* the whole process stays within 45 MiB RSS (median of 3 fresh interpreters);
* a link costs the server at most 64 KiB of RSS, over 16 links from synthetic clients that speak the
  real protocol (llmdd._tools.bench.scaling).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "probes" / "idle_rss.py"
_spec = importlib.util.spec_from_file_location("llmdd_bench_idle_rss", _BENCH)
idle_rss = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(idle_rss)

MiB = 1 << 20
KiB = 1 << 10

pytestmark = pytest.mark.timeout(240)


def test_idle_engine_loads_no_structlog_until_a_line_is_written():
    idle = idle_rss.measure_idle()
    assert idle["rss_idle"] > idle["rss_after_import"] > idle["rss_start"] > 0  # it measured
    assert not idle["structlog_loaded"] and not idle["asyncio_loaded"]
    # control: the first line at an enabled level (WARNING, the default) imports structlog and is written
    script = textwrap.dedent("""
        import json, logging, sys
        import llmdd
        from llmdd._base.log import get_logger
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("llmdd").addHandler(handler)
        log = get_logger("llmdd.test")
        log.debug("llmdd.test.quiet", n=1)            # disabled level: nothing built, nothing written
        before = "structlog" in sys.modules
        log.warning("llmdd.test.loud", n=2)
        print(json.dumps({"before": before, "after": "structlog" in sys.modules,
                          "messages": [r.getMessage() for r in records]}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"before": False, "after": True, "messages": ["llmdd.test.loud n=2"]}


def test_an_idle_engine_loads_no_numpy_until_its_first_use():
    # llmdd and every plugin (shm, tcp, ucx, faults, metrics) take numpy through llmdd._base.lazy;
    # control: in the same child, the first read of a numpy constant (OP_DTYPE) loads it
    idle = idle_rss.measure_idle({"LLMDD_IDLE_FIRST_USE": "1"})
    assert idle["rss_idle"] > 0 and {"shm", "tcp"} <= set(idle["plugins"])
    assert not idle["numpy_loaded"]
    assert idle["numpy_after_first_use"] and idle["op_dtype_itemsize"] == 32


def test_idle_engine_rss_within_45_mib():
    runs = sorted(idle_rss.measure_idle()["rss_idle"] for _ in range(3))
    assert runs[1] <= 45 * MiB, f"idle engine RSS {runs[1] / MiB:.1f} MiB"


def test_rss_per_link_within_64_kib_over_16_links():
    link = idle_rss.measure_per_link(16)
    assert link["client_errors"] == []
    assert link["links_to"] - link["links_from"] == 16
    assert link["rss_to"] > 0 and link["rss_from"] > 0
    assert link["rss_per_link_bytes"] <= 64 * KiB, f"{link['rss_per_link_bytes'] / KiB:.1f} KiB per link"
