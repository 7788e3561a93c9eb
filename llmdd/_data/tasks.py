"""Transfer tasks that outlive the call that made them: non-blocking pulls and layer-wise async
transfers (``CacheTask``'s interface), run by the data plane (:mod:`llmdd._data.engine`).

A task's state lives in the task lifecycle (``_lifecycle/tables.py``); a task reaches its engine's
links only through the engine, never the control plane directly: what it asks of the engine is
:class:`TaskHost` (``TransferEngine`` is one), so this module does not import the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, Union

from llmdd._base.lazy import np
from llmdd._base.log import get_logger
from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._protocol.port import LinkView
from llmdd._runtime.runtime import Threads

if TYPE_CHECKING:
    from llmdd._lifecycle.machines import Tracked
    from llmdd._base.types import LayerSynchronizer, TransferConfig, TransferWithCacheKeyConfig
    from llmdd._data.planner import CacheLayout
    from llmdd._memory.manager import CacheRecord

__all__ = ["AsyncPull", "AsyncTransfer", "TaskHost", "TransferTimedOut"]


class TransferTimedOut(LLMException):
    """``TransferEngine.run_ops``: the transfer passed its sync_kv_timeout deadline (LLM_TIMEOUT; the
    link failed).  An async task's step tells it apart from other failures by this type."""

_log = get_logger("llmdd.transfer")
S = LLMStatusCode


def _err(msg: str, code: LLMStatusCode) -> LLMException:
    return LLMException(msg, status_code=code)


class TaskHost(Protocol):
    """What a task asks of its engine (``llmdd._data.engine.TransferEngine``)."""

    #: where a task takes its worker, its clock and its waiting
    runtime: Threads

    def link_for(self, cluster_id: int) -> LinkView:
        """The LINKED link to ``cluster_id`` with its data channel, or the contract's error."""
        ...

    def claim_links(self, links: list) -> None:
        """Take ``links`` for a layer-wise task, all or none (LLM_LINK_BUSY)."""
        ...

    def release_links(self, links: list) -> None:
        ...

    def plan_async_config(self, link: LinkView, src: "CacheLayout",
                          config: Union["TransferConfig", "TransferWithCacheKeyConfig"], layer: int, *,
                          src_blocks: Optional[Sequence[int]], dst_blocks: Optional[Sequence[int]],
                          dst_block_size: Optional[int]) -> np.ndarray:
        """The ops of one layer of one config."""
        ...

    def run_ops(self, link: LinkView, ops: np.ndarray, *, write: bool, kind: str, step_of: Optional["Tracked"] = None,
                nbytes: Optional[int] = None) -> None:
        """Move ``ops`` over ``link`` as one step of ``step_of``."""
        ...

    def task_ended(self, task: Union["AsyncPull", "AsyncTransfer"]) -> None:
        """``task`` ended (or never started): the engine stops counting it."""
        ...


