"""Options of the legacy v1 mode: what ``LLMDataDist.init`` reads when cache-manager mode is off.

Upstream's v1 path (``llm_datadist_v1``, behaviour learnt from ``hicann/ge`` at ffdcbc9f7496)
builds ``llm.ClusterInfo`` from ``ge.exec.deviceId`` and, on a PROMPT, from
``llm.listenIpInfo`` (one ``ip:port`` per device, ``;``-separated: the *device* IPs the
PROMPT listens on); a DECODER does not listen, it links as a client.  Cache memory comes
from one pool of ``ge.flowGraphMemMaxSize`` bytes of which ``llm.MemoryUtilization``
(default 0.95) may be used.

llmdd runs the v1 surface on the same engine as cache-manager mode: the pool becomes the
memory manager's DEVICE pool (``llm.MemPoolConfig`` of the engine's own option set), the
PROMPT's ``llm.listenIpInfo`` becomes its listen address.  One engine is one device:
more than one device id is refused with ``LLM_FEATURE_NOT_ENABLED``.
"""

from __future__ import annotations

import json
import socket
from typing import Mapping, Optional

import attrs

from llmdd._base.enums import LLMRole
from llmdd._base.options import NOT_IP_PORT, ip_port_problem
from llmdd._base.profiles import profile_from_options
from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["V1Settings", "prepare_v1_options", "parse_v1_listen_ip_info", "DEFAULT_FLOW_GRAPH_MEM_MAX_SIZE",
           "DEFAULT_MEM_UTILIZATION", "V1_PAGE_SHIFT"]

K_DEVICE_ID = "ge.exec.deviceId"
K_LISTEN_IP_INFO = "llm.listenIpInfo"
K_CLUSTER_INFO = "llm.ClusterInfo"
K_FLOW_GRAPH_MEM = "ge.flowGraphMemMaxSize"
K_MEM_UTILIZATION = "llm.MemoryUtilization"
K_SWITCH_ROLE = "llm.EnableSwitchRole"
K_MEM_POOL = "llm.MemPoolConfig"
K_HOST_MEM_POOL = "llm.HostMemPoolConfig"
K_LISTEN_IP = "llm.ListenIp"
K_LISTEN_PORT = "llm.ListenPort"

#: ``ge.flowGraphMemMaxSize`` when the options do not set it.  Upstream leaves the size to
#: GE; llmdd backs the pool with reserved shared memory, so its default is modest.
DEFAULT_FLOW_GRAPH_MEM_MAX_SIZE = 256 * 1024 * 1024
DEFAULT_MEM_UTILIZATION = 0.95
#: page size of the v1 device pool: 4 KiB (every tensor of an allocation occupies whole pages)
V1_PAGE_SHIFT = 12


def _invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


@attrs.frozen(kw_only=True)
class V1Settings:
    """What a v1 engine reads from its options, parsed once at ``init``."""

    device_ids: tuple
    listen: Optional[tuple]        # (ip, port) the PROMPT listens on; None for other roles
    pool_bytes: int                # bytes the device pool may hand out (0: every allocation is refused)
    flow_graph_mem_max_size: int
    mem_utilization: float
    enable_switch_role: bool


def parse_v1_listen_ip_info(value: object) -> list:
    """``"ip:port[;ip:port...]"`` -> ``[(ip, port), ...]`` (LLM_PARAM_INVALID when malformed)."""
    if not isinstance(value, str):
        raise TypeError(f"listen_ip_info only support ['str'], but got {type(value)}.")
    out = []
    for part in value.split(";"):
        problem = ip_port_problem(part)
        if problem:   # upstream's text for a malformed address; the range is llmdd's own check
            raise _invalid(f'llm.listenIpInfo "{part}" is invalid, '
                           + ('format should be "ip:port"' if problem == NOT_IP_PORT else f"it {problem}"))
        pieces = part.split(":")
        out.append((pieces[0], int(pieces[1])))
    return out


def _device_ids(opts: Mapping[str, str]) -> tuple:
    value = opts.get(K_DEVICE_ID)
    if value is None:
        return ()
    if not isinstance(value, str):
        raise TypeError(f"{K_DEVICE_ID} only support ['str'], but got {type(value)}.")
    parts = value.split(";")
    if not all(p.isdigit() for p in parts):
        raise _invalid(f'ge.exec.deviceId is invalid, value="{value}", it should be composed of numbers, '
                       f"separated by semicolons.")
    return tuple(int(p) for p in parts)


def _ip_text(ip: object) -> str:
    if isinstance(ip, int) and not isinstance(ip, bool):
        return socket.inet_ntoa(int(ip).to_bytes(4, "little"))
    if isinstance(ip, str) and ip:
        return ip
    raise _invalid(f"llm.ClusterInfo listen_ip_info ip {ip!r} is invalid")


def _ip_int(ip: str) -> int:
    try:
        return int.from_bytes(socket.inet_aton(ip), "little")
    except OSError:
        raise _invalid(f'llm.listenIpInfo ip "{ip}" is not an IPv4 address') from None


