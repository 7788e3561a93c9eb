"""The ``LLMDataDist`` facade against the contract (spec sections 3, 4.1 and 6; clients.md 1, 4, 5, 9).

One engine per process: every test that initializes one leaves ``llm_engine_instance``
``None`` (the autouse fixture finalizes whatever is still live).  Every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Iterator

import numpy as np
import pytest

from llmdd import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

S = LLMStatusCode
PARAM = S.LLM_PARAM_INVALID
CM = {"llm.EnableCacheManager": "1"}
POOL = '{"memory_size": 1048576, "page_shift": 12}'


@pytest.fixture(autouse=True)
def _one_engine_per_test() -> Iterator[None]:
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()
    LLMDataDist.llm_engine_instance = None
    yield
    live = LLMDataDist.llm_engine_instance
    if live is not None:
        live.finalize()
    LLMDataDist.llm_engine_instance = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(options: dict | None = None, role: LLMRole = LLMRole.DECODER, cluster_id: int = 7) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    dd.init(dict(CM) if options is None else options)
    return dd


@pytest.fixture
def dd() -> LLMDataDist:
    return engine()


def cluster(remote_id=9, local=("127.0.0.1", 0), remote=None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    if remote_id is not None:
        info.remote_cluster_id = remote_id
    if local is not None:
        info.append_local_ip_info(*local)
    if remote is not None:
        info.append_remote_ip_info(*remote)
    return info


# ----------------------------------------------------------------- constructor, properties

@pytest.mark.parametrize("role", [None, 1, "PROMPT", 1.0, LLMRole])
def test_ctor_role_must_be_llmrole(role):
    with pytest.raises(TypeError):
        LLMDataDist(role, 1)


@pytest.mark.parametrize("cluster_id, exc", [
    (None, TypeError), (1.0, TypeError), ("1", TypeError), (-1, ValueError), (2**64, ValueError),
])
def test_ctor_cluster_id_is_uint64(cluster_id, exc):
    with pytest.raises(exc):
        LLMDataDist(LLMRole.PROMPT, cluster_id)


@pytest.mark.parametrize("cluster_id", [0, 1, 2**64 - 1, (0x0A000001 << 32) | (26003 << 16) | 8, True])
def test_ctor_cluster_id_property(cluster_id):
    dd = LLMDataDist(LLMRole.MIX, cluster_id)
    assert dd.cluster_id == cluster_id
    assert LLMDataDist.llm_engine_instance is None  # the constructor does nothing process-wide


@pytest.mark.parametrize("role, text", [
    (LLMRole.PROMPT, "Prompt"), (LLMRole.DECODER, "Decoder"), (LLMRole.MIX, "Mix"),
])
def test_role_to_str(role, text):
    assert LLMDataDist._role_to_str(role) == text


# ----------------------------------------------------------------- init / finalize lifecycle

@pytest.mark.parametrize("options", [None, [], "llm.EnableCacheManager=1", (("llm.EnableCacheManager", "1"),)])
def test_init_options_must_be_dict(options):
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(TypeError):
        dd.init(options)
    assert LLMDataDist.llm_engine_instance is None


@pytest.mark.parametrize("given, expected", [
    (CM, {"llm.Role": "Decoder", "llm.EnableCacheManager": "1"}),
    ({"llm.LocalCommRes": ""},
     {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1", "llm.LocalCommRes": ""}),
    ({"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"},
     {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "0"}),
    ({**CM, "llm.listenIpInfo": "127.0.0.1:0"}, {"llm.ListenIp": "127.0.0.1", "llm.ListenPort": "0"}),
    ({**CM, "llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:0"},
     {"llm.EnableRemoteCacheAccessible": "1", "llm.TransferBackend": "hixl"}),
    ({**CM, "ge.flowGraphMemMaxSize": "1073741824"}, {"ge.flowGraphMemMaxSize": "1073741824"}),
])
def test_init_injects_options(given, expected):
    snapshot = dict(given)
    dd = engine(given)
    for key, value in expected.items():
        assert dd._engine_options[key] == value, key
    assert given == snapshot  # the caller's dict is untouched
    assert LLMDataDist.llm_engine_instance is dd


@pytest.mark.parametrize("given, exc, needle", [
    ({"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"}, LLMException, "EnableCacheManager"),
    ({"llm.TransferBackend": "hixl", "llm.listenIpInfo": "127.0.0.1:0"}, LLMException, "EnableCacheManager"),
    ({**CM, "llm.TransferBackend": "hixl", "llm.EnableRemoteCacheAccessible": "0",
      "llm.listenIpInfo": "127.0.0.1:0"}, LLMException, "EnableRemoteCacheAccessible"),
    ({**CM, "llm.TransferBackend": "hixl"}, LLMException, "listenIpInfo"),
    ({**CM, "llm.listenIpInfo": "127.0.0.1"}, LLMException, "listenIpInfo"),
    ({**CM, "llm.listenIpInfo": "127.0.0.1:1:2"}, LLMException, "listenIpInfo"),
    ({**CM, "ge.flowGraphMemMaxSize": "1,2"}, LLMException, "flowGraphMemMaxSize"),
    ({**CM, "ge.flowGraphMemMaxSize": 1024}, TypeError, "flowGraphMemMaxSize"),
    ({**CM, "llm.SyncKvCacheWaitTime": "0"}, LLMException, "SyncKvCacheWaitTime"),
    ({"llm.LocalCommRes": "{not json"}, LLMException, "local_comm_res"),
])
def test_init_refuses_bad_options(given, exc, needle):
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(exc) as info:
        dd.init(given)
    assert needle in str(info.value)
    if exc is LLMException:
        assert info.value.status_code is PARAM
    assert LLMDataDist.llm_engine_instance is None
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        dd.cache_manager


@pytest.mark.parametrize("given, v1_selected", [
    ({}, False),
    ({"llm.EnableCacheManager": "0"}, False),
    ({"ge.exec.deviceId": "0", "llm.listenIpInfo": "127.0.0.1:0", "llm.MemoryUtilization": "0.95"}, True),
    (LLMConfig().generate_options(), False),
])
def test_init_without_cache_manager_is_v1_mode(given, v1_selected):
    """Legacy v1 mode (docs/v1.md): selected without llm.EnableCacheManager; it needs ge.exec.deviceId."""
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    if not v1_selected:
        with pytest.raises(LLMException) as info:
            dd.init(given)
        assert info.value.status_code is S.LLM_PARAM_INVALID and "ge.exec.deviceId" in str(info.value)
        assert LLMDataDist.llm_engine_instance is None
        return
    dd.init(given)
    assert type(dd.kv_cache_manager).__name__ == "KvCacheManager"


def test_second_instance_refused():
    first = engine(role=LLMRole.PROMPT, cluster_id=1)
    second = LLMDataDist(LLMRole.DECODER, 2)
    with pytest.raises(LLMException, match="Cannot init multiple LLMDataDists") as info:
        second.init(dict(CM))
    assert info.value.status_code is S.LLM_FAILED
    assert LLMDataDist.llm_engine_instance is first
    first.finalize()
    second.init(dict(CM))  # free again once the first one is finalized
    assert LLMDataDist.llm_engine_instance is second


def test_init_twice_is_a_noop(dd):
    cm = dd.cache_manager
    options = dict(dd._engine_options)
    dd.init({**CM, "llm.listenIpInfo": "127.0.0.1:0"})  # ignored: already initialized
    assert dd.cache_manager is cm and dd._engine_options == options
    assert dd.statistics()["listen"] is None


def test_finalize_when_not_initialized_is_a_noop():
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.finalize()
    dd.finalize()
    assert LLMDataDist.llm_engine_instance is None


def test_finalize_then_init_again_on_the_same_object():
    # omni-infer / omni_npu: finalize() then init(saved_options) on the same object
    options = {**CM, "llm.MemPoolConfig": POOL, "llm.listenIpInfo": "127.0.0.1:0"}
    dd = engine(options, role=LLMRole.PROMPT)
    first = dd.cache_manager.allocate_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT))
    second = dd.cache_manager.allocate_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT))
    assert (first.cache_id, second.cache_id) == (1, 2)
    old_cm = dd.cache_manager
    dd.finalize()
    dd.finalize()
    assert LLMDataDist.llm_engine_instance is None
    dd.init(options)
    assert LLMDataDist.llm_engine_instance is dd
    cm = dd.cache_manager
    assert cm is not old_cm
    # cache ids start at 1 per engine instance (CacheKeyByIdAndIndex(cache_id=1) clients rely on it)
    again = cm.allocate_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT))
    assert again.cache_id == 1
    assert dd.statistics()["listen"][0] == "127.0.0.1" and dd.statistics()["listen"][1] > 0
    dd.finalize()
    dd.init(options)  # and once more
    assert dd.cache_manager.allocate_cache(CacheDesc(1, [1, 4], DataType.DT_FLOAT)).cache_id == 1


def test_cache_manager_before_init():
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(RuntimeError, match="^llm datadist is not initialized$") as info:
        dd.cache_manager
    assert not isinstance(info.value, LLMException)


@pytest.mark.parametrize("call", [
    lambda dd: dd.kv_cache_manager,
    lambda dd: dd.statistics(),
    lambda dd: dd.link_clusters([cluster()], 1000),
    lambda dd: dd.unlink_clusters([cluster()], 1000),
    lambda dd: dd.switch_role(LLMRole.PROMPT),
    lambda dd: dd.link("c", {1: 0, 2: 1}, "{}"),
    lambda dd: dd.unlink(1),
    lambda dd: dd.query_register_mem_status(1),
])
def test_calls_before_init(call):
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        call(LLMDataDist(LLMRole.PROMPT, 1))


def test_kv_cache_manager_refused_in_cache_mode(dd):
    with pytest.raises(LLMException) as info:
        dd.kv_cache_manager
    assert info.value.status_code is S.LLM_PARAM_INVALID  # upstream: raise_if_false's default status


_DESC = CacheDesc(1, [4, 16], DataType.DT_FLOAT)


@pytest.mark.parametrize("name, call", [
    ("register_cache", lambda cm, buf: cm.register_cache(_DESC, [buf.ctypes.data])),
    ("register_blocks_cache", lambda cm, buf: cm.register_blocks_cache(_DESC, [buf.ctypes.data], BlocksCacheKey(7))),
    ("unregister_cache", lambda cm, buf: cm.unregister_cache(1)),
    ("allocate_cache", lambda cm, buf: cm.allocate_cache(_DESC)),
    ("allocate_blocks_cache", lambda cm, buf: cm.allocate_blocks_cache(_DESC)),
    ("remove_cache_key", lambda cm, buf: cm.remove_cache_key(CacheKey(7, req_id=1))),
    ("pull_blocks", lambda cm, buf: cm.pull_blocks(BlocksCacheKey(9), None, [0], [0])),
    ("pull_cache", lambda cm, buf: cm.pull_cache(CacheKeyByIdAndIndex(9, 1, 0), None)),
    ("push_blocks", lambda cm, buf: cm.push_blocks(BlocksCacheKey(9), None, [0], [0])),
    ("push_cache", lambda cm, buf: cm.push_cache(CacheKeyByIdAndIndex(9, 1, 0), None)),
])
def test_cache_manager_methods_after_finalize(name, call):
    dd = engine({**CM, "llm.MemPoolConfig": POOL})
    cm = dd.cache_manager
    buf = np.zeros((4, 16), np.float32)
    dd.finalize()
    with pytest.raises(LLMException, match="llm datadist is not initialized") as info:
        call(cm, buf)
    assert info.value.status_code is S.LLM_ENGINE_FINALIZED
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        dd.cache_manager


def test_listen_port_in_use_is_a_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        with pytest.raises(LLMException) as info:
            dd.init({**CM, "llm.listenIpInfo": f"127.0.0.1:{port}"})
        assert f"127.0.0.1:{port}" in str(info.value)
        assert info.value.status_code is not S.LLM_SUCCESS
        assert LLMDataDist.llm_engine_instance is None
        # the failed init left nothing behind: the same object can init on a free port
        dd.init({**CM, "llm.listenIpInfo": "127.0.0.1:0"})
        assert dd.statistics()["listen"][1] not in (0, port)


# ----------------------------------------------------------------- verified LLMConfig outputs (spec 4)

def test_vllm_ascend_config_inits():
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 33064
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    options = cfg.generate_options()
    assert options == {'ge.exec.deviceId': '0', 'ge.session_device_id': '0', 'llm.SyncKvCacheWaitTime': '33064',
                       'llm.EnableCacheManager': '1', 'llm.EnableRemoteCacheAccessible': '1',
                       'llm.EnableSwitchRole': '1', 'llm.MemoryUtilization': '0.95'}
    dd = LLMDataDist(LLMRole.DECODER, int("2"))
    dd.init(options)
    assert dd._engine_options == {**options, "llm.Role": "Decoder"}
    assert dd.statistics()["listen"] is None  # a client: links are made with link()
    buf = np.zeros((8, 4, 2, 16), np.float16)
    cache = dd.cache_manager.register_blocks_cache(CacheDesc(1, [8, 4, 2, 16], DataType.DT_FLOAT16),
                                                   [buf.ctypes.data], BlocksCacheKey(cluster_id=2))
    assert cache.cache_id == 1


def test_omni_infer_prefill_config_inits():
    port = free_port()
    cfg = LLMConfig()
    cfg.device_id = 3
    cfg.local_comm_res = ""
    cfg.sync_kv_timeout = 5000
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    options = cfg.generate_options()
    assert options == {'ge.exec.deviceId': '3', 'ge.session_device_id': '3', 'llm.SyncKvCacheWaitTime': '5000',
                       'llm.EnableRemoteCacheAccessible': '1', 'llm.listenIpInfo': f'127.0.0.1:{port}',
                       'llm.LocalCommRes': '', 'llm.MemoryUtilization': '0.95'}
    cluster_id = (int.from_bytes(socket.inet_aton("127.0.0.1"), "big") << 32) | (port << 16) | 8
    dd = LLMDataDist(LLMRole.PROMPT, cluster_id)
    dd.init(options)
    assert options == cfg.generate_options() and "llm.Role" not in options  # not mutated
    assert dd._engine_options == {**options, "llm.Role": "Prompt", "llm.EnableCacheManager": "1",
                                  "llm.ListenIp": "127.0.0.1", "llm.ListenPort": str(port)}
    assert dd.statistics()["listen"] == ("127.0.0.1", port)
    assert dd.cluster_id == cluster_id
    # omni-infer gen 2 then finalizes and re-inits with the saved options
    dd.finalize()
    dd.init(options)
    assert dd.statistics()["listen"] == ("127.0.0.1", port)


def test_omni_npu_decoder_port_zero_config_inits():
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 120000
    cfg.enable_remote_cache_accessible = True
    cfg.local_comm_res = ""
    cfg.listen_ip_info = "127.0.0.1:0"  # auto-assigned port
    cfg.transfer_backend = "hixl"
    dd = LLMDataDist(LLMRole.DECODER, 0xFFFF_FFFF_FFFF_FFFF)
    dd.init(cfg.generate_options())
    host, port = dd.statistics()["listen"]
    assert host == "127.0.0.1" and port > 0


# ----------------------------------------------------------------- link_clusters / unlink_clusters arguments

@pytest.mark.parametrize("timeout, exc", [
    (1.5, TypeError), ("3000", TypeError), (None, TypeError), (2**31, ValueError), (-(2**31) - 1, ValueError),
    (0, LLMException), (-1, LLMException),
])
@pytest.mark.parametrize("method", ["link_clusters", "unlink_clusters"])
def test_cluster_timeout_checks(dd, method, timeout, exc):
    with pytest.raises(exc) as info:
        getattr(dd, method)([cluster()], timeout)
    if exc is LLMException:
        assert info.value.status_code is PARAM


@pytest.mark.parametrize("clusters", [None, cluster(), [1], [cluster(), "x"], {cluster()}, "abc"])
@pytest.mark.parametrize("method", ["link_clusters", "unlink_clusters"])
def test_clusters_must_be_list_of_cluster_info(dd, method, clusters):
    with pytest.raises(TypeError):
        getattr(dd, method)(clusters, 1000)


@pytest.mark.parametrize("method", ["link_clusters", "unlink_clusters"])
def test_remote_cluster_id_required(dd, method):
    with pytest.raises(TypeError):
        getattr(dd, method)([cluster(remote_id=None)], 1000)


@pytest.mark.parametrize("options", [CM, {"llm.LocalCommRes": ""}])
def test_link_clusters_needs_local_ip_without_local_comm_res(options):
    dd = engine(options)
    with pytest.raises(LLMException, match="local_ip_info_list is empty") as info:
        dd.link_clusters([cluster(local=None, remote=("127.0.0.1", free_port()))], 1000)
    assert info.value.status_code is PARAM


def test_link_clusters_local_ip_optional_with_local_comm_res():
    dd = engine({"llm.LocalCommRes": '{"version": "1.3"}'})
    ret, codes = dd.link_clusters([cluster(local=None, remote=("127.0.0.1", free_port()))], 1000)
    assert ret is S.LLM_LINK_FAILED and codes == [S.LLM_LINK_FAILED]


@pytest.mark.parametrize("force", [1, 0, "True", None])
def test_unlink_force_must_be_bool(dd, force):
    with pytest.raises(TypeError):
        dd.unlink_clusters([cluster()], 1000, force=force)


def test_link_clusters_empty_list(dd):
    assert dd.link_clusters([], 1000) == (S.LLM_SUCCESS, [])
    assert dd.unlink_clusters((), 1000) == (S.LLM_SUCCESS, [])


def test_link_clusters_too_many(dd):
    port = free_port()
    clusters = [cluster(remote_id=i, remote=("127.0.0.1", port)) for i in range(17)]
    start = time.monotonic()
    ret, codes = dd.link_clusters(clusters, 1000)
    assert ret is S.LLM_CLUSTER_NUM_EXCEED_LIMIT
    assert codes == [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * 17
    assert time.monotonic() - start < 0.5
    assert dd.statistics()["links"] == {}
    ret, codes = dd.unlink_clusters(clusters, 1000, force=True)
    assert ret is S.LLM_CLUSTER_NUM_EXCEED_LIMIT and len(codes) == 17


def test_link_clusters_nothing_listening(dd):
    timeout = 1000
    start = time.monotonic()
    ret, codes = dd.link_clusters((cluster(remote=("127.0.0.1", free_port())),), timeout)
    assert time.monotonic() - start < timeout / 1000 + 0.5
    assert ret is S.LLM_LINK_FAILED and codes == [S.LLM_LINK_FAILED]
    assert dd.statistics()["links"] == {}


def test_link_clusters_silent_server_times_out(dd):
    """A server that accepts but never answers the handshake: the link fails within the timeout."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        accepted = []
        stop = threading.Event()

        def accept() -> None:
            silent.settimeout(0.1)
            while not stop.is_set():
                try:
                    conn, _ = silent.accept()
                    accepted.append(conn)
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            timeout = 600
            start = time.monotonic()
            ret, codes = dd.link_clusters([cluster(remote=("127.0.0.1", port)), cluster(
                remote_id=10, remote=("127.0.0.1", port))], timeout)
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            thread.join(2.0)
            for conn in accepted:
                conn.close()
    assert elapsed < timeout / 1000 + 0.5
    assert ret is S.LLM_LINK_FAILED and codes == [S.LLM_LINK_FAILED, S.LLM_LINK_FAILED]


