"""A page-granular allocator over one backend segment (``mem_pool_cfg`` / ``host_mem_pool_cfg``).

The pool owns one segment of ``ceil(memory_size / page) * page`` bytes (so an
allocation of ``memory_size`` bytes fits).  Allocations are runs of whole pages,
chosen *best fit* (smallest free run that fits, lowest address among equals).
Free runs are kept twice, sorted by start (to merge neighbours on free) and by
``(length, start)`` (to find the best fit): both lookups are ``bisect`` calls,
no per-byte or per-page work.

Errors: exhaustion is ``LLMException(LLM_OUT_OF_MEMORY)`` and leaves the pool
unchanged; freeing an address that is not the start of a live allocation (double
free, foreign address) is ``LLMException(LLM_PARAM_INVALID)``.  Thread-safe.
"""

from __future__ import annotations

import bisect
import threading
from typing import Optional

import attrs

from llmdd._base.status import LLMException, LLMStatusCode
from llmdd._memory.backend import MemoryBackend, Segment

__all__ = ["PagePool", "PoolStatistics"]


@attrs.frozen(kw_only=True)
class PoolStatistics:
    placement: str
    page_size: int
    total_pages: int
    used_pages: int
    free_pages: int
    largest_free_run: int  # pages
    free_runs: int
    allocations: int       # live allocations
    allocations_total: int  # successful allocate() calls since creation
    failures: int          # allocate() calls refused for lack of memory
    segment: Optional[str]

    @property
    def total_bytes(self) -> int:
        return self.total_pages * self.page_size

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_size

    @property
    def free_bytes(self) -> int:
        return self.free_pages * self.page_size

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d.update(total_bytes=self.total_bytes, used_bytes=self.used_bytes, free_bytes=self.free_bytes)
        return d


