"""A bool where upstream expects a port or an integer.

Upstream's checks are ``isinstance(value, int)`` plus a range test, and ``bool`` is an ``int``:
``True``/``False`` pass as 1/0 wherever a Python int is taken (ports, cluster ids, indices,
timeouts).  Where the value only becomes an option string (``str(True)`` = ``"True"``), the
native layer cannot read it as a number and ``init`` refuses the options.  llmdd does the same;
the link case runs across two processes (port ``True`` is port 1, so the prompt listens there).
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import pytest

from llmdd import (CacheDesc, CacheKeyByIdAndIndex, DataType, LLMClusterInfo, LLMConfig, LLMDataDist,
                   LLMException, LLMRole, LLMStatusCode, Placement, TransferWithCacheKeyConfig)

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402
import _upstream_peers as U  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT, DECODER = 1, 2

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _no_engine_left():
    yield
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()


def test_cluster_info_takes_bools_as_ints():
    info = LLMClusterInfo()
    info.remote_cluster_id = True
    info.append_local_ip_info("127.0.0.1", False)
    info.append_remote_ip_info(0x0100007F, True)
    # equal to what upstream stores (the bools); kept as plain ints (docs/deviations.md)
    assert info.remote_cluster_id == True and type(info.remote_cluster_id) is int  # noqa: E712
    assert info.local_ip_info_list == [(0x0100007F, False)] and info.remote_ip_info_list == [(0x0100007F, True)]
    assert [type(port) for _, port in info.local_ip_info_list + info.remote_ip_info_list] == [int, int]
    with pytest.raises(TypeError):
        info.append_remote_ip_info("127.0.0.1", 1.0)   # control: a float is no int


def test_value_types_take_bools_as_ints():
    key = CacheKeyByIdAndIndex(True, 3, False)
    assert (key.cluster_id, key.batch_index) == (1, 0) and key == CacheKeyByIdAndIndex(1, 3, 0)
    cfg = TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1), src_batch_index=True)
    assert cfg.src_batch_index == 1
    assert {type(v) for v in (key.cluster_id, key.batch_index, cfg.src_batch_index)} == {int}
    desc = CacheDesc(True, [2, 4], DataType.DT_UINT8, Placement.DEVICE)
    assert desc.num_tensors == 1 and desc.size == 8


@pytest.mark.parametrize("prop", ["rdma_service_level", "rdma_traffic_class", "device_id", "sync_kv_timeout",
                                  "link_total_time", "link_retry_count"])
def test_a_bool_that_becomes_an_option_string_is_refused_at_init(prop):
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    setattr(cfg, prop, True)          # accepted by the setter, as upstream
    options = cfg.generate_options()
    assert "True" in options.values()
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as info:
        dd.init(options)
    assert info.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert LLMDataDist.llm_engine_instance is None
    # control: the same option with an int initializes
    setattr(cfg, prop, 1 if prop != "sync_kv_timeout" else 1000)
    dd.init(cfg.generate_options())
    dd.finalize()


def _port_one_free() -> bool:
    try:
        with socket.create_server(("127.0.0.1", 1)):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


def test_link_to_port_true_is_port_one_across_processes(peer_pool):
    if not _port_one_free():
        pytest.skip("port 1 cannot be bound here (needs privileges)")
    p, d, _ = peer_pool.pair("tcp", prompt_kw={"remote_accessible": True, "extra": {"llm.listenIpInfo": "127.0.0.1:1"}},
                             decoder_kw={"remote_accessible": True})
    assert p.call(U.statistics_listen) == ["127.0.0.1", 1]
    dst_id = p.call(P.register, "dst", 2, [2, 128], blocks=False)
    d.call(P.register, "src", 2, [2, 128], blocks=False, seed=41)
    assert d.call(U.link_bool_port, PROMPT) == ["LLM_SUCCESS", "LLM_SUCCESS"]
    d.call(P.cm, "push_cache", CacheKeyByIdAndIndex(True, dst_id, False), P.Ref("src"), src_batch_index=True)
    src = d.call(P.snapshot, "src").reshape(2, 2, 128)
    dst = p.call(P.snapshot, "dst").reshape(2, 2, 128)
    assert np.array_equal(dst[:, 0], src[:, 1]) and not dst[:, 1].any()
