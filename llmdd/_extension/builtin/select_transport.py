"""The default transport policy (``trylast``: any plugin's choice comes first).

1. A transport forced by option is used if it is a candidate; if it is not,
   no transport is chosen (the link fails and says so) rather than silently
   using another one.
2. A peer on this host gets the most preferred same-host-only transport
   (e.g. ``shm``) when there is one.
3. Otherwise the most preferred network transport (not same-host-only).

Candidates arrive most preferred first (highest ``priority``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from llmdd.plugin import LinkInfo, TransportCandidate, hookimpl

__all__ = ["llmdd_select_transport"]


@hookimpl(trylast=True)
def llmdd_select_transport(link: LinkInfo, candidates: Sequence[TransportCandidate]) -> Optional[str]:
    if link.forced:
        return link.forced if any(c.name == link.forced for c in candidates) else None
    if link.same_host:
        for c in candidates:
            if c.same_host_only:
                return c.name
    for c in candidates:
        if not c.same_host_only:
            return c.name
    return None
