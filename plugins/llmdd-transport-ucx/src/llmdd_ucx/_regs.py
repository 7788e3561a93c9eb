"""One local registration of the ucx endpoint (:class:`LocalReg`): the region, the NIXL descriptor list it
was registered with, and the registration's generation.  The endpoint's registry holds them; a channel
reads them under the endpoint's lock."""

from __future__ import annotations

from typing import Any

from llmdd.lowlevel import MemRegion, RegisteredRegion


class LocalReg(RegisteredRegion):
    __slots__ = ("dlist", "gen")

    def __init__(self, region: MemRegion, dlist: Any, gen: int) -> None:
        super().__init__(region)
        self.dlist = dlist
        self.gen = gen
