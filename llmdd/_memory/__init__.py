"""The memory layer: backends, page pools, the region table, bounds-checked copies, cache/key tables.

No byte is touched outside a registered or allocated region: every copy is
validated (vectorised) against the region table, or against the trusted ranges
of a ``create_cpu_cache``, before it moves.
"""

from llmdd._memory.backend import (
    EmulatedDeviceBackend,
    HostBackend,
    MemoryBackend,
    Segment,
    attach_segment,
    backend_for,
    owned_segment_names,
    sweep_orphan_segments,
)
from llmdd._memory import copy as _copy
from llmdd._memory.copy import Bounds, block_copy_ops, coalesce_copy_ops, execute, make_copy_ops, slot_copy_ops
from llmdd._memory.manager import CacheRecord, MemoryManager
from llmdd._memory.pool import PagePool, PoolStatistics
from llmdd._memory.regions import Region, RegionSpec, RegionTable

__all__ = [
    "MemoryBackend", "HostBackend", "EmulatedDeviceBackend", "Segment", "attach_segment", "backend_for",
    "owned_segment_names", "sweep_orphan_segments",
    "PagePool", "PoolStatistics",
    "Region", "RegionSpec", "RegionTable",
    "COPY_OP_DTYPE", "Bounds", "make_copy_ops", "block_copy_ops", "slot_copy_ops", "coalesce_copy_ops", "execute",
    "MemoryManager", "CacheRecord",
]


def __getattr__(name: str):   # COPY_OP_DTYPE is a numpy dtype: defined when numpy is first used
    if name == "COPY_OP_DTYPE":
        return _copy.COPY_OP_DTYPE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
