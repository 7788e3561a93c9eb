"""``LlmConfig`` / ``LLMConfig`` and ``LLMClusterInfo`` of the llm_datadist contract.

Both are upstream's *mutable* configuration holders (hicann/hixl ``docs/zh/api/python/LLMConfig.md``
and ``LLMClusterInfo.md``; options in docs/configuration.md): properties
with validating setters, and ``generate_options()`` turning the config into the
``Dict[str, str]`` that ``LLMDataDist.init`` consumes.

Compatibility notes (upstream behaviour kept on purpose):

* most setters accept ``None`` (upstream's ``check_isinstance`` lets it through),
  which puts an optional option back to "not set";
* ``generate_options()`` returns the *same* dict object every time and only ever
  adds or overwrites keys in it;
* ``llm.MemoryUtilization`` is always emitted, as ``str(mem_utilization)``
  (``"0.95"`` unless the caller changed ``mem_utilization``).

llmdd additions: ``mem_pool_cfg`` / ``host_mem_pool_cfg`` are validated when set
(upstream leaves that to the native engine at ``init``), through
:func:`parse_mem_pool_cfg`, which the memory layer reuses; an empty list of
device ids is rejected when set (upstream would fail later with ``IndexError``).
"""

from __future__ import annotations

import json
import socket
from typing import Any, Dict, List, Optional, Tuple, Union

from llmdd._base.enums import LLMRole
from llmdd._base.status import LLMStatusCode, LLMException, raise_if_false
from llmdd._base.validation import (
    check_dict,
    check_int32,
    check_isinstance,
    check_uint16,
    check_uint32,
    check_uint64,
)

__all__ = [
    "LlmConfig",
    "LLMConfig",
    "LLMClusterInfo",
    "parse_mem_pool_cfg",
    "trans_str_ip",
    "DEFAULT_PAGE_SHIFT",
    "DEFAULT_MEM_UTILIZATION",
]

_UINT32_MAX = 2**32 - 1

#: ``page_shift`` used when a memory-pool config does not give one
DEFAULT_PAGE_SHIFT = 16
_PAGE_SHIFT_MIN = 10  # inclusive
_PAGE_SHIFT_MAX = 31  # exclusive

DEFAULT_MEM_UTILIZATION = 0.95


def trans_str_ip(ip: Union[str, int]) -> int:
    """An IPv4 dotted string to the little-endian int upstream sends; ints pass through.

    ``RuntimeError("Can not parse ip str:<ip>")`` when the string is not an address.
    """
    if isinstance(ip, str):
        try:
            packed = socket.inet_aton(ip)
        except OSError:
            raise RuntimeError(f"Can not parse ip str:{ip}") from None
        return int.from_bytes(packed, byteorder="little")
    return ip


def _pool_error(name: str, detail: str) -> LLMException:
    return LLMException(f"{name} is invalid, {detail}.", status_code=LLMStatusCode.LLM_PARAM_INVALID)


