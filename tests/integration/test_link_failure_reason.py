"""Why a link_clusters attempt failed stays readable: ``statistics()["link_failures"]`` (a failed link is
never made, so it has no ``last_error``; docs/deviations.md). Two real processes on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from llmdd import LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole, LLMStatusCode

pytestmark = pytest.mark.timeout(60)


def _engine(role, cluster_id: int):
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    dd = LLMDataDist(role, cluster_id)
    dd.init(cfg.generate_options())
    return dd


def _server(cluster_id: int, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]       # closed again: nothing listens there


_PROMPT = """
import sys
import numpy as np
from llmdd import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole
cfg = LLMConfig()
cfg.enable_cache_manager = True
cfg.listen_ip_info = "127.0.0.1:0"
dd = LLMDataDist(LLMRole.PROMPT, 71)
dd.init(cfg.generate_options())
buf = np.zeros((1, 4 * 64), dtype=np.uint8)
dd.cache_manager.register_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_UINT8), [int(buf[0].ctypes.data)])
print(dd.statistics()["listen"][1], flush=True)
sys.stdin.read()
dd.finalize()
"""


def test_a_failed_link_keeps_its_reason_until_a_link_to_that_cluster_succeeds():
    prompt = subprocess.Popen([sys.executable, "-c", _PROMPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    dec = _engine(LLMRole.DECODER, 72)
    try:
        ret, rets = dec.link_clusters([_server(71, _closed_port())], 2000)
        assert ret == rets[0] == LLMStatusCode.LLM_LINK_FAILED
        stats = dec.statistics()
        assert 71 not in stats["links"]                           # never made: no link, no last_error
        failed = stats["link_failures"][71]
        assert failed["status"] == "LLM_LINK_FAILED"
        assert "cannot connect to 127.0.0.1:" in failed["error"], failed
        port = int(prompt.stdout.readline())                      # the pipe's end is the deadline (timeout mark)
        ret, _ = dec.link_clusters([_server(71, port)], 10000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        assert dec.statistics()["link_failures"] == {}
    finally:
        dec.finalize()
        prompt.stdin.close()
        prompt.wait(30)


def test_a_handshake_whose_deadline_passed_before_any_attempt_says_so():
    """A client that did not get to run before its link deadline (a starved process) is told that the
    deadline passed before a connection was tried, not that the server refused connections; with time
    left, the same closed port gives the connection's own error (control)."""
    import time

    dec = _engine(LLMRole.DECODER, 83)
    try:
        lm = dec._core.link_manager
        with pytest.raises(Exception) as err:
            lm.dialer._client_handshake("127.0.0.1", _closed_port(), time.monotonic() - 1.0, capability=b"")
        assert err.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert "before a connection could be tried" in str(err.value), str(err.value)
        assert "refusing" not in str(err.value)
        with pytest.raises(Exception) as err:
            lm.dialer._client_handshake("127.0.0.1", _closed_port(), time.monotonic() + 2.0, capability=b"")
        assert err.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert str(err.value).startswith("cannot connect to 127.0.0.1:"), str(err.value)
        assert "Connection refused" in str(err.value), str(err.value)
    finally:
        dec.finalize()


def test_a_call_on_a_cluster_whose_link_failed_raises_not_yet_linked_with_the_reason():
    """Where the API raises (pull_blocks on a cluster that is not linked), the message carries why the last
    link_clusters to that cluster failed; a cluster never tried (control) gets the plain message."""
    import numpy as np

    from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMException

    dec = _engine(LLMRole.DECODER, 84)
    try:
        buf = np.random.default_rng(84).integers(0, 256, (1, 4 * 64), dtype=np.uint8)
        cache = dec.cache_manager.register_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_UINT8),
                                                        [int(buf[0].ctypes.data)])
        port = _closed_port()
        ret, _ = dec.link_clusters([_server(85, port)], 2000)
        assert ret == LLMStatusCode.LLM_LINK_FAILED
        reason = dec.statistics()["link_failures"][85]["error"]
        with pytest.raises(LLMException) as err:
            dec.cache_manager.pull_blocks(BlocksCacheKey(85, 0), cache, [0], [1])
        assert err.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        assert str(err.value) == f"cluster 85 is not linked (its last link_clusters failed: {reason})"
        assert f"cannot connect to 127.0.0.1:{port}" in reason, reason
        with pytest.raises(LLMException) as err:
            dec.cache_manager.pull_blocks(BlocksCacheKey(86, 0), cache, [0], [1])
        assert err.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK
        assert str(err.value) == "cluster 86 is not linked"
    finally:
        dec.finalize()