def test_link_clusters_without_remote_ip_does_not_raise(dd):
    ret, codes = dd.link_clusters([cluster()], 500)
    assert ret is not S.LLM_SUCCESS and codes == [ret]


def test_unlink_clusters_unknown(dd):
    ret, codes = dd.unlink_clusters([cluster(local=None, remote=("127.0.0.1", free_port()))], 1000)
    assert ret is not S.LLM_SUCCESS and codes == [ret]
    assert dd.unlink_clusters([cluster(local=None)], 1000, force=True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    # force with only remote_cluster_id (omni_npu GC)
    info = LLMClusterInfo()
    info.remote_cluster_id = 12345
    assert dd.unlink_clusters([info], timeout=5000, force=True) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])


# ----------------------------------------------------------------- switch_role

def test_switch_role_starts_and_stops_listening(dd):
    assert dd.statistics()["listen"] is None
    port = free_port()
    dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
    stats = dd.statistics()
    assert stats["listen"] == ("127.0.0.1", port) and stats["role"] == "PROMPT"
    assert dd._engine_options["llm.Role"] == "Prompt"
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # really listening
    dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})  # same role: allowed
    assert dd.statistics()["listen"] == ("127.0.0.1", port)
    dd.switch_role(LLMRole.DECODER)  # no listen option: stop listening, become a client
    stats = dd.statistics()
    assert stats["listen"] is None and stats["role"] == "DECODER"
    assert dd._engine_options["llm.Role"] == "Decoder"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_switch_role_with_full_config_options(dd):
    # switch_role_sample.py: switch_role(PROMPT, LLMConfig(listen_ip_info=...).generate_options())
    cfg = LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    dd.switch_role(LLMRole.PROMPT, cfg.generate_options())
    host, port = dd.statistics()["listen"]
    assert host == "127.0.0.1" and port > 0
    dd.switch_role(LLMRole.MIX, {})
    assert dd.statistics()["listen"] is None and dd.statistics()["role"] == "MIX"