def parse_mem_pool_cfg(text: str, name: str = "mem_pool_cfg") -> Tuple[int, int]:
    """Parse a memory-pool config ``{"memory_size": int, "page_shift": int}``.

    Returns ``(memory_size, page_shift)``.  Rules (from the C++ engine):
    ``memory_size`` is an int > 0; ``page_shift`` is an int in ``[10, 31)``,
    default 16; ``(memory_size >> page_shift) < 2**32`` (page count fits uint32).
    Other keys are ignored.  Any violation, including text that is not a JSON
    object, raises ``LLMException(LLM_PARAM_INVALID)``.
    """
    if not isinstance(text, str):
        raise _pool_error(name, f"expect a JSON str, but got {type(text)}")
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise _pool_error(name, f"not a valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _pool_error(name, f"expect a JSON object, but got {text!r}")
    if "memory_size" not in cfg:
        raise _pool_error(name, "memory_size is required")
    memory_size = cfg["memory_size"]
    # JSON true/false load as bool, an int subclass: not a size
    if not isinstance(memory_size, int) or isinstance(memory_size, bool):
        raise _pool_error(name, f"memory_size must be an integer, but got {memory_size!r}")
    if memory_size <= 0:
        raise _pool_error(name, f"memory_size must be greater than 0, but got {memory_size}")
    page_shift = cfg.get("page_shift", DEFAULT_PAGE_SHIFT)
    if not isinstance(page_shift, int) or isinstance(page_shift, bool):
        raise _pool_error(name, f"page_shift must be an integer, but got {page_shift!r}")
    if not _PAGE_SHIFT_MIN <= page_shift < _PAGE_SHIFT_MAX:
        raise _pool_error(name, f"page_shift must be in range [{_PAGE_SHIFT_MIN}, {_PAGE_SHIFT_MAX}), "
                                f"but got {page_shift}")
    if (memory_size >> page_shift) >= 2**32:
        raise _pool_error(name, f"memory_size >> page_shift must be less than 2^32, memory_size = {memory_size}, "
                                f"page_shift = {page_shift}")
    return memory_size, page_shift


class LLMClusterInfo:
    """The peer to link with (``link_clusters`` / ``unlink_clusters``; docs/links.md).

    IP strings are stored as ``int.from_bytes(socket.inet_aton(ip), "little")``.
    ``remote_role_type`` is kept for compatibility and never sent anywhere.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: Optional[int] = None
        self._remote_role_type: Optional[Union[LLMRole, int]] = None
        self._local_ip_info_list: List[Tuple[int, int]] = []
        self._remote_ip_info_list: List[Tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> Optional[int]:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, remote_cluster_id: int) -> None:
        check_uint64("remote_cluster_id", remote_cluster_id)
        self._remote_cluster_id = int(remote_cluster_id)  # a bool passes the check and is kept as 0/1

    @property
    def remote_role_type(self) -> Optional[Union[LLMRole, int]]:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, remote_role_type: Union[LLMRole, int]) -> None:
        check_isinstance("remote_role_type", remote_role_type, [LLMRole, int])
        self._remote_role_type = remote_role_type

    @property
    def local_ip_info_list(self) -> List[Tuple[int, int]]:
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> List[Tuple[int, int]]:
        return self._remote_ip_info_list

    @staticmethod
    def _check_ip_port(ip: Union[str, int], port: int) -> int:
        check_isinstance("ip", ip, [str, int], allow_none=False)
        check_uint16("port", port)
        return trans_str_ip(ip)

    # A bool passes the int checks, as upstream (whose native layer then reads it as 0/1); it is
    # stored as that int, so the socket layer, which refuses bool ports, gets a plain number.
    def append_local_ip_info(self, ip: Union[str, int], port: int) -> None:
        """Add this side's ip (str or int) and port (uint16)."""
        self._local_ip_info_list.append((int(self._check_ip_port(ip, port)), int(port)))

    def append_remote_ip_info(self, ip: Union[str, int], port: int) -> None:
        """Add the peer's ip (str or int) and port (uint16): where to connect."""
        self._remote_ip_info_list.append((int(self._check_ip_port(ip, port)), int(port)))

    def __repr__(self) -> str:
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
                f"local_ip_info_list={self._local_ip_info_list}, "
                f"remote_ip_info_list={self._remote_ip_info_list})")


