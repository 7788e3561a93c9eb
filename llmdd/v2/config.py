"""``llm_datadist.v2.config``: the cluster / NUMA description of the legacy engine options.

``ClusterConfig`` maps the local rank ids to device ids from ``llm.ClusterInfo`` (its
``logic_device_id`` list) and the NUMA resource file named by ``ge.resourceConfigPath``;
``EngineConfig`` pairs it with the role, and its static helpers generate the NUMA description,
fill in ``llm.ClusterInfo`` / ``ge.resourceConfigPath`` when absent, and split ``ip:port``.
These are plain data transformations; llmdd's engine reads its own options (``_options``,
``_v1.options``) and does not need them.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, Optional, Tuple

from llmdd._base.config import LlmConfig, trans_str_ip
from llmdd._base.enums import LLMRole
from llmdd._base.status import raise_if_false
from llmdd._base.validation import check_isinstance
from llmdd.utils import log

__all__ = ["ClusterConfig", "EngineConfig"]


class ClusterConfig:
    """``rank_id_to_device_id``: the ranks of this process and the device each one drives."""

    def __init__(self, rank_id_to_device_id: Dict[int, int]) -> None:
        self.rank_id_to_device_id = rank_id_to_device_id

    @classmethod
    def from_engine_options(cls, engine_options: Dict[str, str]) -> "ClusterConfig":
        logical_to_rank = cls._parse_rank_mapping(engine_options)
        logical_to_device = cls._parse_numa_config(engine_options)
        if "ge.exec.rankId" in engine_options:
            local_ranks = [int(engine_options["ge.exec.rankId"])]
        else:
            local_ranks = [logical_to_rank[logical] for logical in logical_to_device if logical in logical_to_rank]
        mapping = {rank: logical_to_device[logical] for logical, rank in logical_to_rank.items()
                   if rank in local_ranks}
        raise_if_false(len(mapping) > 0,
                       f"rank_id_to_device_id is empty, logical_device_id_to_rank_id = {logical_to_rank}, "
                       f"logical_device_id_to_device_id = {logical_to_device}")
        return cls(mapping)

    @staticmethod
    def _parse_rank_mapping(engine_options: Dict[str, str]) -> Dict[str, int]:
        raise_if_false("llm.ClusterInfo" in engine_options, "option 'llm.ClusterInfo' is not defined")
        logical_ids = json.loads(engine_options["llm.ClusterInfo"])["logic_device_id"]
        if "ge.exec.deviceId" in engine_options and "ge.exec.rankId" in engine_options:
            ranks = [int(engine_options["ge.exec.rankId"])]
        else:
            ranks = list(range(len(logical_ids)))
        return {logical: rank for rank, logical in zip(ranks, logical_ids)}

    @staticmethod
    def _parse_numa_config(engine_options: Dict[str, str]) -> Dict[str, int]:
        raise_if_false("ge.resourceConfigPath" in engine_options, "option 'ge.resourceConfigPath' is not defined")
        with open(engine_options["ge.resourceConfigPath"]) as f:
            numa = json.load(f)
        logical_to_device: Dict[str, int] = {}
        for c, cluster in enumerate(numa["cluster"]):
            for n, node in enumerate(cluster["cluster_nodes"]):
                if not node.get("is_local", False):
                    continue
                for i, item in enumerate(node["item_list"]):
                    logical_to_device[f"{c}:{n}:{i}:0"] = int(item["item_id"])
        return logical_to_device


class EngineConfig:
    """The role (``is_prompt``) and the ``ClusterConfig`` of an engine."""

    def __init__(self, is_prompt: bool, cluster_config: ClusterConfig) -> None:
        self.is_prompt = is_prompt
        self.cluster_config = cluster_config

    @classmethod
    def from_engine_options(cls, is_prompt: bool, engine_options: Dict[str, str]) -> "EngineConfig":
        return cls(is_prompt, ClusterConfig.from_engine_options(engine_options))

    @staticmethod
    def gen_numa_config(device_id: str, deploy_res_path: Optional[str]) -> str:
        """A one-node NUMA description (JSON text) listing the ``;``-separated ``device_id`` items."""
        items = [{"item_id": int(d), "device_id": int(d), "ipaddr": "192.168.0.1"} for d in device_id.split(";")]
        node = {"node_id": 0, "node_type": "FakeNodeType", "ipaddr": "127.0.0.1", "port": -1, "is_local": True,
                "data_panel": {"avail_ports": "65000~65535"}, "item_list": items}
        numa = {
            "cluster": [{"cluster_nodes": [node]}],
            "node_def": [{"node_type": "FakeNodeType", "resource_type": "Aarch",
                          "support_links": "[HCCS,PCIE,ROCE]", "item_type": "FakeItemType"}],
            "item_def": [{"item_type": "FakeItemType", "resource_type": "Ascend", "memory": "[DDR:64GB]",
                          "aic_type": "[FakeAicType]"}],
        }
        if deploy_res_path is not None:
            check_isinstance("llm.deployResPath", deploy_res_path, str)
            node["deploy_res_path"] = deploy_res_path
        return json.dumps(numa)

    @staticmethod
    def gen_cluster_info_if_not_exist(cluster_id: int, role: LLMRole, engine_options: Dict[str, str]) -> None:
        """Fill in ``llm.ClusterInfo`` (and ``ge.resourceConfigPath``) when the options lack it.

        A PROMPT needs ``llm.listenIpInfo`` with one ``ip:port`` per device.  The NUMA file comes
        from ``$RESOURCE_CONFIG_PATH`` or is generated from ``ge.exec.deviceId`` into the temp dir.
        """
        if "llm.ClusterInfo" in engine_options:
            return
        device_num = len(engine_options["ge.exec.deviceId"].split(";"))
        info: dict = {"cluster_id": cluster_id, "logic_device_id": [f"0:0:{i}:0" for i in range(device_num)]}
        if role == LLMRole.PROMPT:
            raise_if_false("llm.listenIpInfo" in engine_options,
                           "neither llm.ClusterInfo nor llm.listenIp was specified")
            listen = engine_options["llm.listenIpInfo"]
            check_isinstance("listen_ip_info", listen, [str])
            parts = listen.split(";")
            raise_if_false(len(parts) == device_num, f"listen ip info num:{len(parts)} in llm.listenIpInfo is not "
                                                     f"equal to device num:{device_num}.")
            info["listen_ip_info"] = []
            for part in parts:
                ip_port = part.split(":")
                raise_if_false(len(ip_port) == 2,
                               f'llm.listenIpInfo "{ip_port}" is invalid, format should be "ip:port"')
                info["listen_ip_info"].append({"ip": ip_port[0], "port": int(ip_port[1])})
        config = LlmConfig()
        config.cluster_info = json.dumps(info)
        engine_options["llm.ClusterInfo"] = config.gen_options()["llm.ClusterInfo"]
        if "RESOURCE_CONFIG_PATH" in os.environ:
            path = os.getenv("RESOURCE_CONFIG_PATH", "")
        else:
            raise_if_false("ge.exec.deviceId" in engine_options,
                           "neither llm.ClusterInfo nor ge.exec.deviceId was specified")
            device_id = engine_options["ge.exec.deviceId"]
            check_isinstance("ge.exec.deviceId", device_id, [str])
            for dev in device_id.split(";"):
                raise_if_false(dev.isdigit(), f'ge.exec.deviceId is invalid, value="{device_id}", it should be '
                                              f"composed of numbers, separated by semicolons.")
            text = EngineConfig.gen_numa_config(device_id, engine_options.get("llm.deployResPath", None))
            name = f"stub_numa_config_{role.name.lower()}_{'_'.join(device_id.split(';'))}.json"
            path = os.path.join(tempfile.gettempdir(), name)
            with open(path, "w") as f:
                f.write(text)
        engine_options["ge.resourceConfigPath"] = path
        log.info("using numa config: %s", path)

    @staticmethod
    def parse_listen_ip_info(listen_ip_info: str) -> Tuple[int, int]:
        """``"ip:port"`` -> ``(ip as upstream's little-endian int, port)``."""
        check_isinstance("listen_ip_info", listen_ip_info, [str])
        parts = listen_ip_info.split(":")
        raise_if_false(len(parts) == 2, f'llm.listenIpInfo "{listen_ip_info}" is invalid, format should be "ip:port"')
        return trans_str_ip(parts[0]), int(parts[1])
