"""What ``LLMDataDist`` does differently in the legacy v1 mode (links, role switch, link check).

Behaviour learnt from upstream's v1 engine (``hicann/ge`` ffdcbc9f7496, ``dflow/llm_datadist/v1``):

* only a DECODER links (``link_clusters`` from another role returns ``(LLM_PARAM_INVALID, [])``
  without raising, as the native call's status is returned);
* only a PROMPT listens (on its ``llm.listenIpInfo``); ``switch_role`` must change the role,
  needs ``llm.EnableSwitchRole`` (else ``LLM_FEATURE_NOT_ENABLED``), and switching to PROMPT
  needs ``llm.listenIpInfo`` in the switch options;
* ``check_link_status(remote_cluster_id)`` is a DECODER call that asks the linked PROMPT for an
  answer within ``llm.SyncKvCacheWaitTime`` and raises ``LLMException`` when it cannot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence

from llmdd._base.enums import LLMRole
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode, raise_if_false
from llmdd._protocol.port import RequestOp
from llmdd._base.validation import check_isinstance, check_uint64
from llmdd._api.v1.options import parse_v1_listen_ip_info

if TYPE_CHECKING:
    from llmdd._base.config import LLMClusterInfo
    from llmdd._engine.core import EngineCore

__all__ = ["v1_link_clusters", "v1_switch_listen", "v1_check_link_status", "not_in_v1", "not_in_v2"]

_log = get_logger("llmdd.v1")


def not_in_v1(func_name: str) -> LLMException:
    """A cache-manager call on a v1 engine (upstream's message and status)."""
    return LLMException(f"{func_name} is not supported when llm.EnableCacheManager is not configured.",
                        status_code=LLMStatusCode.LLM_PARAM_INVALID)


def not_in_v2(func_name: str) -> LLMException:
    """A v1 call on a cache-manager engine (upstream's message and status)."""
    return LLMException(f"{func_name} is not supported when llm.EnableCacheManager is configured.",
                        status_code=LLMStatusCode.LLM_PARAM_INVALID)


def v1_link_clusters(core: EngineCore, role: LLMRole, clusters: Sequence[LLMClusterInfo], timeout: int):
    """DECODER only: link to PROMPT servers; ``(status, [status per cluster])``, never raises on failure."""
    if role != LLMRole.DECODER:
        _log.warning("llmdd.v1.link_refused", role=role.name)
        return LLMStatusCode.LLM_PARAM_INVALID, []
    if not clusters:
        return LLMStatusCode.LLM_SUCCESS, []
    return core.link_manager.link_clusters(list(clusters), timeout)


def v1_switch_listen(current: LLMRole, role: LLMRole, switch_options: Optional[Dict[str, str]],
                     enable_switch_role: bool) -> Optional[tuple[str, int]]:
    """The v1 rules of a role switch (a different role, PROMPT listens on ``llm.listenIpInfo``, others
    stop listening), checked in upstream's order: where the engine listens after the switch, or None.
    ``LLMDataDist.switch_role`` then switches as in v2 mode."""
    check_isinstance("role", role, LLMRole, allow_none=False)
    raise_if_false(current != role, "role not changed, role = {0}", role.name)
    check_isinstance("switch_options", switch_options, dict)
    options = dict(switch_options or {})
    listen = None
    if role == LLMRole.PROMPT:
        raise_if_false("llm.listenIpInfo" in options,
                       'Failed to switch to Prompt, option "llm.listenIpInfo" must be specified')
        entries = parse_v1_listen_ip_info(options["llm.listenIpInfo"])
        raise_if_false(len(entries) == 1, "llm.listenIpInfo must name one ip:port (one device per engine), "
                       "but got {0}.", options["llm.listenIpInfo"])
        listen = entries[0]
    if not enable_switch_role:
        raise LLMException("Option llm.EnableSwitchRole not enabled", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    return listen


def v1_check_link_status(core: EngineCore, role: LLMRole, remote_cluster_id: int) -> None:
    """DECODER: the link to ``remote_cluster_id`` answers within ``llm.SyncKvCacheWaitTime``, or LLMException."""
    check_uint64("remote_cluster_id", remote_cluster_id)
    raise_if_false(role == LLMRole.DECODER, "[check_link_status] is not supported by {0}", role)
    lm = core.link_manager
    link = lm.require(remote_cluster_id)  # LLM_NOT_YET_LINK / LLM_LINK_FAILED / LLM_PROCESSING_LINK
    deadline = core.runtime.monotonic() + core.options.sync_kv_timeout_ms / 1000.0
    status, _ = lm.request(link, RequestOp.ENGINE_INFO, {}, deadline=deadline)  # LLM_TIMEOUT / LLM_LINK_FAILED
    if status != 0:
        raise LLMException(f"[check_link_status] cluster {remote_cluster_id} answered status {status}",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