def _from_cluster_info(text: object) -> tuple:
    """(device count, listen list) of a caller-given ``llm.ClusterInfo`` JSON."""
    if not isinstance(text, str):
        raise TypeError(f"{K_CLUSTER_INFO} only support ['str'], but got {type(text)}.")
    try:
        info = json.loads(text)
    except ValueError as exc:
        raise _invalid(f"llm.ClusterInfo is not valid JSON: {exc}") from None
    if not isinstance(info, dict):
        raise _invalid("llm.ClusterInfo must be a JSON object")
    devices = info.get("logic_device_id", [None])
    listen = []
    for entry in info.get("listen_ip_info", []) or []:
        if not isinstance(entry, dict) or "ip" not in entry or not isinstance(entry.get("port"), int):
            raise _invalid(f"llm.ClusterInfo listen_ip_info entry {entry!r} is invalid")
        listen.append((_ip_text(entry["ip"]), int(entry["port"])))
    return (len(devices) if isinstance(devices, list) else 1), listen


def _mem_utilization(opts: Mapping[str, str]) -> float:
    text = opts.get(K_MEM_UTILIZATION, str(DEFAULT_MEM_UTILIZATION))
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise _invalid(f"{K_MEM_UTILIZATION} must be a number in [0, 1], but got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise _invalid(f"{K_MEM_UTILIZATION} must be in range [0,1], current:{value}")
    return value


def prepare_v1_options(opts: dict, role: LLMRole, cluster_id: int) -> tuple[dict, V1Settings]:
    """Complete the (already role-tagged) options of a v1 ``init`` in place; returns them and the settings.

    Adds ``llm.ClusterInfo`` as upstream generates it when absent, the PROMPT's
    ``llm.ListenIp``/``llm.ListenPort`` (a DECODER never listens), and the engine's DEVICE
    pool (``llm.MemPoolConfig``, from ``ge.flowGraphMemMaxSize`` x ``llm.MemoryUtilization``);
    a host pool option has no meaning in v1 and is dropped.
    """

    profile = profile_from_options(opts)
    if profile.require_cache_manager:
        raise _invalid(f"the legacy non-cache-manager mode is not supported on {profile.description}; "
                       f"set llm.EnableCacheManager to 1.")
    devices = _device_ids(opts)
    if K_CLUSTER_INFO in opts:
        device_count, listen_list = _from_cluster_info(opts[K_CLUSTER_INFO])
    else:
        if not devices:
            raise _invalid("neither llm.ClusterInfo nor ge.exec.deviceId was specified")
        device_count = len(devices)
        listen_list = []
        cluster_info: dict = {"cluster_id": cluster_id,
                              "logic_device_id": [f"0:0:{i}:0" for i in range(device_count)]}
        if role == LLMRole.PROMPT:
            if K_LISTEN_IP_INFO not in opts:
                raise _invalid("neither llm.ClusterInfo nor llm.listenIpInfo was specified")
            listen_list = parse_v1_listen_ip_info(opts[K_LISTEN_IP_INFO])
            if len(listen_list) != device_count:
                raise _invalid(f"listen ip info num:{len(listen_list)} in llm.listenIpInfo is not equal to "
                               f"device num:{device_count}.")
            cluster_info["listen_ip_info"] = [{"ip": _ip_int(ip), "port": port} for ip, port in listen_list]
        opts[K_CLUSTER_INFO] = json.dumps(cluster_info)
    if device_count != 1:
        raise LLMException(f"llmdd runs one device per engine in the legacy v1 mode; {device_count} devices were "
                           f"configured (one process per device).",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    max_size = opts.get(K_FLOW_GRAPH_MEM)
    max_bytes = int(max_size) if max_size is not None else DEFAULT_FLOW_GRAPH_MEM_MAX_SIZE
    utilization = _mem_utilization(opts)
    pool_bytes = int(max_bytes * utilization)
    if pool_bytes >> V1_PAGE_SHIFT >= 2**32:
        raise _invalid(f"{K_FLOW_GRAPH_MEM}={max_bytes} is too large")
    opts.pop(K_HOST_MEM_POOL, None)
    if pool_bytes > 0:
        opts[K_MEM_POOL] = json.dumps({"memory_size": pool_bytes, "page_shift": V1_PAGE_SHIFT})
    else:
        opts.pop(K_MEM_POOL, None)
    listen = None
    if role == LLMRole.PROMPT and listen_list:
        listen = listen_list[0]
        opts[K_LISTEN_IP] = listen[0]
        opts[K_LISTEN_PORT] = str(listen[1])
    else:
        opts.pop(K_LISTEN_IP, None)
        opts.pop(K_LISTEN_PORT, None)
    switch = opts.get(K_SWITCH_ROLE, "0")
    settings = V1Settings(device_ids=devices or (0,), listen=listen, pool_bytes=pool_bytes,
                          flow_graph_mem_max_size=max_bytes, mem_utilization=utilization,
                          enable_switch_role=switch == "1")
    return opts, settings
