"""Idle engine memory for ``llmdd bench`` and bench/probes/idle_rss.py (issue 22, target 5).

An idle engine is measured in a fresh interpreter that does nothing else: it imports llmdd, builds
an engine as the bench worker does (cache manager on, remote cache access on, listening on loopback,
optionally one forced transport), inits it, collects, and reads its RSS from /proc/self/statm.  The
bench worker's own RSS is no idle engine: it imports numpy, the bench helpers and the profiler
before it makes one.  Also recorded: the RSS right after ``import llmdd``, the number of modules and
threads, whether structlog/asyncio/numpy got loaded, the largest mappings (/proc/self/smaps) and,
with ``LLMDD_IDLE_TRACE=N``, tracemalloc's N largest files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Optional

CHILD = textwrap.dedent('''
    import gc, json, os, sys

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    trace = int(os.environ.get("LLMDD_IDLE_TRACE", "0"))
    if trace:   # Python-level allocations (the RSS is then larger: tracemalloc's own bookkeeping)
        import tracemalloc
        tracemalloc.start(1)
    start = rss()
    import llmdd
    imported = rss()
    cfg = llmdd.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = "127.0.0.1:0"
    options = cfg.generate_options()
    transport = os.environ.get("LLMDD_IDLE_TRANSPORT")
    if transport:
        options["llmdd.transport"] = transport
    dd = llmdd.LLMDataDist(llmdd.LLMRole.PROMPT, 1)
    dd.init(options)
    gc.collect()
    idle = rss()
    maps, cur = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
                cur = parts[5] if len(parts) > 5 else "[anon]"
            elif parts and parts[0] == "Rss:":
                maps[cur] = maps.get(cur, 0) + int(parts[1]) * 1024
    top = sorted(maps.items(), key=lambda kv: -kv[1])[:12]
    out = {"llmdd": llmdd.__file__, "transport": transport, "rss_start": start, "rss_after_import": imported,
           "rss_idle": idle, "modules": len(sys.modules), "threads": len(os.listdir("/proc/self/task")),
           "structlog_loaded": "structlog" in sys.modules, "asyncio_loaded": "asyncio" in sys.modules,
           "numpy_loaded": "numpy" in sys.modules, "top_mappings": top,
           "plugins": sorted(n for n, _ in dd._pm.list_name_plugin()) if getattr(dd, "_pm", None) else None}
    if os.environ.get("LLMDD_IDLE_FIRST_USE"):   # control: the first read of a numpy constant loads it
        from llmdd.lowlevel import OP_DTYPE
        out["numpy_after_first_use"] = "numpy" in sys.modules
        out["op_dtype_itemsize"] = OP_DTYPE.itemsize
    if trace:
        stats = tracemalloc.take_snapshot().statistics("filename")
        out["traced_bytes"] = sum(st.size for st in stats)
        out["tracemalloc_top"] = [[str(st.traceback[0].filename), st.size, st.count] for st in stats[:trace]]
    dd.finalize()
    print(json.dumps(out))
''')


def measure_idle(env: Optional[dict] = None, timeout: float = 120.0, transport: Optional[str] = None) -> dict:
    """One idle engine in a fresh interpreter; its numbers (see the module docstring)."""
    extra = dict(env or {})
    if transport:
        extra["LLMDD_IDLE_TRANSPORT"] = transport
    # cwd "/": "-c" puts the cwd first on sys.path, and llmdd must come from the install (or PYTHONPATH)
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **extra}, cwd="/")
    if proc.returncode != 0:
        raise RuntimeError(f"idle engine child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def idle_engine(transport: str, repeat: int = 3) -> dict:
    """``repeat`` fresh idle engines with ``transport`` forced: the median RSS and every run's."""
    runs = [measure_idle(transport=transport) for _ in range(repeat)]
    rss = sorted(r["rss_idle"] for r in runs)
    return {"rss_bytes": rss[len(rss) // 2], "all": [r["rss_idle"] for r in runs],
            "rss_after_import": runs[0]["rss_after_import"], "modules": runs[0]["modules"],
            "threads": runs[0]["threads"], "numpy_loaded": runs[0]["numpy_loaded"],
            "top_mappings": runs[0]["top_mappings"][:6]}
