"""The layer-wise transfer API of the llm_datadist v2 contract (docs/concepts.md): ``LayerSynchronizer``,
``TransferConfig``, ``TransferWithCacheKeyConfig`` and ``CacheTask``, the handle of
``transfer_cache_async``.

The transfer configs have setters, so they keep identity equality and hashing, as upstream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Protocol, Union, cast, runtime_checkable

from llmdd._base.status import LLMStatusCode, raise_if_false, raise_if_true
from llmdd._base.types.keys import BlocksCacheKey, CacheKeyByIdAndIndex
from llmdd._base.validation import check_isinstance, check_list_uint64, check_uint32, check_uint64

__all__ = ["LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask",
           "check_layer_range"]

# ---------------------------------------------------------- transfer (async) API


class LayerSynchronizer(ABC):
    """Tells ``transfer_cache_async`` when a layer's KV is ready to send."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Block until layer ``layer_index`` is computed; ``False`` fails that layer's transfers.

        Called from the transfer thread with ``timeout_in_millis=None``.
        """


def check_layer_range(name: str, layer_range: Optional[range], allow_none: bool = True) -> None:
    """``range`` with step 1 and ``0 <= start < stop``; None passes when ``allow_none``."""
    if layer_range is None and allow_none:
        return
    _checked_layer_range(name, layer_range)


def _checked_layer_range(name: str, layer_range: Optional[range]) -> range:
    """:func:`check_layer_range` with ``allow_none=False``, returning the range it accepted."""
    check_isinstance(name, layer_range, range, allow_none=False)
    checked = cast(range, layer_range)  # cast: check_isinstance raised unless it is a range
    raise_if_false(checked.step == 1, "check {0}.step == 1 failed", name)
    raise_if_false(0 <= checked.start < checked.stop,
                   "check 0 <= range.start < range.stop failed, {0} = {1}", name, checked)
    return checked


class TransferConfig:
    """Destination of ``transfer_cache_async`` given by raw addresses (non remote-accessible mode).

    ``dst_addrs`` holds 2 addresses per transferred layer.  ``dst_layer_range``
    is a plain public attribute (upstream), ``None`` by default.
    """

    def __init__(self,
                 dst_cluster_id: int,
                 dst_addrs: List[int],
                 src_layer_range: Optional[range] = None,
                 src_batch_index: int = 0) -> None:
        self._check_dst_cluster_id(dst_cluster_id)
        self._check_dst_addrs(dst_addrs)
        check_layer_range("src_layer_range", src_layer_range)
        self._check_src_batch_index(src_batch_index)
        self._dst_cluster_id = int(dst_cluster_id)
        self._dst_addrs = dst_addrs
        self._src_layer_range = src_layer_range
        self._src_batch_index = int(src_batch_index)
        self.dst_layer_range: Optional[range] = None

    @staticmethod
    def _check_dst_cluster_id(dst_cluster_id: int) -> None:
        check_uint64("dst_cluster_id", dst_cluster_id)

    @staticmethod
    def _check_dst_addrs(dst_addrs: List[int]) -> None:
        check_isinstance("dst_addrs", dst_addrs, [list, tuple], int, allow_none=False)
        check_list_uint64("dst_addrs", dst_addrs)

    @staticmethod
    def _check_src_batch_index(src_batch_index: int) -> None:
        check_uint32("src_batch_index", src_batch_index)

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, cluster_id: int) -> None:
        self._check_dst_cluster_id(cluster_id)
        self._dst_cluster_id = cluster_id

    @property
    def dst_addrs(self) -> List[int]:
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, dst_addrs: List[int]) -> None:
        self._check_dst_addrs(dst_addrs)
        self._dst_addrs = dst_addrs

    @property
    def src_layer_range(self) -> Optional[range]:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, layer_range: Optional[range]) -> None:
        check_layer_range("src_layer_range", layer_range)
        self._src_layer_range = layer_range

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, batch_index: int) -> None:
        self._check_src_batch_index(batch_index)
        self._src_batch_index = int(batch_index)

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self._dst_cluster_id},"
                f" dst_addrs={self._dst_addrs},"
                f" src_layer_range={self._src_layer_range},"
                f" src_batch_index={self._src_batch_index})")


class TransferWithCacheKeyConfig:
    """Destination of ``transfer_cache_async`` given by key (remote-accessible mode).

    Both layer ranges are mandatory and of equal length; a ``BlocksCacheKey``
    destination requires ``src_batch_index == 0``.  ``dst_cluster_id`` is a public
    attribute equal to ``cache_key.cluster_id`` (kept in step by the
    ``cache_key`` setter).
    """

    def __init__(self,
                 cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex],
                 src_layer_range: Optional[range] = None,
                 dst_layer_range: Optional[range] = None,
                 src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex], allow_none=False)
        src_layer_range = _checked_layer_range("src_layer_range", src_layer_range)
        dst_layer_range = _checked_layer_range("dst_layer_range", dst_layer_range)
        raise_if_false(len(src_layer_range) == len(dst_layer_range),
                       "src_layer_range size should be equal to dst_layer_range size")
        check_uint32("src_batch_index", src_batch_index)
        raise_if_true(isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0,
                      "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        self._cache_key = cache_key
        self._src_layer_range = src_layer_range
        self._dst_layer_range = dst_layer_range
        self._src_batch_index = int(src_batch_index)
        self.dst_cluster_id: int = cache_key.cluster_id

    @property
    def cache_key(self) -> Union[BlocksCacheKey, CacheKeyByIdAndIndex]:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: Union[BlocksCacheKey, CacheKeyByIdAndIndex]) -> None:
        check_isinstance("cache_key", cache_key, [BlocksCacheKey, CacheKeyByIdAndIndex], allow_none=False)
        self._cache_key = cache_key
        self.dst_cluster_id = cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range) -> None:
        self._src_layer_range = _checked_layer_range("src_layer_range", src_layer_range)

    @property
    def dst_layer_range(self) -> range:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, dst_layer_range: range) -> None:
        self._dst_layer_range = _checked_layer_range("dst_layer_range", dst_layer_range)

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        raise_if_true(isinstance(self._cache_key, BlocksCacheKey) and src_batch_index != 0,
                      "src_batch_index should be 0 when cache_key is BlocksCacheKey.")
        check_uint32("src_batch_index", src_batch_index)
        self._src_batch_index = int(src_batch_index)

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self._cache_key},"
                f" src_layer_range={self._src_layer_range},"
                f" dst_layer_range={self._dst_layer_range},"
                f" src_batch_index={self._src_batch_index})")


@runtime_checkable
class _AsyncTaskLike(Protocol):
    """What ``CacheTask`` needs from the engine's asynchronous transfer task.

    * ``wait(timeout_s)``: block up to ``timeout_s`` seconds (``None``: forever)
      and return whether the task has finished.
    * ``results()``: one entry per transfer config, in config order; ``None`` for a
      config whose layers never started.  Callable at any time (the length is
      the number of configs even while running).  A task that died on an
      internal error reports that as a failure status in its results.
    """

    def wait(self, timeout_s: Optional[float]) -> bool: ...

    def results(self) -> List[Optional[LLMStatusCode]]: ...


def _timeout_seconds(timeout_in_millis: Optional[int]) -> Optional[float]:
    if timeout_in_millis is None:
        return None
    check_uint32("timeout_in_millis", timeout_in_millis)
    return timeout_in_millis / 1000


class CacheTask:
    """Handle of a ``transfer_cache_async`` call.

    Neither method raises on timeout (upstream behaviour): ``synchronize``
    returns ``LLM_TIMEOUT`` and ``get_results`` returns ``[LLM_TIMEOUT] * n``
    when the task has not finished within ``timeout_in_millis`` (uint32 ms;
    ``None`` waits forever; a wrong type is ``TypeError``, out of range
    ``ValueError``).  A finished task can be asked again and gives the same answer.
    """

    def __init__(self, transfer_async_task: _AsyncTaskLike) -> None:
        self._transfer_async_task = transfer_async_task

    def synchronize(self, timeout_in_millis: Optional[int] = None) -> LLMStatusCode:
        """Wait; the first non-success result, ``LLM_SUCCESS``, or ``LLM_TIMEOUT`` if unfinished.

        ``None`` results (configs whose layers never started) are skipped.
        """
        timeout_s = _timeout_seconds(timeout_in_millis)
        if not self._transfer_async_task.wait(timeout_s):
            return LLMStatusCode.LLM_TIMEOUT
        for ret in self._transfer_async_task.results():
            if ret is not None and ret != LLMStatusCode.LLM_SUCCESS:
                return ret
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: Optional[int] = None) -> List[Optional[LLMStatusCode]]:
        """Wait; one status per transfer config (``None`` where nothing started).

        If the task has not finished within the timeout, every entry is ``LLM_TIMEOUT``.
        """
        timeout_s = _timeout_seconds(timeout_in_millis)
        if not self._transfer_async_task.wait(timeout_s):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._transfer_async_task.results())
        return list(self._transfer_async_task.results())

    def __repr__(self) -> str:
        return f"CacheTask({self._transfer_async_task!r})"
