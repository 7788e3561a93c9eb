"""The metrics subscriber turns real lifecycle events of a pull into Prometheus samples."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import llmdd
from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole
from llmdd_metrics import MetricsSubscriber

PROMPT = textwrap.dedent("""
    import sys, numpy as np
    from llmdd import *
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    cfg = LLMConfig(); cfg.enable_cache_manager = True; cfg.listen_ip_info = "127.0.0.1:" + sys.argv[1]
    dd.init(cfg.generate_options())
    src = np.arange(2 * 8 * 4096, dtype=np.uint8).reshape(2, -1)
    dd.cache_manager.register_blocks_cache(CacheDesc(2, [8, 4096], DataType.DT_UINT8),
                                           [int(src[0].ctypes.data), int(src[1].ctypes.data)], BlocksCacheKey(1, 0))
    print("READY", flush=True)
    sys.stdin.readline()
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer_labels", [False, True], ids=["bounded", "peer_labels"])
def test_pull_feeds_counters_histogram_and_link_gauges(peer_labels):
    port = _port()
    prompt = subprocess.Popen([sys.executable, "-c", PROMPT, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    dd = LLMDataDist(LLMRole.DECODER, 2)
    registry = CollectorRegistry()
    try:
        assert prompt.stdout.readline().strip() == "READY"
        cfg = LLMConfig()
        cfg.enable_cache_manager = True
        dd.init(cfg.generate_options())
        sub = MetricsSubscriber(registry=registry, peer_labels=peer_labels)
        dd.add_plugin(sub)
        dst = np.zeros((2, 8 * 4096), dtype=np.uint8)
        cache = dd.cache_manager.register_blocks_cache(CacheDesc(2, [8, 4096], DataType.DT_UINT8),
                                                       [int(dst[0].ctypes.data), int(dst[1].ctypes.data)])
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        assert dd.link_clusters([info], 5000)[0] == llmdd.LLMStatusCode.LLM_SUCCESS
        transport = dd.statistics()["links"][1]["transport"]
        dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [0, 1, 5], [2, 3, 4])
        with pytest.raises(llmdd.LLMException):
            dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [99], [0])  # out of range: refused

        get = registry.get_sample_value
        labels = {"transport": transport, "kind": "pull_blocks"}
        if peer_labels:
            labels["peer"] = "1"
        assert get("llmdd_transfers_total", {**labels, "outcome": "ok"}) == 1
        assert get("llmdd_transfer_bytes_total", {**labels, "direction": "in"}) == 3 * 2 * 4096
        other = {"transport": transport, "kind": "pull_blocks", "outcome": "ok"}
        if not peer_labels:
            other["peer"] = "1"
        assert get("llmdd_transfers_total", other) is None   # the other label set does not exist
        assert get("llmdd_transfer_seconds_count", {"transport": transport, "kind": "pull_blocks"}) == 1
        assert get("llmdd_links", {"transport": transport, "state": "linked"}) == 1
        assert get("llmdd_caches", {"state": "registered"}) == 1
    finally:
        dd.finalize()
        prompt.stdin.write("\n")
        prompt.stdin.flush()
        prompt.wait(timeout=10)
    assert registry.get_sample_value("llmdd_links", {"transport": transport, "state": "linked"}) == 0