class PagePool:
    """``PagePool(memory_size, page_shift, backend)``: one segment, page-granular allocations."""

    def __init__(self, memory_size: int, page_shift: int, backend: MemoryBackend) -> None:
        if not isinstance(memory_size, int) or memory_size <= 0:
            raise LLMException(f"memory_size must be > 0, got {memory_size!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if not isinstance(page_shift, int) or not 0 <= page_shift < 64:
            raise LLMException(f"invalid page_shift {page_shift!r}", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self.page_shift = page_shift
        self.page_size = 1 << page_shift
        self.total_pages = (memory_size + self.page_size - 1) >> page_shift
        self.memory_size = memory_size
        self.backend = backend
        self.placement = backend.placement
        self._lock = threading.Lock()
        self._segment: Optional[Segment] = backend.allocate_segment(self.total_pages << page_shift)
        self.base = self._segment.addr
        self.size = self.total_pages << page_shift
        # free runs: start page -> length; sorted starts; sorted (length, start)
        self._free: dict[int, int] = {0: self.total_pages}
        self._free_starts: list[int] = [0]
        self._free_by_len: list[tuple[int, int]] = [(self.total_pages, 0)]
        self._alloc: dict[int, int] = {}  # start page -> pages
        self._used = 0
        self._allocs_total = 0
        self._failures = 0

    # ------------------------------------------------------------------ helpers
    @property
    def segment(self) -> Segment:
        if self._segment is None:
            raise LLMException("memory pool is closed", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
        return self._segment

    @property
    def closed(self) -> bool:
        return self._segment is None

    def pages_for(self, nbytes: int) -> int:
        """Pages an allocation of ``nbytes`` takes (at least one)."""
        return max(1, (nbytes + self.page_size - 1) >> self.page_shift)

    def _add_free(self, start: int, length: int) -> None:
        self._free[start] = length
        bisect.insort(self._free_starts, start)
        bisect.insort(self._free_by_len, (length, start))

    def _del_free(self, start: int) -> int:
        length = self._free.pop(start)
        del self._free_starts[bisect.bisect_left(self._free_starts, start)]
        del self._free_by_len[bisect.bisect_left(self._free_by_len, (length, start))]
        return length

    # --------------------------------------------------------------- allocation
    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes`` (rounded up to whole pages); return the address."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise LLMException(f"allocation size must be an int >= 0, got {nbytes!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        pages = self.pages_for(nbytes)
        with self._lock:
            if self._segment is None:
                raise LLMException("memory pool is closed", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
            i = bisect.bisect_left(self._free_by_len, (pages, -1))
            if i == len(self._free_by_len):
                self._failures += 1
                largest = self._free_by_len[-1][0] if self._free_by_len else 0
                raise LLMException(
                    f"{self.placement.name.lower()} memory pool out of memory: {nbytes} bytes ({pages} pages) "
                    f"requested, {self.total_pages - self._used} pages free, largest free run {largest} pages",
                    status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
            length, start = self._free_by_len[i]
            self._del_free(start)
            if length > pages:
                self._add_free(start + pages, length - pages)
            self._alloc[start] = pages
            self._used += pages
            self._allocs_total += 1
            return self.base + (start << self.page_shift)

    def free(self, addr: int) -> None:
        """Free the allocation that starts at ``addr``."""
        with self._lock:
            start = self._page_of(addr)
            pages = self._alloc.pop(start, None) if start is not None else None
            if start is None or pages is None:
                raise LLMException(f"address {addr!r} is not a live allocation of this pool",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
            self._used -= pages
            end = start + pages
            # merge with the following free run
            if end in self._free:
                pages += self._del_free(end)
            # merge with the preceding free run
            j = bisect.bisect_left(self._free_starts, start) - 1
            if j >= 0:
                prev = self._free_starts[j]
                if prev + self._free[prev] == start:
                    plen = self._del_free(prev)
                    start, pages = prev, pages + plen
            self._add_free(start, pages)

    def _page_of(self, addr: int) -> Optional[int]:
        if not isinstance(addr, int) or self._segment is None:
            return None
        off = addr - self.base
        if off < 0 or off >= self.size or off & (self.page_size - 1):
            return None
        return off >> self.page_shift

    def allocation_size(self, addr: int) -> int:
        """Bytes reserved by the live allocation starting at ``addr`` (``LLM_PARAM_INVALID`` if none)."""
        with self._lock:
            start = self._page_of(addr)
            pages = self._alloc.get(start) if start is not None else None
        if pages is None:
            raise LLMException(f"address {addr!r} is not a live allocation of this pool",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return pages << self.page_shift

    def contains(self, addr: int, length: int = 1) -> bool:
        """True when ``[addr, addr+length)`` lies inside the pool's segment."""
        return self._segment is not None and self.base <= addr and addr + length <= self.base + self.size

    def offset_of(self, addr: int) -> int:
        """Offset of ``addr`` inside the segment (for same-host peers mapping it)."""
        if not self.contains(addr, 0):
            raise LLMException(f"address {addr:#x} is outside the pool", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        return addr - self.base

    # ------------------------------------------------------------ observability
    def statistics(self) -> PoolStatistics:
        with self._lock:
            return PoolStatistics(
                placement=self.placement.name, page_size=self.page_size, total_pages=self.total_pages,
                used_pages=self._used, free_pages=self.total_pages - self._used,
                largest_free_run=self._free_by_len[-1][0] if self._free_by_len else 0,
                free_runs=len(self._free), allocations=len(self._alloc),
                allocations_total=self._allocs_total, failures=self._failures,
                segment=self._segment.name if self._segment is not None else None)

    def allocations(self) -> dict[int, int]:
        """Live allocations ``addr -> bytes`` (a snapshot)."""
        with self._lock:
            return {self.base + (s << self.page_shift): p << self.page_shift for s, p in self._alloc.items()}

    def check_consistency(self) -> None:
        """Assert the allocator's invariants (tests): runs disjoint, coalesced, accounting exact."""
        with self._lock:
            runs = sorted([(s, n, "free") for s, n in self._free.items()]
                          + [(s, n, "used") for s, n in self._alloc.items()])
            pos = 0
            prev_kind = None
            for s, n, kind in runs:
                assert n > 0, f"empty run at page {s}"
                assert s == pos, f"gap or overlap at page {pos} (next run starts at {s})"
                assert not (kind == "free" and prev_kind == "free"), f"free runs not merged at page {s}"
                pos, prev_kind = s + n, kind
            assert pos == self.total_pages, f"runs cover {pos} pages of {self.total_pages}"
            assert self._free_starts == sorted(self._free), "free start index out of sync"
            assert self._free_by_len == sorted((n, s) for s, n in self._free.items()), "free size index out of sync"
            assert self._used == sum(self._alloc.values()), "used page count out of sync"

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Release the segment (unlinks it); every allocation becomes invalid. Idempotent."""
        with self._lock:
            seg, self._segment = self._segment, None
            self._alloc.clear()
            self._free.clear()
            self._free_starts.clear()
            self._free_by_len.clear()
            self._used = 0
        if seg is not None:
            self.backend.release(seg)

    def __repr__(self) -> str:
        return (f"PagePool(placement={self.placement.name}, pages={self.total_pages}, "
                f"page_size={self.page_size}, used={self._used})")
