"""Child-side helpers of test_small_transfer_path (run inside harness children)."""

from __future__ import annotations

from typing import Any

from llmdd import BlocksCacheKey, LLMException


def push_many(state: dict, remote: int, model_id: int, src: str, pairs: list, layers: int) -> int:
    """``push_blocks`` of one block per call for every (src block, dst block) of ``pairs``, back to back."""
    cm = state["dd"].cache_manager
    cache = state["caches"][src]
    key = BlocksCacheKey(remote, model_id)
    for s, d in pairs:
        cm.push_blocks(key, cache, [s], [d], range(layers), range(layers), 1)
    return len(pairs)


def pull_many(state: dict, remote: int, model_id: int, dst: str, pairs: list, layers: int) -> int:
    cm = state["dd"].cache_manager
    cache = state["caches"][dst]
    key = BlocksCacheKey(remote, model_id)
    for s, d in pairs:
        cm.pull_blocks(key, cache, [s], [d], src_layer_range=range(layers), dst_layer_range=range(layers),
                       tensor_num_per_layer=1)
    return len(pairs)


def unregister(state: dict, name: str) -> None:
    state["dd"].cache_manager.unregister_cache(state["caches"].pop(name).cache_id)


def outcome(state: dict, method: str, *args: Any, **kwargs: Any) -> str:
    """The status name (or exception type) of ``cache_manager.<method>``; ``"LLM_SUCCESS"`` when it returns."""
    args = tuple(state["caches"][a[1:]] if isinstance(a, str) and a.startswith("@") else a for a in args)
    try:
        getattr(state["dd"].cache_manager, method)(*args, **kwargs)
    except LLMException as exc:
        return exc.status_code.name
    except (TypeError, ValueError) as exc:
        return type(exc).__name__
    return "LLM_SUCCESS"


def plans(state: dict) -> int:
    """How many small-transfer plans the engine keeps."""
    return len(state["dd"].cache_manager._transfers.prepared._plans)


def shm_channel(state: dict, remote: int) -> dict:
    """The shm data path of this child and the statistics of its channel to ``remote``."""
    import llmdd_shm

    link = state["dd"].cache_manager._transfers._lm.get(remote)
    return {"native": llmdd_shm.data_path()["native"], "stats": dict(link.channel.statistics())}


def task_triggers(state: dict) -> dict:
    """The engine's task lifecycle statistics: trigger -> count."""
    return dict(state["dd"].cache_manager._transfers._tasks.statistics().triggers)
