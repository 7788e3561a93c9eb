"""Bounds for numbers a linked peer sends (the owner-side checks of the data plane's control messages).

A peer is trusted with nothing: every count, index, span and length in a message it sends is checked
against this engine's own tables (the cache's tensors and blocks, what that peer reserved) *before*
any work or allocation proportional to it, so the work a message causes is proportional to the
message's size, never to a number inside it.  A violation raises :class:`PeerInputError`; the data
plane refuses the message with a typed error to the peer, logs it once per link and message type,
and (``fail_link``) fails the link.  The per-message decisions are listed in docs/reliability.md.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["PeerInputError", "peer_int", "peer_bool", "peer_key_index", "peer_range", "peer_spans", "U64_MAX"]

U64_MAX = 2**64 - 1


class PeerInputError(LLMException):
    """A message of a linked peer violates this engine's tables (``LLM_PARAM_INVALID``).

    ``fail_link``: the peer is broken or hostile (out-of-table indices): fail its link.  False for
    violations a correct peer can cause by a benign race, which are only refused.
    """

    def __init__(self, message: str, *, fail_link: bool = True) -> None:
        super().__init__(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self.fail_link = fail_link


def peer_int(value: Any, name: str, lo: int = 0, hi: int = U64_MAX) -> int:
    """An integer field in ``[lo, hi]`` (bools and other types refused)."""
    if type(value) is not int:
        raise PeerInputError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise PeerInputError(f"{name} {value} is outside [{lo}, {hi}]")
    return value


def peer_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise PeerInputError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def peer_key_index(args: Any) -> tuple[int, int]:
    """``(id, model_id)`` of a CacheKey lookup index in a request's arguments."""
    if not isinstance(args, dict):
        raise PeerInputError("request arguments must be a map")
    return peer_int(args.get("id"), "id"), peer_int(args.get("model_id"), "model_id")


def peer_range(value: Any, name: str, limit: int) -> range:
    """A ``[start, stop]`` pair (or an object with ``start``/``stop``) inside ``[0, limit]``."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise PeerInputError(f"{name} must be a [start, stop] pair, got {len(value)} items")
        start, stop = value
    elif hasattr(value, "start") and hasattr(value, "stop"):
        start, stop = value.start, value.stop
    else:
        raise PeerInputError(f"{name} must be a [start, stop] pair, got {type(value).__name__}")
    start = peer_int(start, f"{name} start")
    stop = peer_int(stop, f"{name} stop")
    if not start <= stop <= limit:
        raise PeerInputError(f"{name} [{start}, {stop}) is outside [0, {limit})")
    return range(start, stop)


def peer_spans(spans: Any, name: str, limit: int, *, max_spans: Optional[int] = None) -> list[range]:
    """Index spans inside ``[0, limit)``; at most ``max_spans`` of them (default ``limit``: disjoint
    non-empty spans of ``limit`` items cannot be more).  The count is checked before any span."""
    if not isinstance(spans, (list, tuple)):
        raise PeerInputError(f"{name} must be a list of spans, got {type(spans).__name__}")
    cap = limit if max_spans is None else max_spans
    if len(spans) > cap:
        raise PeerInputError(f"{name}: {len(spans)} spans exceed the {cap} this cache can have")
    return [peer_range(s, name, limit) for s in spans]


def peer_bounds(bounds: Any, name: str, limit: int, *, max_spans: Optional[int] = None) -> list[list[int]]:
    """Flat span bounds ``(start0, stop0, start1, stop1, ...)`` as ``[[start, stop], ...]``, each span
    inside ``[0, limit]`` with ``start <= stop`` (what :func:`peer_spans` checks of Span objects); at
    most ``max_spans`` spans (default ``limit``), the count checked before any span."""
    if not isinstance(bounds, (list, tuple)):
        raise PeerInputError(f"{name} must be a list of span bounds, got {type(bounds).__name__}")
    if len(bounds) % 2:
        raise PeerInputError(f"{name}: an odd number of span bounds ({len(bounds)})")
    cap = limit if max_spans is None else max_spans
    if len(bounds) // 2 > cap:
        raise PeerInputError(f"{name}: {len(bounds) // 2} spans exceed the {cap} this cache can have")
    out = []
    it = iter(bounds)
    for start, stop in zip(it, it):
        if type(start) is int and type(stop) is int and 0 <= start <= stop <= limit:
            out.append([start, stop])
        else:
            r = peer_range((start, stop), name, limit)   # raises the precise error
            out.append([r.start, r.stop])
    return out


def covered(ranges: Iterable[range]) -> set[int]:
    """The indices of ``ranges`` (already bounded by :func:`peer_range`, so small)."""
    out: set[int] = set()
    for r in ranges:
        out.update(r)
    return out