class AsyncPull:
    """One non-blocking pull (``pull_blocks_async`` / ``pull_cache_async``): the blocking pull run by
    one of the engine's pull workers; ``CacheTask``'s interface (``wait`` / ``results``) and an
    optional ``callback(status)`` called once, in the worker, when it ends.

    It is a task of the task machine from submission (``task``, CREATED while it waits for a worker):
    the worker's ``start`` and a cancellation's ``withdraw`` race on that machine, and whichever the
    table takes first decides who ends it.  Withdrawn before it starts by an unlink or failure of its
    link (``LLM_LINK_FAILED``) or by finalize (``LLM_ENGINE_FINALIZED``): CANCELLED, with its event;
    once started, it ends as the blocking call would (its steps have the blocking call's
    sync_kv_timeout deadlines, and a link torn down under it ends it with that link's status:
    ``LLM_LINK_FAILED`` also while it waited for the link's transfer slot), and its task COMPLETED,
    TIMED_OUT or FAILED.  The blocking pull's own steps are tasks of their own, as for the blocking call."""

    def __init__(self, engine: TaskHost, link: LinkView, run: Callable[[], None],
                 callback: Optional[Callable[[LLMStatusCode], None]], *, task: "Tracked") -> None:
        self._engine = engine
        self._link = link
        self._run = run
        self._callback = callback
        self.task = task
        self._done = engine.runtime.event()
        self._link_went = False  # its link was unlinked or failed (while queued or running)
        self._status: Optional[LLMStatusCode] = None

    def wait(self, timeout_s: Optional[float]) -> bool:
        return self._done.wait(timeout_s)

    def results(self) -> list:
        return [self._status]

    @property
    def status(self) -> Optional[LLMStatusCode]:
        return self._status

    def __call__(self) -> None:
        if not self.task.offer("start"):
            return          # withdrawn while queued: it ended then
        error: Optional[BaseException] = None
        try:
            self._run()
            status = S.LLM_SUCCESS
        except LLMException as exc:
            status, error = exc.status_code, exc
            if status is S.LLM_NOT_YET_LINK and self._link_went:
                # it waited for the link's transfer slot while the link was unlinked: as a queued
                # pull of that link, it ends with the link's typed status
                status = S.LLM_LINK_FAILED
        except Exception as exc:  # noqa: BLE001 - a bug must end the task, not the worker
            _log.error("llmdd.transfer.async_pull_failed", error=repr(exc))
            status, error = S.LLM_FAILED, exc
        try:
            if status is S.LLM_SUCCESS:
                self.task.fire("transfer_succeeded")
            else:
                self.task.fire("deadline_expired" if status is S.LLM_TIMEOUT else "transfer_failed", error=error)
        finally:
            self._finish(status)

    def _finish(self, status: LLMStatusCode) -> None:
        self._status = status   # before _done: a waiter woken by it reads this status, never None
        self._done.set()
        self._engine.task_ended(self)
        callback = self._callback
        if callback is not None:
            try:
                callback(status)
            except Exception as exc:  # noqa: BLE001 - a caller's callback cannot break the engine
                _log.warning("llmdd.transfer.async_pull_callback_failed", error=repr(exc))

    def _cancel_queued(self, status: LLMStatusCode, why: str) -> None:
        # the worker that picks it up later finds it CANCELLED and does nothing; one already
        # running (or done) absorbs the withdrawal and ends it itself
        if self.task.offer("withdraw", error=LLMException(why, status_code=status)):
            self._finish(status)

    def link_down(self, link: LinkView) -> None:
        if link is self._link:
            self._link_went = True
            self._cancel_queued(S.LLM_LINK_FAILED, f"the link to cluster {link.peer_cluster_id} went down")

    def cancel(self) -> None:
        self._cancel_queued(S.LLM_ENGINE_FINALIZED, "the engine is finalized")

    def refuse(self, status: LLMStatusCode, why: str) -> None:
        """Never started (its worker could not be had): it ends with ``status``."""
        self._cancel_queued(status, why)

    def __repr__(self) -> str:
        return f"<AsyncPull peer={getattr(self._link, 'peer_cluster_id', None)} status={self._status}>"


