"""The exit handler: clients that never call ``finalize`` (vllm-ascend) still exit promptly and cleanly.

Each scenario runs in fresh interpreters (``sys.executable``) with every wait bounded.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from typing import Optional

import pytest

import llmdd._api.datadist as datadist_module
from llmdd import LLMDataDist, LLMException, LLMRole, LLMStatusCode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_GRACE_S = 3.0

_PRELUDE = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from llmdd import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole,
                       LLMStatusCode)

    def say(*parts):
        print("@@", *parts, flush=True)

    def options(listen):
        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        cfg.mem_pool_cfg = '{"memory_size": 1048576, "page_shift": 12}'
        if listen:
            cfg.listen_ip_info = listen
        return cfg.generate_options()

    def register(dd, cluster_id):
        cm = dd.cache_manager
        buf = np.zeros((8, 64), np.float32)
        reg = cm.register_blocks_cache(CacheDesc(1, [8, 64], DataType.DT_FLOAT), [buf.ctypes.data],
                                       BlocksCacheKey(cluster_id, 0))
        pooled = cm.allocate_cache(CacheDesc(1, [4, 64], DataType.DT_FLOAT))
        segments = [n for n in os.listdir("/dev/shm") if n.startswith("llmdd_") and str(os.getpid()) in n]
        return buf, reg, pooled, segments
""")

SERVER = _PRELUDE + textwrap.dedent("""
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options("127.0.0.1:0"))
    keep = register(dd, 1)
    say("PORT", dd.statistics()["listen"][1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        links = dd.statistics()["links"]
        if links and all(v["state"] == "linked" for v in links.values()):
            break
        time.sleep(0.02)
    links = dd.statistics()["links"]
    say("LINKED", json.dumps({str(k): v["state"] for k, v in links.items()}, separators=(",", ":")))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        links = dd.statistics()["links"]
        if not links or all(v["state"] == "failed" for v in links.values()):
            break
        time.sleep(0.02)
    say("DOWN", json.dumps({str(k): v["state"] for k, v in links.items()}, separators=(",", ":")))
    say("MAIN_DONE")
""")

CLIENT = _PRELUDE + textwrap.dedent("""
    port = int(sys.argv[1])
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(options(None))
    keep = register(dd, 2)
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    ret, codes = dd.link_clusters([info], 5000)
    say("LINK", ret.name, json.dumps({str(k): v["state"] for k, v in dd.statistics()["links"].items()}, separators=(",", ":")))
    time.sleep(0.3)
    say("MAIN_DONE")
""")

LONE = _PRELUDE + textwrap.dedent("""
    dd = LLMDataDist(LLMRole.PROMPT, 3)
    dd.init(options("127.0.0.1:0"))
    buf, reg, pooled, segments = register(dd, 3)
    say("SEGMENTS", json.dumps(segments, separators=(",", ":")))
    say("LISTEN", dd.statistics()["listen"][1])
    say("MAIN_DONE")
""")


@pytest.fixture(autouse=True)
def _one_engine_per_test():
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()
    LLMDataDist.llm_engine_instance = None
    yield
    live = LLMDataDist.llm_engine_instance
    if live is not None and hasattr(live, "_core"):
        live.finalize()
    LLMDataDist.llm_engine_instance = None


class Proc:
    """A child interpreter whose ``@@`` lines are collected with their arrival time."""

    def __init__(self, script: str, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.popen = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: "queue.Queue[tuple[float, list[str]]]" = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.output.append(line)
            if line.startswith("@@ "):
                self.lines.put((time.monotonic(), line.split()[1:]))

    def expect(self, tag: str, timeout: float = 15.0) -> tuple[float, list[str]]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                pytest.fail(f"no {tag!r} line in {timeout} s; output:\n{self.dump()}")
            try:
                at, parts = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if parts and parts[0] == tag:
                return at, parts[1:]

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"process {self.popen.pid} did not exit within {timeout} s; output:\n{self.dump()}")
        return rc, time.monotonic()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def dump(self) -> str:
        self._reader.join(1.0)
        stderr = ""
        if self.popen.poll() is not None and self.popen.stderr is not None:
            stderr = self.popen.stderr.read()
        return "".join(self.output) + "\n--- stderr ---\n" + stderr


