"""The checks behind ``llmdd info`` and ``llmdd doctor``, as a library function with structured results.

:func:`collect_info` gathers what this machine runs (versions, plugins, transports and their
probes, the chip-family profile, the memory backends); :func:`run_doctor` adds a loopback
self-test of every available transport and the misconfiguration checks its arguments ask
for.  Nothing here prints or configures logging: :mod:`llmdd._tools.cli.doctor` renders the results.

Every check ends in a :class:`Check` (``ok``, ``warn``, ``fail`` or ``skip``) with a message in
plain words and, for a problem, the fix.  A check never raises: an unexpected error becomes a
failed check carrying its reason.

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

import errno
import functools
import importlib.metadata as metadata
import json
import os
import platform
import re
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import attrs
import numpy as np

if TYPE_CHECKING:
    from llmdd._memory.backend import Segment

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
]

MiB = 1 << 20
GiB = 1 << 30

#: size of the region each self-test registers, and of one op
SELF_TEST_BYTES = 64 * MiB
SELF_TEST_OP_BYTES = 1 * MiB

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

_VERSIONED = ("numpy", "attrs", "transitions", "pluggy", "structlog")
_CHILD_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- results


@attrs.frozen(kw_only=True)
class Check:
    """The outcome of one check: ``status`` is ``ok``, ``warn``, ``fail`` or ``skip``."""

    name: str
    status: str
    message: str
    fix: str = ""
    details: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "message": self.message, "fix": self.fix,
                "details": _jsonable(dict(self.details))}


@attrs.frozen(kw_only=True)
class SelfTestResult:
    """A transport's loopback self-test.

    ``gbps`` is decimal GB/s over the timed reads (``batches`` of ``region_bytes`` each, after
    one untimed warm-up read; ``seconds`` is their summed duration).  The warm-up read and the
    last read are verified byte for byte (the destination is zeroed before the last).
    """

    transport: str
    ok: bool
    gbps: float = 0.0
    bytes_read: int = 0
    batches: int = 0
    seconds: float = 0.0
    region_bytes: int = SELF_TEST_BYTES
    op_bytes: int = SELF_TEST_OP_BYTES
    processes: int = 1
    verified: bool = False
    error: str = ""
    note: str = ""

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class DoctorReport:
    """What ``llmdd doctor`` found: the info, the self-tests and the checks."""

    info: Mapping[str, Any]
    selftests: Sequence[SelfTestResult]
    checks: Sequence[Check]

    @property
    def ok(self) -> bool:
        """No check failed and every self-test that ran passed."""
        return not any(c.failed for c in self.checks) and all(t.ok for t in self.selftests)

    @property
    def problems(self) -> int:
        return sum(c.failed for c in self.checks) + sum(not t.ok for t in self.selftests)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "info": _jsonable(dict(self.info)),
                "selftest": [t.as_dict() for t in self.selftests], "checks": [c.as_dict() for c in self.checks]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, bytes):
        return value.hex()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# --------------------------------------------------------------------------- small helpers


def format_bytes(n: int) -> str:
    """``64 MiB``, ``1.5 GiB``, ``512 bytes``: binary units, short."""
    n = int(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``1048576``, ``64MiB``, ``64M``, ``2G``, ``512k`` (binary multiples) -> bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes, or a number with K, M, G or T)")
    number, unit = int(match.group(1)), match.group(2).lower()
    return number << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[unit]


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def local_ipv4_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces (loopback first), best effort."""
    found: list[str] = []
    try:
        import fcntl
        import struct

        siocgifaddr = 0x8915
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    res = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                ip = socket.inet_ntoa(res[20:24])
                if ip not in found:
                    found.append(ip)
    except (ImportError, OSError, AttributeError):
        pass
    try:
        for ip in socket.gethostbyname_ex(socket.gethostname())[2]:
            if ip not in found:
                found.append(ip)
    except OSError:
        pass
    if "127.0.0.1" not in found:
        found.append("127.0.0.1")
    return sorted(found, key=lambda ip: (not ip.startswith("127."), ip))


# --------------------------------------------------------------------------- info