@pytest.mark.parametrize("role, options, exc", [
    (None, None, TypeError),
    (1, None, TypeError),
    ("PROMPT", None, TypeError),
    (LLMRole.PROMPT, [("llm.listenIpInfo", "127.0.0.1:0")], TypeError),
    (LLMRole.PROMPT, "llm.listenIpInfo=127.0.0.1:0", TypeError),
    (LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1"}, LLMException),
    (LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:1:2"}, LLMException),
])
def test_switch_role_argument_checks(dd, role, options, exc):
    with pytest.raises(exc):
        dd.switch_role(role, options)
    assert dd.statistics()["role"] == "DECODER" and dd.statistics()["listen"] is None


def test_switch_role_listen_port_in_use(dd):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(LLMException, match=f"127.0.0.1:{port}"):
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})


# ----------------------------------------------------------------- link / unlink / query_register_mem_status

def _table(*devices) -> str:
    return json.dumps({"version": "1.2", "server_count": "1", "status": "completed", "server_list": [
        {"server_id": "127.0.0.1", "device": [
            {"device_id": str(i), "device_ip": "127.0.0.1", "rank_id": str(i)} for i in range(len(devices))]}]})


@pytest.mark.parametrize("comm_name, info, table, exc, needle", [
    (1, {1: 0, 2: 1}, "{}", TypeError, "comm_name"),
    (None, {1: 0, 2: 1}, "{}", TypeError, "comm_name"),
    ("", {1: 0, 2: 1}, "{}", LLMException, "comm_name"),
    ("x" * 128, {1: 0, 2: 1}, "{}", LLMException, "comm_name"),
    ("c", None, "{}", TypeError, "cluster_rank_info"),
    ("c", [(1, 0), (2, 1)], "{}", TypeError, "cluster_rank_info"),
    ("c", {"1": 0, 2: 1}, "{}", TypeError, "cluster_rank_info"),
    ("c", {1.0: 0, 2: 1}, "{}", TypeError, "cluster_rank_info"),
    ("c", {-1: 0, 2: 1}, "{}", ValueError, "cluster_rank_info"),
    ("c", {2**64: 0, 2: 1}, "{}", ValueError, "cluster_rank_info"),
    ("c", {1: -1, 2: 1}, "{}", ValueError, "cluster_rank_info"),
    ("c", {1: 2**32, 2: 1}, "{}", ValueError, "cluster_rank_info"),
    ("c", {1: "0", 2: 1}, "{}", TypeError, "cluster_rank_info"),
    ("c", {i: i for i in range(1, 6)}, "{}", LLMException, "4"),
    ("c", {1: 0}, "{}", LLMException, "cluster num must be bigger than 1."),
    ("c", {}, "{}", LLMException, "cluster num must be bigger than 1."),
    ("c", {1: 1, 2: 0}, "{}", LLMException, "ascending"),
    ("c", {1: 0, 2: 2, 3: 1}, "{}", LLMException, "ascending"),
    ("c", {1: 0, 2: 1}, None, TypeError, "rank_table"),
    ("c", {1: 0, 2: 1}, {"version": "1.2"}, TypeError, "rank_table"),
    ("c", {1: 0, 2: 1}, "not json", LLMException, "rank_table"),
])
def test_link_argument_checks(dd, comm_name, info, table, exc, needle):
    with pytest.raises(exc) as raised:
        dd.link(comm_name, info, table)
    assert needle in str(raised.value)
    if exc is LLMException:
        assert raised.value.status_code is PARAM
    assert dd.cache_manager._is_call_linked is False