class LlmConfig:
    """Builder of the ``LLMDataDist.init`` options (docs/configuration.md).

    Each property has upstream's getter default and setter validation; see the
    module docstring for what llmdd adds.
    """

    def __init__(self) -> None:
        self._options: Dict[str, str] = {}
        self._ge_options: Dict[str, str] = {}
        self._device_id: Optional[Union[int, List[int], Tuple[int, ...]]] = None
        self._sync_kv_timeout: Optional[Union[int, str]] = None
        self._deploy_res_path: Optional[str] = ""
        self._buf_pool_cfg: Optional[str] = ""
        self._mem_pool_cfg: Optional[str] = ""
        self._host_mem_pool_cfg: Optional[str] = ""
        self._enable_cache_manager: Optional[bool] = None
        self._enable_remote_cache_accessible: Optional[bool] = None
        self._listen_ip_info: Optional[str] = ""
        self._link_total_time: Optional[int] = None
        self._link_retry_count: Optional[int] = None
        self._rdma_traffic_class: Optional[int] = None
        self._rdma_service_level: Optional[int] = None
        self._local_comm_res: Optional[str] = None
        self._transfer_backend: Optional[str] = None
        self._global_resource_config: Optional[str] = None
        self._enable_switch_role: Optional[bool] = False
        self._cluster_info: str = ""
        self._output_max_size: Optional[int] = None
        self._mem_utilization: float = DEFAULT_MEM_UTILIZATION

    # ------------------------------------------------------------------ options

    def generate_options(self) -> Dict[str, str]:
        """The options dict for ``LLMDataDist.init`` (same object as ``options``)."""
        return self.gen_options()

    def gen_options(self) -> Dict[str, str]:
        """Fill the internal options dict in upstream's emission order and return it."""
        opts = self._options
        if self._ge_options:
            opts.update(self._ge_options)
        device_id = self._device_id
        if device_id is not None:
            if isinstance(device_id, int):
                opts["ge.exec.deviceId"] = str(device_id)
                opts["ge.session_device_id"] = str(device_id)
            else:
                opts["ge.session_device_id"] = str(device_id[0])
                opts["ge.exec.deviceId"] = ";".join(str(dev) for dev in device_id)
        if self._sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts["llm.deployResPath"] = str(self._deploy_res_path)
        # memory options
        if self._buf_pool_cfg:
            opts["llm.BufPoolCfg"] = str(self._buf_pool_cfg)
        if self._mem_pool_cfg:
            opts["llm.MemPoolConfig"] = str(self._mem_pool_cfg)
        if self._host_mem_pool_cfg:
            opts["llm.HostMemPoolConfig"] = str(self._host_mem_pool_cfg)
        if self._enable_cache_manager is not None:
            opts["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            opts["llm.EnableRemoteCacheAccessible"] = "1" if self._enable_remote_cache_accessible else "0"
        # connection options
        if self._listen_ip_info:
            opts["llm.listenIpInfo"] = str(self._listen_ip_info)
        if self._link_total_time is not None:
            opts["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            opts["llm.LocalCommRes"] = str(self._local_comm_res)
        if self._transfer_backend is not None:
            opts["llm.TransferBackend"] = str(self._transfer_backend)
        if self._global_resource_config is not None:
            opts["llm.GlobalResourceConfig"] = str(self._global_resource_config)
        # offline / v1 options
        if self._cluster_info:
            opts["llm.ClusterInfo"] = str(self._cluster_info)
        if self._output_max_size is not None:
            opts["llm.OutputMaxSize"] = str(self._output_max_size)
        if self._enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        opts["llm.MemoryUtilization"] = str(self._mem_utilization)
        return opts

    @property
    def options(self) -> Dict[str, str]:
        return self._options

    # ------------------------------------------------------------- properties

    @property
    def ge_options(self) -> Dict[str, str]:
        return self._ge_options

    @ge_options.setter
    def ge_options(self, ge_options: Dict[str, str]) -> None:
        check_isinstance("ge_options", ge_options, dict, allow_none=False)
        check_dict("ge_options", ge_options, str, str)
        self._ge_options = ge_options

    @property
    def device_id(self) -> Optional[Union[int, List[int], Tuple[int, ...]]]:
        return self._device_id

    @device_id.setter
    def device_id(self, device_id: Union[int, List[int], Tuple[int, ...]]) -> None:
        check_isinstance("device_id", device_id, [list, tuple, int], allow_none=False)
        if isinstance(device_id, (list, tuple)):
            check_isinstance("device_id", device_id, [list, tuple], int)
            raise_if_false(len(device_id) > 0, "device_id should not be empty.")
            for dev_id in device_id:
                raise_if_false(dev_id >= 0, "device_id should be greater than or equal to zero.")
            for dev_id in device_id:
                check_int32("device_id", dev_id)
        else:
            raise_if_false(device_id >= 0, "device_id should be greater than or equal to zero.")
            check_int32("device_id", device_id)
        self._device_id = device_id

    @property
    def sync_kv_timeout(self) -> Optional[Union[int, str]]:
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, sync_kv_timeout: Union[int, str]) -> None:
        check_isinstance("sync_kv_timeout", sync_kv_timeout, [int, str], allow_none=False)
        if isinstance(sync_kv_timeout, str):
            raise_if_false(sync_kv_timeout.isdigit(), "sync_kv_timeout must be digit.")
        raise_if_false(int(sync_kv_timeout) > 0, "sync_kv_timeout should be greater than zero.")
        check_int32("sync_kv_timeout", int(sync_kv_timeout))
        self._sync_kv_timeout = sync_kv_timeout

    @property
    def deploy_res_path(self) -> Optional[str]:
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, deploy_res_path: str) -> None:
        check_isinstance("deploy_res_path", deploy_res_path, str)
        self._deploy_res_path = deploy_res_path

    @property
    def buf_pool_cfg(self) -> Optional[str]:
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, buf_pool_cfg: str) -> None:
        check_isinstance("buf_pool_cfg", buf_pool_cfg, str)
        self._buf_pool_cfg = buf_pool_cfg

    @property
    def mem_pool_cfg(self) -> Optional[str]:
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, mem_pool_cfg: str) -> None:
        check_isinstance("mem_pool_cfg", mem_pool_cfg, str)
        if mem_pool_cfg:
            parse_mem_pool_cfg(mem_pool_cfg, "mem_pool_cfg")
        self._mem_pool_cfg = mem_pool_cfg

    @property
    def host_mem_pool_cfg(self) -> Optional[str]:
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, host_mem_pool_cfg: str) -> None:
        check_isinstance("host_mem_pool_cfg", host_mem_pool_cfg, str)
        if host_mem_pool_cfg:
            parse_mem_pool_cfg(host_mem_pool_cfg, "host_mem_pool_cfg")
        self._host_mem_pool_cfg = host_mem_pool_cfg

    @property
    def enable_cache_manager(self) -> bool:
        return False if self._enable_cache_manager is None else self._enable_cache_manager

    @enable_cache_manager.setter
    def enable_cache_manager(self, enable_cache_manager: bool) -> None:
        check_isinstance("enable_cache_manager", enable_cache_manager, [bool])
        self._enable_cache_manager = enable_cache_manager

    @property
    def enable_remote_cache_accessible(self) -> bool:
        return False if self._enable_remote_cache_accessible is None else self._enable_remote_cache_accessible

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, enable_remote_cache_accessible: bool) -> None:
        check_isinstance("enable_remote_cache_accessible", enable_remote_cache_accessible, [bool])
        self._enable_remote_cache_accessible = enable_remote_cache_accessible

    @property
    def listen_ip_info(self) -> Optional[str]:
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, listen_ip_info: str) -> None:
        check_isinstance("listen_ip_info", listen_ip_info, str)
        self._listen_ip_info = listen_ip_info

    @property
    def link_total_time(self) -> int:
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, link_total_time: int) -> None:
        check_isinstance("link_total_time", link_total_time, int, allow_none=False)
        raise_if_false(0 <= link_total_time <= _UINT32_MAX,
                       "link_total_time should be an integer between [0, 2^32-1], given value is {0}",
                       link_total_time)
        self._link_total_time = link_total_time

    @property
    def link_retry_count(self) -> int:
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, link_retry_count: int) -> None:
        check_isinstance("link_retry_count", link_retry_count, int, allow_none=False)
        raise_if_false(1 <= link_retry_count <= 100,
                       "link_retry_count should be an integer between [1, 100], given value is {0}",
                       link_retry_count)
        self._link_retry_count = link_retry_count

    @property
    def rdma_traffic_class(self) -> Optional[int]:
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, rdma_traffic_class: int) -> None:
        check_uint32("rdma_traffic_class", rdma_traffic_class)
        self._rdma_traffic_class = rdma_traffic_class

    @property
    def rdma_service_level(self) -> Optional[int]:
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, rdma_service_level: int) -> None:
        check_uint32("rdma_service_level", rdma_service_level)
        self._rdma_service_level = rdma_service_level

    @property
    def local_comm_res(self) -> str:
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, local_comm_res: str) -> None:
        check_isinstance("local_comm_res", local_comm_res, str)
        self._local_comm_res = local_comm_res

    @property
    def transfer_backend(self) -> str:
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, transfer_backend: str) -> None:
        check_isinstance("transfer_backend", transfer_backend, str)
        self._transfer_backend = transfer_backend

    @property
    def global_resource_config(self) -> str:
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, global_resource_config: str) -> None:
        check_isinstance("global_resource_config", global_resource_config, str)
        self._global_resource_config = global_resource_config

    @property
    def enable_switch_role(self) -> Optional[bool]:
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, enable_switch_role: bool) -> None:
        check_isinstance("enable_switch_role", enable_switch_role, [bool])
        self._enable_switch_role = enable_switch_role

    @property
    def cluster_info(self) -> str:
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, cluster_info: str) -> None:
        check_isinstance("cluster_info", cluster_info, str, allow_none=False)
        info: Any = json.loads(cluster_info)
        if isinstance(info, dict) and "listen_ip_info" in info:
            for ip_info in info["listen_ip_info"]:
                ip_info["ip"] = trans_str_ip(ip_info["ip"])
        self._cluster_info = json.dumps(info)

    @property
    def output_max_size(self) -> Optional[int]:
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, output_max_size: int) -> None:
        check_isinstance("output_max_size", output_max_size, int)
        self._output_max_size = output_max_size

    @property
    def mem_utilization(self) -> float:
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, mem_utilization: float) -> None:
        check_isinstance("mem_utilization", mem_utilization, float, allow_none=False)
        raise_if_false(0.0 <= mem_utilization <= 1.0,
                       "mem_utilization must be in range [0,1], current:{0}", mem_utilization)
        self._mem_utilization = mem_utilization


LLMConfig = LlmConfig