def _plugin_manager():
    from llmdd._extension.manager import Hooks, make_plugin_manager

    pm = make_plugin_manager()
    return pm, Hooks(pm).register_transports()


def _data_path(details: Mapping[str, Any]) -> Optional[str]:
    """The data path a transport reports as active (``details["data_path"]``: the shm plugin's
    C hot path or its pure-Python fallback, with the reason), or None when it reports none."""
    dp = details.get("data_path") if isinstance(details, Mapping) else None
    if not isinstance(dp, Mapping) or not dp.get("path"):
        return None
    return str(dp["path"]) + (f" ({dp['reason']})" if dp.get("reason") else "")


def collect_info(profile: str = "generic") -> dict:
    """Versions, plugins, transports (probed), the chip-family profile and the memory backends.

    JSON-able.  A plugin that cannot be loaded is reported under ``plugins_error`` (and no
    transport is listed), never raised.
    """
    from llmdd._memory.backend import EmulatedDeviceBackend, HostBackend
    from llmdd._extension.manager import ENV_DISABLE_AUTOLOAD, ENV_DISABLED_PLUGINS
    from llmdd._base.profiles import PROFILES

    import llmdd

    versions: dict[str, Optional[str]] = {"llmdd": _version("llmdd") or llmdd.__version__,
                                          "python": platform.python_version()}
    for dist in _VERSIONED:
        versions[dist] = _version(dist)
    info: dict[str, Any] = {"versions": versions,
                            "platform": f"{platform.system()} {platform.release()} {platform.machine()}"}

    entry_points: list[dict[str, Any]] = []
    for ep in sorted(metadata.entry_points(group="llmdd"), key=lambda e: e.name):
        ep_dist = getattr(ep, "dist", None)
        entry_points.append({"name": ep.name, "value": ep.value,
                             "distribution": ep_dist.metadata["Name"] if ep_dist is not None else None,
                             "version": ep_dist.version if ep_dist is not None else None})
    plugins_error = None
    loaded: list[str] = []
    transports: list[dict] = []
    try:
        pm, registry = _plugin_manager()
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        plugins_error = f"{type(exc).__name__}: {exc}"
    else:
        # a blocked name is listed with no plugin object
        loaded = sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None)
        for entry in entry_points:
            entry["loaded"] = entry["name"] in loaded
            entry["blocked"] = pm.is_blocked(entry["name"])
        for name in registry.names():
            cls = registry.get(name)
            probed = registry.probe(name)
            transports.append({"name": name, "available": bool(probed.available), "reason": probed.reason,
                               "priority": int(cls.priority), "same_host_only": bool(cls.same_host_only),
                               "class": f"{cls.__module__}.{cls.__qualname__}",
                               "data_path": _data_path(probed.details),
                               "details": _jsonable(dict(probed.details))})
    info["plugins"] = {"loaded": loaded, "entry_points": entry_points, "error": plugins_error,
                       "autoload_disabled": os.environ.get(ENV_DISABLE_AUTOLOAD, "") or None,
                       "disabled": os.environ.get(ENV_DISABLED_PLUGINS, "") or None}
    info["transports"] = transports

    chosen = PROFILES[profile]
    info["profile"] = _jsonable(chosen.describe())

    backends = []
    for backend in (HostBackend(), EmulatedDeviceBackend()):
        desc = dict(backend.describe())
        if desc.get("emulated"):
            desc["summary"] = ("device memory is host memory here: Placement.DEVICE is emulated with host "
                               "shared memory (no accelerator backend is in use)")
        else:
            desc["summary"] = "host DRAM in POSIX shared memory (same-host peers map it)"
        backends.append(_jsonable(desc))
    info["memory_backends"] = backends
    info["dev_shm"] = _dev_shm_stats()
    return info


