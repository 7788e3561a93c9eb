"""Peer-side functions of the tests ported from upstream's behaviour (run in harness children).

Module-level ``fn(state, ...)`` functions, like ``_dataplane_peers``, whose engine state they share.
"""

from __future__ import annotations

from llmdd import LLMClusterInfo

HOST = "127.0.0.1"


def statistics_listen(state: dict) -> list:
    return list(state["dd"].statistics()["listen"])


def link_bool_port(state: dict, remote: int) -> list:
    """Link with ``True`` as the remote port (port 1) and ``False`` as the local one."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote
    info.append_local_ip_info(HOST, False)
    info.append_remote_ip_info(HOST, True)
    ret, rets = state["dd"].link_clusters([info], 5000)
    return [ret.name] + [r.name for r in rets]
