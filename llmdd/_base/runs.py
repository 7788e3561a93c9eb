"""In-process copies of address runs without a Python object per run where that is faster
(``llmdd.lowlevel.copy_runs``): the shm plugin's pure-Python path (mapped pool segments) and the tcp
plugin's TLS staging use it.

:func:`copy_runs` copies the runs of one equal length (at most :data:`GATHER_MAX_LEN` bytes, at least
:data:`GATHER_MIN_OPS` of them) with one numpy fancy-index assignment: a void-``L`` view of the address
span of the sources and one of the destinations (an element starting at every byte; numpy touches only
the elements it is indexed with, which the caller guarantees are inside memory it holds), gathered into a
temporary and scattered.  The remaining runs, long ones (where the copy dominates the call and one
``memmove`` beats the gather's two copies) and lengths with too few runs to pay numpy's fixed costs, are
``memmove``d one by one.  ``bench/probes/shm_mapped_path.py`` and ``bench/probes/shm_copy_micro.py`` measured the
choice (bench/results-committed/issue17/): a batch-wide ``process_vm_readv`` on the own pid was slower
than both at 13 of 14 shapes.
"""

from __future__ import annotations

import ctypes

from llmdd._base.lazy import np  # numpy at its first use: an idle engine needs none

__all__ = ["GATHER_MAX_LEN", "GATHER_MIN_OPS", "copy_runs"]

#: longest run copied by the numpy gather (longer ones: one memmove each, one copy instead of two)
GATHER_MAX_LEN = 8192
#: fewest runs of one length worth a gather (numpy's fixed cost is about that many memmove calls)
GATHER_MIN_OPS = 32


class _Span:
    """``np.asarray(_Span(lo, count, length))``: ``count`` overlapping void-``length`` elements, element
    ``k`` at address ``lo + k`` (a raw view, as ``ctypes.memmove`` takes raw addresses)."""

    def __init__(self, lo: int, count: int, length: int) -> None:
        self.__array_interface__ = {"version": 3, "shape": (count,), "typestr": f"|V{length}",
                                    "data": (lo, False), "strides": (1,)}


def _view(addrs: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    lo = int(addrs.min())
    view = np.asarray(_Span(lo, int(addrs.max()) - lo + 1, length))
    return view, (addrs - np.uint64(lo)).astype(np.intp)


def _gather(dst: np.ndarray, src: np.ndarray, length: int) -> None:
    sv, si = _view(src, length)
    dv, di = _view(dst, length)
    dv[di] = sv[si]


def copy_runs(dst: np.ndarray, src: np.ndarray, ln: np.ndarray) -> None:
    """Copy ``ln[i]`` bytes from address ``src[i]`` to address ``dst[i]`` for every ``i`` (``uint64``
    arrays; runs neither overlap each other's destinations nor their own sources)."""
    n = len(ln)
    rest = None
    if n >= GATHER_MIN_OPS:
        length = int(ln[0])
        if 0 < length <= GATHER_MAX_LEN and int(ln.min()) == int(ln.max()):   # one length (blocks): one gather
            _gather(dst, src, length)
            return
        small = np.flatnonzero(ln <= np.uint64(GATHER_MAX_LEN))
        if len(small) >= GATHER_MIN_OPS:
            lens, inv, counts = np.unique(ln[small], return_inverse=True, return_counts=True)
            groups = np.flatnonzero(counts >= GATHER_MIN_OPS)
            if len(groups):
                left = np.ones(n, bool)
                for g in groups.tolist():   # one gather per distinct length (at most n / GATHER_MIN_OPS)
                    sel = small[inv == g]
                    if int(lens[g]):
                        _gather(dst[sel], src[sel], int(lens[g]))
                    left[sel] = False
                rest = np.flatnonzero(left)
    if rest is None:
        d, s, k = dst.tolist(), src.tolist(), ln.tolist()
    elif not len(rest):
        return
    else:
        d, s, k = dst[rest].tolist(), src[rest].tolist(), ln[rest].tolist()
    mm = ctypes.memmove
    for a, b, c in zip(d, s, k):
        mm(a, b, c)
