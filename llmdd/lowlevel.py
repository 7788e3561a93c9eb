"""Public helpers for transport authors: regions, the op dtype, typed errors, completions.

``MemRegion`` and ``OP_DTYPE`` describe what moves (a region's ``backing``, a :class:`SharedSegment`,
says which shared-memory segment also holds it); ``check_ops`` / ``RegionTable`` validate a
batch with numpy before a byte moves; ``coalesce_ops`` / ``split_ops`` shape it;
``ThreadCompletion`` and ``DoneCompletion`` are ready-made ``Completion`` implementations;
``segment_name`` names a shared-memory segment so that a crash leftover of it is reclaimed by
the next engine (and by ``llmdd doctor --reclaim-shm``); ``copy_runs`` copies a batch of address
runs in this process with numpy gathers (no Python object per short run).  ``IoLoop`` is the engine's selectors
loop with its bounded worker pool (a transport with a listening socket serves it from one, so its
threads do not grow with connections; ``EVENT_READ`` / ``EVENT_WRITE`` are its readiness flags and
``PoolFull`` what a full pool raises); ``tls_config`` turns the engine's ``llmdd.tls_*`` options,
which a transport receives in its constructor, into the :class:`TlsConfig` the engine itself uses.

The books every transport keeps (``llmdd._seam.kit``): :class:`RegionRegistry` (local regions
with :class:`RegisteredRegion` entries, their check tables, pins, and cancel-then-drain on
``deregister`` / ``close``), :class:`Batch` (one batch in flight), :class:`BatchSet` (a channel's
batches and its close-drain) and :func:`map_os_error` (an exception raised while moving bytes as
the typed error the seam reports).  :func:`encode_payload` / :func:`decode_payload` turn a
transport's own fields into a descriptor's opaque payload and back, refusing a foreign, newer or
malformed descriptor.  docs/writing-a-transport.md shows them at work.
"""

from typing import Any, Callable, Sequence

from llmdd._seam.errors import Cancelled as Cancelled
from llmdd._seam.abc import Completion as Completion
from llmdd._seam.errors import Corrupt as Corrupt
from llmdd._seam.completions import DoneCompletion as DoneCompletion
from llmdd._seam.abc import MemRegion as MemRegion
from llmdd._base.backing import SharedSegment as SharedSegment
from llmdd._seam.errors import PeerGone as PeerGone
from llmdd._seam.ops import RegionTable as RegionTable
from llmdd._seam.errors import Refused as Refused
from llmdd._seam.completions import ThreadCompletion as _SeamThreadCompletion
from llmdd._seam.completions import CompletionThreads as _CompletionThreads
from llmdd._runtime.threads import SYSTEM as _SYSTEM
from llmdd._seam.completions import submitted as submitted
from llmdd._seam.errors import TransportTimeout as TransportTimeout
from llmdd._seam.ops import as_ops as as_ops
from llmdd._seam.ops import block_runs as block_runs
from llmdd._seam.ops import check_ops as check_ops
from llmdd._seam.ops import coalesce_ops as coalesce_ops
from llmdd._seam.ops import make_ops as make_ops
from llmdd._seam.ops import split_ops as split_ops
from llmdd._runtime.runtime import EVENT_READ as EVENT_READ
from llmdd._base.lazy import np as lazy_numpy
from llmdd._base.lazy import when_numpy_loaded as when_numpy_loaded
from llmdd._runtime.runtime import EVENT_WRITE as EVENT_WRITE
from llmdd._runtime.ioloop import IoLoop as IoLoop
from llmdd._runtime.runtime import PoolFull as PoolFull
from llmdd._memory.segments import segment_name as segment_name
from llmdd._base.options import TlsConfig as TlsConfig
from llmdd._base.options import tls_config as tls_config
from llmdd._base.log import get_logger as get_logger
from llmdd._base.runs import copy_runs as copy_runs
from llmdd._seam.kit import Batch as Batch
from llmdd._seam.kit import BatchSet as BatchSet
from llmdd._seam.kit import RegionRegistry as RegionRegistry
from llmdd._seam.kit import RegisteredRegion as RegisteredRegion
from llmdd._seam.kit import map_os_error as map_os_error
from llmdd._seam.payload import decode_payload as decode_payload
from llmdd._seam.payload import encode_payload as encode_payload
from llmdd._base.status import TransportError as TransportError

__all__ = [
    "block_runs",
    "get_logger",
    "segment_name",
    "IoLoop",
    "EVENT_READ",
    "EVENT_WRITE",
    "PoolFull",
    "TlsConfig",
    "tls_config",
    "OP_DTYPE",
    "MemRegion",
    "SharedSegment",
    "RegionTable",
    "Completion",
    "DoneCompletion",
    "submitted",
    "ThreadCompletion",
    "TransportError",
    "TransportTimeout",
    "PeerGone",
    "Refused",
    "Corrupt",
    "Cancelled",
    "as_ops",
    "check_ops",
    "coalesce_ops",
    "make_ops",
    "split_ops",
    "RegisteredRegion",
    "RegionRegistry",
    "Batch",
    "BatchSet",
    "map_os_error",
    "copy_runs",
    "encode_payload",
    "decode_payload",
    "lazy_numpy",
    "when_numpy_loaded",
]


def __getattr__(name: str):   # OP_DTYPE is a numpy dtype: defined when numpy is first used (llmdd._base.lazy)
    if name == "OP_DTYPE":
        from llmdd._seam import ops as _ops

        return _ops.OP_DTYPE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ThreadCompletion(_SeamThreadCompletion):
    __doc__ = _SeamThreadCompletion.__doc__

    def __init__(self, workers: Sequence[Callable[[], None]], *, threads: _CompletionThreads = _SYSTEM,
                 **kwargs: Any) -> None:
        super().__init__(workers, threads=threads, **kwargs)