def test_link_comm_name_of_127_chars_passes_the_name_check(dd):
    with pytest.raises(LLMException) as raised:
        dd.link("x" * 127, {1: 0, 2: 1}, "not json")
    assert "comm_name" not in str(raised.value) and "rank_table" in str(raised.value)


def test_link_engine_not_a_member(dd):
    # cluster 7 (this engine) is not in cluster_rank_info: refused without waiting for anyone
    start = time.monotonic()
    with pytest.raises(LLMException):
        dd.link("c", {1: 0, 2: 1}, _table(0, 1))
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("comm_id, exc", [
    ("1", TypeError), (None, TypeError), (1.0, TypeError), (-1, ValueError), (2**64, ValueError),
    (1, LLMException), (99, LLMException),
])
@pytest.mark.parametrize("method", ["unlink", "query_register_mem_status"])
def test_comm_id_checks(dd, method, comm_id, exc):
    with pytest.raises(exc):
        getattr(dd, method)(comm_id)


def test_query_register_mem_status_keyword(dd):
    with pytest.raises(LLMException):
        dd.query_register_mem_status(comm_id=1)  # vllm-ascend passes comm_id by keyword


@pytest.mark.parametrize("call", [
    lambda dd: dd.link("c", {7: 0, 8: 1}, _table(0, 1)),
    lambda dd: dd.unlink(1),
    lambda dd: dd.query_register_mem_status(1),
])
def test_ascend_950_refuses_comm_group_apis(call):
    dd = engine({**CM, "llmdd.chip_profile": "ascend_950"})
    with pytest.raises(LLMException) as info:
        call(dd)
    assert info.value.status_code is S.LLM_FEATURE_NOT_ENABLED
    assert dd.cache_manager._is_call_linked is False


def test_ascend_950_keeps_link_clusters(dd):
    dd.finalize()
    dd = engine({**CM, "llmdd.chip_profile": "ascend_950"})
    ret, codes = dd.link_clusters([cluster(remote=("127.0.0.1", free_port()))], 500)
    assert ret is S.LLM_LINK_FAILED and codes == [S.LLM_LINK_FAILED]


def test_finalize_closes_every_part_even_when_one_fails(monkeypatch):
    dd = engine({**CM, "llm.MemPoolConfig": POOL, "llm.listenIpInfo": "127.0.0.1:0"})
    dd.cache_manager.allocate_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT))
    core = dd._core

    def broken() -> None:
        raise RuntimeError("transport close failed")

    monkeypatch.setattr(core.transfers, "close", broken)
    with pytest.raises(RuntimeError, match="transport close failed"):
        dd.finalize()
    assert LLMDataDist.llm_engine_instance is None
    assert core.memory.statistics()["closed"] is True
    assert core.link_manager.listen_address is None
    dd.init({**CM, "llm.MemPoolConfig": POOL})  # the object is usable again
    assert dd.cache_manager.allocate_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT)).cache_id == 1
