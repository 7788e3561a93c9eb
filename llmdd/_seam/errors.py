"""The seam's typed errors: what a transport reports, each carrying an upstream status code.

Every error a transport reports is a subclass of :class:`llmdd._base.status.TransportError`
(public as :class:`llmdd.lowlevel.TransportError`); the data engine maps them to upstream's codes.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

from llmdd._base.status import LLMStatusCode, TransportError

__all__ = ["TransportError", "TransportTimeout", "PeerGone", "Refused", "Corrupt", "Cancelled"]


class _TypedTransportError(TransportError):
    default_status: ClassVar[LLMStatusCode] = LLMStatusCode.LLM_FAILED

    def __init__(self, *args: Any, status_code: Union[LLMStatusCode, None] = None) -> None:
        super().__init__(*args, status_code=status_code if status_code is not None else self.default_status)


class TransportTimeout(_TypedTransportError):
    """The batch did not finish by its deadline (upstream: ``LLM_TIMEOUT``)."""

    default_status = LLMStatusCode.LLM_TIMEOUT


class PeerGone(_TypedTransportError):
    """The peer closed, crashed or became unreachable (upstream: ``LLM_LINK_FAILED``)."""

    default_status = LLMStatusCode.LLM_LINK_FAILED


class Refused(_TypedTransportError):
    """An op names a region or range that its owner does not grant; nothing was moved.

    Status ``LLM_PARAM_INVALID``: a transport sees regions and byte ranges, not caches.
    A refused op is a bad address in the request (a block index or offset out of range,
    a region that is not registered or not remote-accessible), which is what upstream
    reports as ``LLM_PARAM_INVALID`` for a bad block index. ``LLM_KV_CACHE_NOT_EXIST``
    belongs to the cache layer above, which knows cache ids and keys and maps a missing
    cache to it before any op is built. Callers may still pass another ``status_code``
    (e.g. ``LLM_LINK_FAILED`` for a failed authentication).
    """

    default_status = LLMStatusCode.LLM_PARAM_INVALID


class Corrupt(_TypedTransportError):
    """The peer sent something that breaks the protocol (upstream: ``LLM_FAILED``)."""

    default_status = LLMStatusCode.LLM_FAILED


class Cancelled(_TypedTransportError):
    """The batch was cancelled (``cancel()``, channel or endpoint closed, region deregistered).

    Upstream has no "cancelled" code; ``LLM_FAILED`` is what its engine reports for an
    interrupted transfer.
    """

    default_status = LLMStatusCode.LLM_FAILED
