"""Checks of a configuration before an engine runs: listen addresses, pools, /dev/shm, cross-memory attach."""

from __future__ import annotations

import errno
import os
import socket
from typing import Any, Mapping, Optional, Sequence

from llmdd._tools.doctor.info import _dev_shm_stats
from llmdd._tools.doctor.report import Check
from llmdd._tools.doctor.util import (
    FAIL,
    OK,
    SKIP,
    WARN,
    format_bytes,
    local_ipv4_addresses,
)


def _parse_addr(name: str, value: str) -> tuple[Optional[tuple[str, int]], Optional[Check]]:
    from llmdd._base.options import NOT_IP_PORT, ip_port_problem, parse_listen_ip_info
    from llmdd._base.status import LLMException

    try:
        return parse_listen_ip_info(value), None
    except LLMException as exc:
        problem = ip_port_problem(value)
        return None, Check(name=name, status=FAIL, message=f"{value!r} " + (
                               "is not an ip:port address" if problem == NOT_IP_PORT else problem),
                           fix="write it as ip:port with a port in 0..65535, e.g. 127.0.0.1:26000",
                           details={"error": str(exc)})


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
