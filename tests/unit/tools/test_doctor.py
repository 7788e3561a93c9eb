"""``llmdd info`` / ``llmdd doctor``: the report, the self-test and each misconfiguration check."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from llmdd._tools import doctor as d
from llmdd._seam.abc import Transport, TransportInfo
from llmdd._tools.cli import main
from llmdd.plugin import TransportRegistry

NOT_LOCAL = "203.0.113.77"  # TEST-NET-3: never an address of this machine


@pytest.fixture(autouse=True)
def _plain_env(monkeypatch):
    monkeypatch.delenv("LLMDD_AUTH_SECRET", raising=False)
    # third-party transports installed next to llmdd would lengthen the self-test; tcp and shm are ours
    monkeypatch.setenv("LLMDD_DISABLED_PLUGINS", "ucx")


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out = run_cli(capsys, *argv, "--json")
    return rc, json.loads(out)


def check(report: dict, name: str) -> dict:
    found = [c for c in report["checks"] if c["name"] == name]
    assert found, f"no {name!r} check in {[c['name'] for c in report['checks']]}"
    return found[0]


# --------------------------------------------------------------------------- info


def test_info_json_lists_versions_plugins_transports_profile_and_backends(capsys):
    rc, info = run_json(capsys, "info")
    assert rc == 0
    versions = info["versions"]
    for name in ("llmdd", "python", "numpy", "attrs", "transitions", "pluggy", "structlog"):
        assert versions[name], name
    eps = {ep["name"]: ep for ep in info["plugins"]["entry_points"]}
    assert eps["tcp"]["distribution"] == "llmdd-transport-tcp" and eps["tcp"]["version"] and eps["tcp"]["loaded"]
    assert eps["shm"]["distribution"] == "llmdd-transport-shm" and eps["shm"]["loaded"]
    assert "tcp" in info["plugins"]["loaded"] and "llmdd._extension.builtin.select_transport" in info["plugins"]["loaded"]
    if "ucx" in eps:  # blocked by the fixture: listed, not loaded
        assert eps["ucx"]["blocked"] and not eps["ucx"]["loaded"] and "ucx" not in info["plugins"]["loaded"]
    transports = {t["name"]: t for t in info["transports"]}
    assert transports["tcp"]["available"] is True
    assert transports["shm"]["available"] is True and transports["shm"]["same_host_only"] is True
    assert "ptrace_scope" in transports["shm"]["details"]
    assert info["profile"]["name"] == "generic"
    kinds = {b["kind"]: b for b in info["memory_backends"]}
    assert kinds["emulated-device"]["emulated"] is True
    assert "device memory is host memory here" in kinds["emulated-device"]["summary"]


def test_info_text_shows_the_selected_profile_limits(capsys):
    rc, out = run_cli(capsys, "info", "--profile", "atlas_a2")
    assert rc == 0
    assert "profile atlas_a2: Atlas A2 (910B)" in out
    assert "max_registered_addrs   240" in out
    assert "tcp      available" in out and "shm      available" in out
    assert "llmdd-transport-tcp" in out and "numpy" in out
    assert "device memory is host memory here" in out


# --------------------------------------------------------------------------- self-test


def test_doctor_self_test_reports_gbps_for_tcp_and_shm(capsys):
    rc, out = run_cli(capsys, "doctor", "--seconds", "0.5")
    assert rc == 0, out
    assert "result: all checks passed" in out
    for name in ("shm", "tcp"):
        line = next(ln for ln in out.splitlines() if ln.split()[:2] == ["ok", name])
        assert float(line.split()[2]) > 0 and "GB/s" in line


def test_self_test_with_two_processes():
    result = d.self_test("shm", 0.1, processes="two", size=8 << 20)
    assert result.ok, result.error
    assert result.processes == 2 and result.verified and result.gbps > 0
    assert result.bytes_read == result.batches * (8 << 20)
    assert json.loads(json.dumps(result.as_dict()))["transport"] == "shm"


class _Broken(Transport):
    name = "broken"
    same_host_only = True

    @classmethod
    def probe(cls) -> TransportInfo:
        return TransportInfo(name=cls.name, available=True)

    def open_endpoint(self, *, host="127.0.0.1", secret=None):
        raise RuntimeError("no endpoint today")


def test_self_test_failure_is_a_reason_not_a_traceback():
    registry = TransportRegistry()
    registry.register(_Broken)
    result = d.self_test("broken", 0.1, registry=registry, processes="one")
    assert not result.ok and result.error == "RuntimeError: no endpoint today"
    # same host only: retried with a second process, which does not know this transport either
    result = d.self_test("broken", 0.1, registry=registry)
    assert not result.ok and result.processes == 2 and "broken" in result.error
    missing = d.self_test("nonexistent", 0.1, registry=registry)
    assert not missing.ok and "no transport named 'nonexistent'" in missing.error


# --------------------------------------------------------------------------- misconfiguration


def test_listen_address_that_is_not_local(capsys):
    rc, out = run_cli(capsys, "doctor", "--seconds", "0", "--listen", f"{NOT_LOCAL}:26000")
    assert rc == 1
    assert f"{NOT_LOCAL} is not an address of this machine; use one of: 127.0.0.1" in out
    assert "FAIL  listen" in out and "result: 1 problem found" in out


def test_listen_port_in_use_and_free(capsys):
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        rc, out = run_cli(capsys, "doctor", "--seconds", "0", "--listen", f"127.0.0.1:{port}")
    finally:
        holder.close()
    assert rc == 1
    assert f"port {port} on 127.0.0.1 is in use by another process; pick another port or stop it" in out
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--listen", f"127.0.0.1:{port}")
    assert rc == 0 and report["ok"] is True
    assert check(report, "port")["status"] == "ok" and check(report, "listen")["status"] == "ok"


def test_listen_value_that_is_not_ip_port(capsys):
    rc, out = run_cli(capsys, "doctor", "--seconds", "0", "--listen", "127.0.0.1")
    assert rc == 1 and "'127.0.0.1' is not an ip:port address" in out


def test_pool_too_small_for_the_caches(capsys):
    rc, out = run_cli(capsys, "doctor", "--seconds", "0", "--mem-pool-cfg", '{"memory_size": 1048576}',
                      "--register-bytes", "64MiB")
    assert rc == 1
    assert ("mem_pool_cfg memory_size 1048576 (1 MiB) is smaller than the 67108864 bytes (64 MiB) of caches "
            "to register; raise it to at least 67108864") in out
    # rounded up to whole pages of the pool
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--register-bytes", "100000",
                          "--host-mem-pool-cfg", '{"memory_size": 65536, "page_shift": 16}')
    assert rc == 1
    host = check(report, "host_mem_pool_cfg")
    assert host["status"] == "fail" and "raise it to at least 131072" in host["message"]
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--register-bytes", "1M",
                          "--mem-pool-cfg", '{"memory_size": 1048576, "page_shift": 16}')
    assert rc == 0 and check(report, "mem_pool_cfg")["status"] == "ok"


def test_pool_config_invalid_or_over_the_profile_limit(capsys):
    rc, out = run_cli(capsys, "doctor", "--seconds", "0", "--mem-pool-cfg", '{"page_shift": 16}')
    assert rc == 1 and "mem_pool_cfg is invalid" in out and "memory_size is required" in out
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--profile", "atlas_a2",
                          "--host-mem-pool-cfg", json.dumps({"memory_size": 21 << 30}))
    assert rc == 1
    assert "exceeds the 20 GiB host memory limit of Atlas A2 (910B)" in check(report, "host_mem_pool_cfg")["message"]


def test_dev_shm_too_small_for_the_pools():
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    result = d.check_dev_shm(free + (1 << 30))
    assert result.failed
    assert result.message.startswith("/dev/shm has ") and "free but the pools need" in result.message
    assert "--shm-size" in result.fix
    assert d.check_dev_shm(1 << 20).status == "ok"


def _shm(scope, cma, reason="ok"):
    return [{"name": "shm", "available": True,
             "details": {"ptrace_scope": scope, "cma": cma, "cma_reason": reason, "seccomp": 0}}]


def test_ptrace_scope_blocking_cross_memory_attach():
    blocked = d.check_cross_memory_attach(_shm(2, False, "kernel.yama.ptrace_scope=2: restricted"))
    assert blocked.failed and "kernel.yama.ptrace_scope=2 blocks cross-memory attach" in blocked.message
    assert "ptrace_scope=0" in blocked.fix
    seccomp = d.check_cross_memory_attach(_shm(0, False, "process_vm_readv on the own pid failed: EPERM"))
    assert seccomp.failed and "EPERM" in seccomp.message
    children_only = d.check_cross_memory_attach(_shm(1, True))
    assert children_only.status == "warn" and "ptrace_scope=1" in children_only.message
    assert d.check_cross_memory_attach(_shm(None, True)).status == "ok"
    assert d.check_cross_memory_attach([{"name": "tcp", "available": True}]) is None


# --------------------------------------------------------------------------- secret against a real server

_SERVER = textwrap.dedent("""
    import sys
    from llmdd import LLMConfig, LLMDataDist, LLMRole
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.listen_ip_info = "127.0.0.1:0"
    options = dict(cfg.generate_options())
    options["llmdd.auth_secret"] = sys.argv[1]
    dd = LLMDataDist(LLMRole.PROMPT, 4242)
    dd.init(options)
    print(dd.statistics()["listen"][1], flush=True)
    sys.stdin.read()
    dd.finalize()
