"""The cache keys of the llm_datadist v2 contract (docs/concepts.md): ``CacheKey``, ``CacheKeyByIdAndIndex``,
``BlocksCacheKey``, and the id checks around them.

The keys have no setters, so they compare and hash **by value** (clients use keys as dict keys).
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

from llmdd._base.status import raise_if_false, raise_if_true
from llmdd._base.validation import INVALID_ID, check_int64, check_isinstance, check_uint32, check_uint64

__all__ = ["CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "check_cache_key", "cache_key_index",
           "is_valid_id", "is_invalid_id"]

def is_invalid_id(req_id_or_prefix_id: int) -> bool:
    """An id is invalid when negative or the ``2**64-1`` sentinel."""
    return req_id_or_prefix_id < 0 or req_id_or_prefix_id == INVALID_ID


def is_valid_id(req_id_or_prefix_id: int) -> bool:
    """``0 <= id < 2**64-1``."""
    return not is_invalid_id(req_id_or_prefix_id)


# -------------------------------------------------------------------------- keys


def _gather_params(args: tuple, kwargs: dict, positional: Sequence[str]) -> dict:
    """Upstream's ``*args/**kwargs`` parsing: positional values override same-named keywords."""
    raise_if_false(len(args) + len(kwargs) <= len(positional), "Param num is over limit")
    params = dict(kwargs)
    for name, value in zip(positional, args):
        params[name] = value
    return params


class CacheKey:
    """Key of a cache batch slot on the prompt side: ``(cluster_id, req_id, model_id, prefix_id)``.

    ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=2**64-1)`` positionally, or
    by keyword with ``prompt_cluster_id`` as an alias of ``cluster_id``.  The
    padding key has ``req_id == 2**64-1``.  Equal and hashed by value.
    """

    __slots__ = ("_cluster_id", "_req_id", "_model_id", "_prefix_id")

    def __init__(self, *args: int, **kwargs: int) -> None:
        params = _gather_params(args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"))
        raise_if_false("prompt_cluster_id" in params or "cluster_id" in params,
                       "Param prompt_cluster_id or cluster_id is required")
        raise_if_false("req_id" in params, "Param req_id is required")
        for name in params:
            raise_if_false(name in ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id"),
                           "Unsupported param:{0}", name)
        cluster_id = params["cluster_id"] if "cluster_id" in params else params["prompt_cluster_id"]
        req_id = params["req_id"]
        model_id = params.get("model_id", 0)
        prefix_id = params.get("prefix_id", INVALID_ID)
        check_uint64("cluster_id", cluster_id)
        check_uint64("req_id", req_id)
        check_uint64("model_id", model_id)
        check_uint64("prefix_id", prefix_id)
        # bools pass the int checks as upstream; kept as the plain ints they stand for
        self._cluster_id = int(cluster_id)
        self._req_id = int(req_id)
        self._model_id = int(model_id)
        self._prefix_id = int(prefix_id)

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def model_id(self) -> int:
        return self._model_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    def _astuple(self) -> Tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash((CacheKey, self._astuple()))

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"prefix_id={self._prefix_id}, model_id={self._model_id})")


class CacheKeyByIdAndIndex:
    """Addresses one batch slot of a remote cache by ``(cluster_id, cache_id, batch_index)``.

    Equal and hashed by value.
    """

    __slots__ = ("_cluster_id", "_cache_id", "_batch_index")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = int(cluster_id)
        self._cache_id = int(cache_id)
        self._batch_index = int(batch_index)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    @property
    def req_id(self) -> int:
        """Always the invalid id (upstream keeps this attribute too)."""
        return INVALID_ID

    def _astuple(self) -> Tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash((CacheKeyByIdAndIndex, self._astuple()))

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
                f"batch_index={self._batch_index})")


class BlocksCacheKey:
    """Key of a blocks cache: ``(cluster_id, model_id)``; any ints (no range check, as upstream).

    ``repr`` keeps the keyword used (``cluster_id`` or ``prompt_cluster_id``);
    equality and hashing ignore it.
    """

    __slots__ = ("_cluster_id", "_model_id", "_cluster_id_key")

    def __init__(self, *args: int, **kwargs: int) -> None:
        params = _gather_params(args, kwargs, ("cluster_id", "model_id"))
        raise_if_false("prompt_cluster_id" in params or "cluster_id" in params,
                       "Param prompt_cluster_id or cluster_id is required")
        for name in params:
            raise_if_false(name in ("prompt_cluster_id", "cluster_id", "model_id"), "Unsupported param:{0}", name)
        self._cluster_id_key = "cluster_id" if "cluster_id" in params else "prompt_cluster_id"
        self._cluster_id = params[self._cluster_id_key]
        self._model_id = params.get("model_id", 0)
        check_isinstance("cluster_id", self._cluster_id, int, extra_fmt="The first param ", allow_none=False)
        check_isinstance("model_id", self._model_id, int, extra_fmt="The second param ", allow_none=False)
        self._cluster_id, self._model_id = int(self._cluster_id), int(self._model_id)

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def _astuple(self) -> Tuple[int, int]:
        return (self._cluster_id, self._model_id)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash((BlocksCacheKey, self._astuple()))

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, model_id={self._model_id})"


def check_cache_key(cache_key: CacheKey) -> None:
    """Exactly one of ``req_id`` / ``prefix_id`` must be valid (``0 <= id < 2**64-1``).

    ``LLMException(LLM_PARAM_INVALID)`` otherwise (``CacheManager.check_cache_key``).
    """
    req_id, prefix_id = cache_key.req_id, cache_key.prefix_id
    raise_if_true(is_invalid_id(req_id) and is_invalid_id(prefix_id),
                  "one of req id and prefix id should contain valid value:[0, 2**64-1), "
                  "req id:{0},prefix id{1}.", req_id, prefix_id)
    raise_if_true(is_valid_id(req_id) and is_valid_id(prefix_id),
                  "only one of req id and prefix id should contain valid value:[0, 2**64-1), "
                  "req id:{0}, prefix id{1}.", req_id, prefix_id)


def cache_key_index(cache_key: Union[CacheKey, BlocksCacheKey]) -> Tuple[int, int]:
    """The engine's lookup index of a key on the side that registered it.

    ``CacheKey`` -> ``(prefix_id, model_id)`` when ``prefix_id != 2**64-1``, else
    ``(req_id, model_id)``; ``BlocksCacheKey`` -> ``(2**64-1, model_id)`` (one
    blocks cache per model_id).  The key's cluster id is not part of the index.
    ``CacheKeyByIdAndIndex`` addresses a cache by id and has no index (TypeError).
    """
    if isinstance(cache_key, CacheKey):
        if cache_key.prefix_id != INVALID_ID:
            return (cache_key.prefix_id, cache_key.model_id)
        return (cache_key.req_id, cache_key.model_id)
    if isinstance(cache_key, BlocksCacheKey):
        return (INVALID_ID, cache_key.model_id)
    raise TypeError(f"cache_key only support ['CacheKey', 'BlocksCacheKey'], but got {type(cache_key)}.")
