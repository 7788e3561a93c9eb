"""Public helpers for transport authors: regions, the op dtype, typed errors, completions.

``MemRegion`` and ``OP_DTYPE`` describe what moves; ``check_ops`` / ``RegionTable`` validate a
batch with numpy before a byte moves; ``coalesce_ops`` / ``split_ops`` shape it;
``ThreadCompletion`` and ``DoneCompletion`` are ready-made ``Completion`` implementations;
``segment_name`` names a shared-memory segment so that a crash leftover of it is reclaimed by
the next engine (and by ``llmdd doctor --reclaim-shm``).  ``IoLoop`` is the engine's selectors
loop with its bounded worker pool (a transport with a listening socket serves it from one, so its
threads do not grow with connections; ``EVENT_READ`` / ``EVENT_WRITE`` are its readiness flags and
``PoolFull`` what a full pool raises); ``tls_config`` turns the engine's ``llmdd.tls_*`` options,
which a transport receives in its constructor, into the :class:`TlsConfig` the engine itself uses.
"""

from ._abc import Cancelled as Cancelled
from ._abc import Completion as Completion
from ._abc import Corrupt as Corrupt
from ._abc import DoneCompletion as DoneCompletion
from ._abc import MemRegion as MemRegion
from ._abc import PeerGone as PeerGone
from ._abc import RegionTable as RegionTable
from ._abc import Refused as Refused
from ._abc import ThreadCompletion as ThreadCompletion
from ._abc import TransportTimeout as TransportTimeout
from ._abc import as_ops as as_ops
from ._abc import check_ops as check_ops
from ._abc import coalesce_ops as coalesce_ops
from ._abc import make_ops as make_ops
from ._abc import split_ops as split_ops
from ._ioloop import EVENT_READ as EVENT_READ
from ._lazy import np as lazy_numpy
from ._lazy import when_numpy_loaded as when_numpy_loaded
from ._ioloop import EVENT_WRITE as EVENT_WRITE
from ._ioloop import IoLoop as IoLoop
from ._ioloop import PoolFull as PoolFull
from ._memory.segments import segment_name as segment_name
from ._options import TlsConfig as TlsConfig
from ._options import tls_config as tls_config
from ._log import get_logger as get_logger
from ._status import TransportError as TransportError

__all__ = [
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
    "RegionTable",
    "Completion",
    "DoneCompletion",
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
    "lazy_numpy",
    "when_numpy_loaded",
]


def __getattr__(name: str):   # OP_DTYPE is a numpy dtype: defined when numpy is first used (llmdd._lazy)
    if name == "OP_DTYPE":
        from . import _abc
        return _abc.OP_DTYPE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