class AsyncTransfer:
    """One ``transfer_cache_async`` call: a thread walking the layers as the synchronizer releases them."""

    def __init__(self, engine: TaskHost, rec: CacheRecord, src: CacheLayout, synchronizer: LayerSynchronizer,
                 configs: list[Union[TransferConfig, TransferWithCacheKeyConfig]],
                 src_blocks: Optional[Sequence[int]], dst_blocks: Optional[Sequence[int]],
                 dst_block_size: Optional[int], *, task: "Tracked") -> None:
        self._engine = engine
        self._rec = rec
        self._src = src
        self._sync = synchronizer
        self._configs = configs
        self._src_blocks = src_blocks
        self._dst_blocks = dst_blocks
        self._dst_block_size = dst_block_size
        self._results: list[Optional[LLMStatusCode]] = [None] * len(configs)
        runtime = engine.runtime
        self._clock = runtime.monotonic
        self._done = runtime.event()
        self._cancelled = runtime.event()
        self._lock = runtime.lock()
        self._links: list = []
        self.layer_times: list[tuple[int, float, float]] = []  # (layer, released_at, transferred_at)
        self.task = task

    def _distinct_links(self) -> list:
        """Each link once, however many configs target it (Link objects compare by identity)."""
        return list({id(lk): lk for lk in self._links}.values())

    def start(self) -> None:
        try:
            for config in self._configs:
                self._links.append(self._engine.link_for(config.dst_cluster_id))
            self._engine.claim_links(self._distinct_links())
        except LLMException:
            self._engine.task_ended(self)
            raise
        self._engine.runtime.start_worker("llmdd-async", self._run)

    # -- the CacheTask protocol -------------------------------------------------------
    def wait(self, timeout_s: Optional[float]) -> bool:
        return self._done.wait(timeout_s)

    def results(self) -> list:
        with self._lock:
            return list(self._results)

    def cancel(self) -> None:
        self._cancelled.set()
        self._done.wait(5.0)

    def link_down(self, link: LinkView) -> None:
        if any(lk is link for lk in self._links):
            self._cancelled.set()

    # -- the worker -----------------------------------------------------------------------
    def _config_layers(self, config: Union[TransferConfig, TransferWithCacheKeyConfig]) -> range:
        if config.src_layer_range is not None:
            return config.src_layer_range
        return range(0, self._src.num_tensors // 2)

    def _layers(self) -> list:
        """Every layer some config transfers, in ascending order (configs may cover different ranges)."""
        return sorted({layer for config in self._configs for layer in self._config_layers(config)})

    def _set(self, i: int, code: LLMStatusCode) -> None:
        with self._lock:
            if self._results[i] in (None, S.LLM_SUCCESS):
                self._results[i] = code

    def _run(self) -> None:
        engine = self._engine
        task = self.task
        failed = [False] * len(self._configs)
        final_error: Optional[BaseException] = None
        timed_out = False
        try:
            for layer in self._layers():
                if self._cancelled.is_set():
                    raise LLMException("the async transfer was cancelled (link down or finalize)",
                                       status_code=S.LLM_LINK_FAILED)
                task.fire("wait_layer", layer=layer)
                released_at = self._clock()
                ok = bool(self._sync.synchronize_layer(layer, None))
                if not ok:
                    # the configs that transfer this layer fail; configs whose layers never started keep None
                    for i, config in enumerate(self._configs):
                        if not failed[i] and layer in self._config_layers(config):
                            failed[i] = True
                            self._set(i, S.LLM_PARAM_INVALID)
                    final_error = LLMException(f"synchronize_layer({layer}) returned False",
                                               status_code=S.LLM_PARAM_INVALID)
                    task.fire("synchronizer_refused", error=final_error, layer=layer)
                    return
                task.fire("start", layer=layer)
                for i, config in enumerate(self._configs):
                    if failed[i]:
                        continue
                    if layer not in self._config_layers(config):
                        continue
                    link = self._links[i]
                    try:
                        ops = engine.plan_async_config(link, self._src, config, layer,
                                                       src_blocks=self._src_blocks, dst_blocks=self._dst_blocks,
                                                       dst_block_size=self._dst_block_size)
                        try:
                            engine.run_ops(link, ops, write=True, kind="transfer_cache_async", step_of=task)
                        except TransferTimedOut:
                            timed_out = True
                            raise
                        self._set(i, S.LLM_SUCCESS)
                    except LLMException as exc:
                        failed[i] = True
                        self._set(i, exc.status_code)
                        final_error = exc
                self.layer_times.append((layer, released_at, self._clock()))
                task.fire("layer_transferred", layer=layer)
            if final_error is not None:
                task.fire("deadline_expired" if timed_out else "transfer_failed", error=final_error)
            else:
                task.fire("transfer_succeeded")
        except LLMException as exc:
            for i in range(len(self._configs)):
                if self._results[i] is not None and not failed[i]:
                    self._set(i, exc.status_code)
            task.offer("cancel", error=exc)
        except BaseException as exc:  # a synchronizer that raises fails the task, never the engine
            _log.warning("llmdd.transfer.async_failed", error=repr(exc))
            for i in range(len(self._configs)):
                if self._results[i] is not None:
                    self._set(i, S.LLM_FAILED)
            task.offer("transfer_failed", error=exc)
        finally:
            engine.release_links(self._distinct_links())
            engine.task_ended(self)
            self._done.set()