def _dev_shm_stats(path: str = "/dev/shm") -> dict:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": path, "error": exc.strerror or str(exc)}
    return {"path": path, "size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}


# --------------------------------------------------------------------------- self-test


@functools.lru_cache(maxsize=1)
def _pattern(size: int) -> np.ndarray:
    """Deterministic, position-dependent bytes (a stale or shifted byte never matches); read-only, cached."""
    words = np.arange(size // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(0x6C6C6D6464446F63)
    out = words.view(np.uint8)
    out.flags.writeable = False
    return out


class _Owned:
    """The region a self-test reads: a pool-style shared-memory segment owned by one endpoint."""

    def __init__(self, transport_cls: type, size: int) -> None:
        from llmdd._seam.abc import MemRegion
        from llmdd._base.enums import Placement
        from llmdd._memory.backend import HostBackend

        self.backend = HostBackend()
        self.endpoint: Any = None   # the transport's Endpoint (the class is given, untyped)
        segment = self.backend.allocate_segment(size)
        self.segment: Optional[Segment] = segment
        try:
            segment.array()[:] = _pattern(size)
            self.endpoint = transport_cls({}).open_endpoint(host="127.0.0.1")
            self.desc = self.endpoint.register(MemRegion(
                region_id=1, addr=segment.addr, size=size, remote_accessible=True,
                placement=int(Placement.HOST), shm_name=segment.name, shm_offset=0))
            self.peer = self.endpoint.describe()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.segment is not None:
            self.backend.release(self.segment)
            self.segment = None


def _owner_child(transport: str, size: int, send: Any) -> None:
    """Child side of a two-process self-test: own the region until the parent is done."""
    owned = None
    try:
        _, registry = _plugin_manager()
        owned = _Owned(registry.get(transport), size)
        send({"kind": "ready", "peer": owned.peer, "desc": owned.desc})
        sys.stdin.readline()  # "done", or EOF when the parent goes away
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        send({"kind": "error", "error": _describe_error(exc)})
    finally:
        if owned is not None:
            owned.close()


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _child_main() -> None:
    """Entry point of a helper process (``python -c``): one JSON request on stdin, JSON lines out.

    The protocol goes over a duplicate of the original stdout; ``sys.stdout`` and fd 1 are
    pointed at stderr so that nothing else can interleave with it.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: Any) -> None:
        proto.write(json.dumps(_encode(obj)) + "\n")
        proto.flush()

    request = _decode(json.loads(sys.stdin.readline() or "{}"))
    op = request.get("op")
    if op == "own":
        _owner_child(request["transport"], int(request["size"]), send)
    elif op == "link":
        send(_link_outcome(request["host"], int(request["port"]), request.get("secret"),
                           int(request["timeout_ms"])))
    else:
        send({"kind": "error", "error": f"unknown request {op!r}"})
    proto.close()


class _Child:
    """A helper process running :func:`_child_main`: a fresh interpreter, JSON lines both ways.

    A fresh ``python -c`` rather than ``multiprocessing``: spawn re-imports the parent's
    ``__main__`` (which fails for a REPL or stdin parent, and re-runs scripts without a main
    guard), and fork is unsafe in a process that runs threads.
    """

    def __init__(self, request: Mapping[str, Any]) -> None:
        import llmdd

        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(llmdd.__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._stderr = tempfile.TemporaryFile()
        self._buf = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from llmdd._tools.doctor import _child_main; _child_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, bufsize=0,
            close_fds=True)
        self.send(request)

    def send(self, obj: Any) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(_encode(obj)) + "\n").encode())
        except (BrokenPipeError, OSError):
            pass

    def recv(self, timeout: float) -> Optional[dict]:
        """The next message, or None at EOF or when ``timeout`` seconds pass."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return _decode(json.loads(line))

    def failure(self) -> str:
        """Why the child gave no answer: its exit status and the last line of its stderr."""
        code = self.proc.poll()
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else ""
        status = "is still running" if code is None else f"exited with status {code}"
        return f"the helper process {status}" + (f": {last}" if last else "")

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def _describe_error(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def self_test(transport: str, seconds: float = 3.0, *, size: int = SELF_TEST_BYTES,
              op_bytes: int = SELF_TEST_OP_BYTES, processes: str = "auto", registry: Any = None) -> SelfTestResult:
    """Read a registered ``size``-byte region with ``op_bytes`` ops for ``seconds``; verify; report GB/s.

    ``processes``: ``"one"`` (two endpoints in this process), ``"two"`` (the region is owned
    by an endpoint in a spawned child) or ``"auto"`` (one; two when one fails for a
    same-host-only transport).  Never raises: a failure is ``ok=False`` with its reason.
    """
    if processes not in ("auto", "one", "two"):
        raise ValueError(f"processes must be 'auto', 'one' or 'two', got {processes!r}")
    try:
        if registry is None:
            _, registry = _plugin_manager()
        cls = registry.get(transport)
        probed = registry.probe(transport)
    except Exception as exc:  # noqa: BLE001
        return SelfTestResult(transport=transport, ok=False, error=_describe_error(exc))
    if not probed.available:
        return SelfTestResult(transport=transport, ok=False,
                              error=f"not available here: {probed.reason or 'no reason given'}")
    try:
        if processes in ("auto", "one"):
            result = _self_test_run(cls, transport, seconds, size, op_bytes, two=False)
            if result.ok or processes == "one" or not cls.same_host_only:
                return result
            retry = _self_test_run(cls, transport, seconds, size, op_bytes, two=True)
            if retry.ok:
                return attrs.evolve(retry, note=f"in-process run failed ({result.error}); ran with two processes")
            return retry
        return _self_test_run(cls, transport, seconds, size, op_bytes, two=True)
    finally:
        _pattern.cache_clear()  # do not keep the region-sized pattern alive after the test


def _self_test_run(cls: type, transport: str, seconds: float, size: int, op_bytes: int, *,
                   two: bool) -> SelfTestResult:
    from llmdd._seam.abc import MemRegion, make_ops
    from llmdd._base.enums import Placement

    result = functools.partial(SelfTestResult, transport=transport, region_bytes=size, op_bytes=op_bytes,
                               processes=2 if two else 1)
    if size <= 0 or op_bytes <= 0 or size % op_bytes or size % 8:
        return result(ok=False, error=f"region size {size} must be a positive multiple of the op size "
                                      f"{op_bytes} and of 8")
    owned = child = None
    local = channel = None
    started = time.monotonic()
    try:
        if two:
            child = _Child({"op": "own", "transport": transport, "size": size})
            msg = child.recv(_CHILD_TIMEOUT_S)
            if msg is None:
                return result(ok=False, error=child.failure())
            if msg.get("kind") != "ready":
                return result(ok=False, error=f"the helper process failed: {msg.get('error')}")
            peer, desc = msg["peer"], msg["desc"]
        else:
            owned = _Owned(cls, size)
            peer, desc = owned.peer, owned.desc
        dst = np.zeros(size, np.uint8)
        local = cls({}).open_endpoint(host="127.0.0.1")
        local.register(MemRegion(region_id=2, addr=int(dst.ctypes.data), size=size, remote_accessible=False,
                                 placement=int(Placement.HOST)))
        channel = local.connect(peer, timeout=10.0)
        channel.add_remote_region(1, size, desc)
        count = size // op_bytes
        offsets = np.arange(count, dtype=np.uint64) * np.uint64(op_bytes)
        ops = make_ops(2, offsets, 1, offsets, op_bytes)
        expected = _pattern(size)
        batch_limit = max(10.0, 4 * seconds)

        def read_once() -> float:
            t0 = time.perf_counter()
            completion = channel.read(ops, deadline=time.monotonic() + batch_limit)
            completion.wait()
            err = completion.error
            if err is not None:
                raise err
            return time.perf_counter() - t0

        read_once()  # warm-up, verified but not timed: maps the peer's memory, faults the destination in
        if not np.array_equal(dst, expected):
            bad = int(np.argmax(dst != expected))
            return result(ok=False, error=f"bytes differ after a read (first at offset {bad})")
        busy = 0.0
        batches = 0
        end = time.perf_counter() + max(0.0, seconds)
        while time.perf_counter() < end:
            busy += read_once()
            batches += 1
        dst[:] = 0  # the last read must rewrite every byte
        busy += read_once()
        batches += 1
        if not np.array_equal(dst, expected):
            bad = int(np.argmax(dst != expected))
            return result(ok=False, error=f"bytes differ after {batches + 1} reads (first at offset "
                                          f"{bad})", batches=batches)
        total = batches * size
        return result(ok=True, gbps=total / max(busy, 1e-9) / 1e9, bytes_read=total,
                      batches=batches, seconds=busy, verified=True)
    except Exception as exc:  # noqa: BLE001 - reported with its reason, never a traceback
        return result(ok=False, error=_describe_error(exc),
                      seconds=time.monotonic() - started)
    finally:
        for closer in (getattr(channel, "close", None), getattr(local, "close", None),
                       getattr(owned, "close", None)):
            if closer is not None:
                try:
                    closer()
                except Exception:  # noqa: BLE001 - cleanup of a failed test
                    pass
        if child is not None:
            child.send("done")
            child.close()


# --------------------------------------------------------------------------- configuration checks


def _parse_addr(name: str, value: str) -> tuple[Optional[tuple[str, int]], Optional[Check]]:
    from llmdd._base.options import parse_listen_ip_info
    from llmdd._base.status import LLMException

    try:
        return parse_listen_ip_info(value), None
    except LLMException as exc:
        return None, Check(name=name, status=FAIL, message=f"{value!r} is not an ip:port address",
                           fix="write it as ip:port, e.g. 127.0.0.1:26000", details={"error": str(exc)})


def _listener_of(port: int) -> Optional[str]:
    """``pid 1234 (python3)`` of a process listening on ``port``, when /proc tells (best effort)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{parts[9]}]")
        except (OSError, ValueError):
            continue
    if not inodes:
        return None
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if int(pid) == os.getpid():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in inodes:
                    try:
                        with open(f"/proc/{pid}/comm") as f:
                            comm = f.read().strip()
                    except OSError:
                        comm = "?"
                    return f"pid {pid} ({comm})"
            except OSError:
                continue
    return None


def check_listen(value: str) -> list[Check]:
    """``--listen ip:port``: the address is this machine's, and the port is free to listen on."""
    addr, bad = _parse_addr("listen", value)
    if bad is not None:
        return [bad]
    assert addr is not None
    host, port = addr
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        return [Check(name="listen", status=FAIL, message=f"{host} does not resolve: {exc.strerror or exc}",
                      fix=f"use one of this machine's addresses: {', '.join(local_ipv4_addresses())}")]
    from llmdd._base.options import is_local_address

    if not is_local_address(ip):
        shown = host if host == ip else f"{host} ({ip})"
        local = ", ".join(local_ipv4_addresses())
        return [Check(name="listen", status=FAIL,
                      message=f"{shown} is not an address of this machine; use one of: {local}",
                      fix="set llm.listenIpInfo (LLMConfig.listen_ip_info) to an address of this machine",
                      details={"host": host, "ip": ip, "local_addresses": local_ipv4_addresses()})]
    checks = [Check(name="listen", status=OK, message=f"{host} is an address of this machine",
                    details={"host": host, "ip": ip})]
    if port == 0:
        checks.append(Check(name="port", status=WARN,
                            message="port 0 lets the system pick a port: clients cannot know it in advance",
                            fix="pick a fixed port (e.g. 26000) for llm.listenIpInfo"))
        return checks
    try:
        probe = socket.create_server((ip, port), backlog=1)  # as the engine's listener binds
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            owner = _listener_of(port)
            who = f" ({owner})" if owner else ""
            checks.append(Check(name="port", status=FAIL,
                                message=f"port {port} on {ip} is in use by another process{who}; "
                                        f"pick another port or stop it",
                                fix="change the port of llm.listenIpInfo, or stop the process holding it",
                                details={"host": ip, "port": port, "owner": owner}))
        elif exc.errno == errno.EACCES:
            checks.append(Check(name="port", status=FAIL,
                                message=f"port {port} on {ip} needs privileges this process lacks "
                                        f"(ports below 1024 are reserved)",
                                fix="pick a port of 1024 or above",
                                details={"host": ip, "port": port}))
        else:
            checks.append(Check(name="port", status=FAIL,
                                message=f"cannot listen on {ip}:{port}: {exc.strerror or exc}",
                                fix="pick another address or port", details={"host": ip, "port": port}))
    else:
        probe.close()
        checks.append(Check(name="port", status=OK, message=f"port {port} on {ip} is free",
                            details={"host": ip, "port": port}))
    return checks


def check_pools(mem_pool_cfg: Optional[str] = None, host_mem_pool_cfg: Optional[str] = None,
                register_bytes: Optional[int] = None, profile: str = "generic") -> tuple[list[Check], int]:
    """The pool configs parse, hold ``register_bytes`` each, and fit the profile's limits.

    Returns the checks and the total pool bytes (for the ``/dev/shm`` check).
    """
    from llmdd._base.config import parse_mem_pool_cfg
    from llmdd._base.profiles import PROFILES
    from llmdd._base.status import LLMException

    chosen = PROFILES[profile]
    checks: list[Check] = []
    total = 0
    pools = (("mem_pool_cfg", mem_pool_cfg, "device", chosen.max_device_memory),
             ("host_mem_pool_cfg", host_mem_pool_cfg, "host", chosen.max_host_pool))
    for name, text, placement, limit in pools:
        if text is None:
            continue
        try:
            memory_size, page_shift = parse_mem_pool_cfg(text, name)
        except LLMException as exc:
            checks.append(Check(name=name, status=FAIL, message=f"{name} is invalid: {exc}",
                                fix='write it as {"memory_size": <bytes>, "page_shift": <10..30>}'))
            continue
        total += memory_size
        page = 1 << page_shift
        details = {"memory_size": memory_size, "page_shift": page_shift, "placement": placement}
        problems = []
        if register_bytes is not None and memory_size < register_bytes:
            need = -(-register_bytes // page) * page
            problems.append(Check(
                name=name, status=FAIL,
                message=f"{name} memory_size {memory_size} ({format_bytes(memory_size)}) is smaller than the "
                        f"{register_bytes} bytes ({format_bytes(register_bytes)}) of caches to register; "
                        f"raise it to at least {need}",
                fix=f'{name} = \'{{"memory_size": {need}, "page_shift": {page_shift}}}\'',
                details=dict(details, register_bytes=register_bytes, required=need)))
        if limit is not None and memory_size > limit:
            problems.append(Check(
                name=name, status=FAIL,
                message=f"{name} memory_size {memory_size} ({format_bytes(memory_size)}) exceeds the "
                        f"{format_bytes(limit)} {placement} memory limit of {chosen.description}",
                fix=f"lower memory_size to at most {limit}",
                details=dict(details, limit=limit, profile=chosen.name)))
        if problems:
            checks.extend(problems)
        else:
            held = (f", holds the {format_bytes(register_bytes)} of caches to register"
                    if register_bytes is not None else "")
            checks.append(Check(name=name, status=OK,
                                message=f"{name}: {format_bytes(memory_size)} in pages of "
                                        f"{format_bytes(page)}{held}", details=details))
    if register_bytes is not None and mem_pool_cfg is None and host_mem_pool_cfg is None:
        checks.append(Check(name="pools", status=SKIP,
                            message="--register-bytes given without --mem-pool-cfg or --host-mem-pool-cfg: "
                                    "no pool to check it against"))
    return checks, total


def check_shm_leftovers(reclaim: bool = False, path: str = "/dev/shm") -> Check:
    """Shared-memory segments crashed llmdd processes left (same user and pid namespace, creator gone):
    listed, or removed with ``reclaim`` (``llmdd doctor --reclaim-shm``).  An engine reclaims them
    at init anyway; this shows what is there before one does."""
    from llmdd._memory.segments import find_leftovers, reclaim_leftovers

    found = reclaim_leftovers(path) if reclaim else find_leftovers(path)
    details = {"segments": [{"name": f.name, "pid": f.pid, "kind": f.kind, "bytes": f.size} for f in found]}
    total = sum(f.size for f in found)
    if not found:
        return Check(name="shm_leftovers", status=OK, message=f"no llmdd segment of a dead process in {path}")
    if reclaim:
        return Check(name="shm_leftovers", status=OK, details=details,
                     message=f"removed {len(found)} segment(s) of dead llmdd processes ({format_bytes(total)})")
    names = ", ".join(f.name for f in found[:5]) + (" ..." if len(found) > 5 else "")
    return Check(name="shm_leftovers", status=WARN, details=details,
                 message=f"{len(found)} segment(s) of dead llmdd processes hold {format_bytes(total)}: {names}",
                 fix="llmdd doctor --reclaim-shm removes them (any engine's init does too)")


def check_dev_shm(pool_bytes: int, path: str = "/dev/shm") -> Check:
    """``/dev/shm`` has room for the pools (every pool is a shared-memory segment there)."""
    stats = _dev_shm_stats(path)
    if "error" in stats:
        return Check(name="dev_shm", status=FAIL if pool_bytes else WARN,
                     message=f"{path} is not usable: {stats['error']}",
                     fix="mount a tmpfs on /dev/shm (shared-memory pools and the shm transport need it)",
                     details=stats)
    free = stats["free"]
    if pool_bytes > free:
        return Check(name="dev_shm", status=FAIL,
                     message=f"{path} has {format_bytes(free)} free but the pools need {format_bytes(pool_bytes)}",
                     fix=f"enlarge {path} to at least {format_bytes(pool_bytes)} (docker run --shm-size=..., or "
                         f"mount -o remount,size=... {path}), or shrink the pools",
                     details=dict(stats, required=pool_bytes))
    need = f"; the pools need {format_bytes(pool_bytes)}" if pool_bytes else ""
    return Check(name="dev_shm", status=OK,
                 message=f"{path}: {format_bytes(free)} free of {format_bytes(stats['size'])}{need}",
                 details=dict(stats, required=pool_bytes))


def check_cross_memory_attach(transports: Sequence[Mapping[str, Any]]) -> Optional[Check]:
    """From the shm probe: can a same-host peer read user memory (``process_vm_readv``)?"""
    shm = next((t for t in transports if t.get("name") == "shm"), None)
    if shm is None or not shm.get("available"):
        return None
    details = shm.get("details") or {}
    scope = details.get("ptrace_scope")
    cma = bool(details.get("cma"))
    reason = details.get("cma_reason") or ""
    facts = {"ptrace_scope": scope, "cma": cma, "cma_reason": reason, "seccomp": details.get("seccomp")}
    pools_only = ("caches from allocate_cache (pool memory) still work; caches registered from user memory "
                  "(register_cache / register_blocks_cache) cannot be read by a same-host peer")
    if not cma:
        blocked_by = (f"kernel.yama.ptrace_scope={scope} blocks cross-memory attach" if scope is not None
                      and scope >= 2 else f"cross-memory attach does not work: {reason}")
        fix = ("sudo sysctl -w kernel.yama.ptrace_scope=0 (or 1), or allocate caches from pools"
               if scope is not None and scope >= 2 else
               "allow process_vm_readv (seccomp profile: e.g. docker --cap-add SYS_PTRACE or a profile "
               "allowing it), or allocate caches from pools")
        return Check(name="cross_memory_attach", status=FAIL, message=f"{blocked_by}: {pools_only}",
                     fix=fix, details=facts)
    if scope == 1:
        return Check(name="cross_memory_attach", status=WARN,
                     message="kernel.yama.ptrace_scope=1: cross-memory attach reaches only descendant processes, "
                             "so engines started separately cannot read each other's user-memory caches "
                             "(pool memory is unaffected)",
                     fix="sudo sysctl -w kernel.yama.ptrace_scope=0, or allocate caches from pools",
                     details=facts)
    shown = "not set (no Yama)" if scope is None else str(scope)
    return Check(name="cross_memory_attach", status=OK,
                 message=f"cross-memory attach works (kernel.yama.ptrace_scope {shown})", details=facts)


# --------------------------------------------------------------------------- peer check


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


def check_engine(engine: Any = None) -> list[Check]:
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


# --------------------------------------------------------------------------- doctor


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
    def note(kind: str, item: Any) -> None:
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


def report_json(report: Any) -> str:
    """``DoctorReport`` or an info dict as indented JSON."""
    data = report.as_dict() if isinstance(report, DoctorReport) else _jsonable(report)
    return json.dumps(data, indent=2, sort_keys=False)

