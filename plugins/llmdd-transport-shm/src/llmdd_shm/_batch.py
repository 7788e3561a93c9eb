"""One running shm batch (:class:`PinnedBatch`): what it pins (local regions, the peer's mapped segments),
its abort flag and (split batch) completion.  The endpoint creates it (:meth:`ShmEndpoint.begin_batch
<llmdd_shm._endpoint.ShmEndpoint.begin_batch>`), the channel tracks it, the copy plans pass it back to the
channel's peer checks."""

from __future__ import annotations

from llmdd.lowlevel import Batch


class PinnedBatch(Batch):
    """One running batch: what it pins (local regions, the peer's mapped segments), its abort flag and
    (split batch) completion; parts check ``aborted`` between chunks."""

    __slots__ = ("maps",)

    def __init__(self) -> None:
        super().__init__()
        self.maps: list = []