""")


@pytest.fixture
def secret_server(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    proc = subprocess.Popen([sys.executable, str(script), "s3cret"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the server engine did not start"
        port = int(proc.stdout.readline())
        yield f"127.0.0.1:{port}"
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_wrong_secret_against_a_real_server(capsys, secret_server):
    rc, out = run_cli(capsys, "doctor", "--seconds", "0", "--peer", secret_server, "--secret", "w7ong-secret-x")
    assert rc == 1
    assert "the server refused the secret" in out and "FAIL  secret" in out
    assert "s3cret" not in out and "w7ong-secret-x" not in out
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--peer", secret_server, "--secret", "s3cret")
    assert rc == 0, report
    assert "the server accepted the secret" in check(report, "secret")["message"]
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--peer", secret_server)
    assert rc == 1 and "requires a secret and none was given" in check(report, "peer")["message"]


def test_peer_that_is_not_running(capsys):
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    rc, report = run_json(capsys, "doctor", "--seconds", "0", "--peer", f"127.0.0.1:{port}")
    assert rc == 1 and f"cannot reach a server at 127.0.0.1:{port}" in check(report, "peer")["message"]


# --------------------------------------------------------------------------- python -m llmdd


def test_python_m_llmdd_doctor_in_a_subprocess():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llmdd", "doctor", "--seconds", "0", "--json",
                           "--listen", f"{NOT_LOCAL}:26000"], capture_output=True, text=True,
                          env=dict(os.environ, LLMDD_DISABLED_PLUGINS="ucx"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["problems"] == 1
    assert check(report, "listen")["message"].startswith(f"{NOT_LOCAL} is not an address of this machine")
    assert {t["name"] for t in report["info"]["transports"]} >= {"tcp", "shm"}
    assert time.monotonic() - started < 30


def test_sizes():
    assert d.parse_size("64MiB") == 64 << 20 and d.parse_size("2G") == 2 << 30 and d.parse_size("512") == 512
    with pytest.raises(ValueError):
        d.parse_size("lots")
    assert d.format_bytes(64 << 20) == "64 MiB" and d.format_bytes(1536 << 20) == "1.5 GiB"
