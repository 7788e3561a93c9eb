"""Where a range of memory also lives: a fact the memory layer states and transports may use.

:class:`SharedSegment` says "this range also lives in the named shared-memory segment, at this
offset" (an llmdd pool draws its pages from such segments).  The memory layer sets it on the
regions it creates (``llmdd._memory``); the seam's :class:`~llmdd.lowlevel.MemRegion` carries it
as ``backing``; a same-host transport (shm) maps the segment instead of attaching to the process,
and any other transport ignores it.  It lives in the bottom layer so that both the memory layer and
the seam can name it without reaching each other.
"""

from __future__ import annotations

import attrs

__all__ = ["SharedSegment"]

#: longest segment name accepted (POSIX NAME_MAX, the /dev/shm file name)
MAX_SEGMENT_NAME = 255


@attrs.frozen(kw_only=True)
class SharedSegment:
    """``[offset, offset + size)`` of the shared-memory segment ``name`` holds the region's bytes."""

    name: str = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of(str),
                                                            attrs.validators.min_len(1),
                                                            attrs.validators.max_len(MAX_SEGMENT_NAME)))
    offset: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