def _segments_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/llmdd_*{pid}*")


def test_never_finalized_engine_exits_cleanly():
    proc = Proc(LONE)
    try:
        _, (segments,) = proc.expect("SEGMENTS")
        assert json.loads(segments), "the scenario must really own shared memory"
        proc.expect("LISTEN")
        done_at, _ = proc.expect("MAIN_DONE")
        rc, exit_at = proc.wait_exit(EXIT_GRACE_S + 5)
        assert rc == 0, proc.dump()
        assert exit_at - done_at < EXIT_GRACE_S, f"exit took {exit_at - done_at:.2f} s"
        assert _segments_of(proc.popen.pid) == []
        assert "Traceback" not in proc.dump()
    finally:
        proc.kill()


def test_live_link_goes_down_when_the_client_exits_without_finalize():
    server = Proc(SERVER)
    client: Optional[Proc] = None
    try:
        _, (port,) = server.expect("PORT")
        client = Proc(CLIENT, port)
        _, link = client.expect("LINK")
        assert link[0] == "LLM_SUCCESS", client.dump()
        assert json.loads(link[1]) == {"1": "linked"}, client.dump()
        _, linked = server.expect("LINKED")
        assert json.loads(linked[0]) == {"2": "linked"}, server.dump()  # keyed by the client's real cluster id
        client_done, _ = client.expect("MAIN_DONE")
        rc, client_exit = client.wait_exit(EXIT_GRACE_S + 5)
        assert rc == 0, client.dump()
        assert client_exit - client_done < EXIT_GRACE_S, f"client exit took {client_exit - client_done:.2f} s"
        down_at, (states,) = server.expect("DOWN", timeout=15)
        assert set(json.loads(states).values()) <= {"failed"}, states  # failed, or removed
        assert down_at - client_exit < 5.0, f"the server saw the link go down after {down_at - client_exit:.2f} s"
        server_done, _ = server.expect("MAIN_DONE")
        rc, server_exit = server.wait_exit(EXIT_GRACE_S + 5)
        assert rc == 0, server.dump()
        assert server_exit - server_done < EXIT_GRACE_S
        for proc in (server, client):
            assert _segments_of(proc.popen.pid) == []
            assert "Traceback" not in proc.dump()
    finally:
        server.kill()
        if client is not None:
            client.kill()


class _FailingEngine:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.calls = 0

    def finalize(self) -> None:
        self.calls += 1
        raise self.exc


@pytest.fixture
def fake_instance(monkeypatch):
    assert LLMDataDist.llm_engine_instance is None

    def install(engine) -> None:
        monkeypatch.setattr(LLMDataDist, "llm_engine_instance", engine)

    yield install


def test_shutdown_handler_swallows_llm_exception(fake_instance):
    engine = _FailingEngine(LLMException("finalize failed", status_code=LLMStatusCode.LLM_FAILED))
    fake_instance(engine)
    datadist_module._shutdown_handler()  # does not raise
    assert engine.calls == 1


def test_shutdown_handler_without_engine_is_a_noop():
    assert LLMDataDist.llm_engine_instance is None
    datadist_module._shutdown_handler()


def test_shutdown_handler_finalizes_the_live_engine():
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init({"llm.EnableCacheManager": "1", "llm.listenIpInfo": "127.0.0.1:0"})
    try:
        cm = dd.cache_manager
        datadist_module._shutdown_handler()
        assert LLMDataDist.llm_engine_instance is None
        with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
            cm.allocate_cache(None)
    finally:
        dd.finalize()


def test_shutdown_handler_is_registered_with_atexit():
    script = textwrap.dedent("""
        import llmdd._api.datadist as d
        orig = d.LLMDataDist.finalize
        class Probe(d.LLMDataDist):
            def finalize(self):
                print("FINALIZED", flush=True)
                orig(self)
        p = Probe(d.LLMRole.PROMPT, 1)
        p.init({"llm.EnableCacheManager": "1"})
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "FINALIZED" in out.stdout
