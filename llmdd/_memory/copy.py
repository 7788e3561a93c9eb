"""The bounds-checked local copy executor.

A copy is a numpy array of ``(src, dst, length)`` ops (:data:`COPY_OP_DTYPE`),
built vectorised from per-tensor base addresses and index arrays (no Python
object per block).  :func:`execute` validates EVERY op against the bounds of
both sides (:class:`Bounds`: registered regions from the region table, or the
trusted ranges of a ``create_cpu_cache``) before any byte moves, coalesces
runs, then copies with ``ctypes.memmove`` (which releases the GIL) per
coalesced run.

Op order is preserved: ops execute in the order given, and coalescing merges
consecutive ops only where the merged copy is byte-for-byte the same as the
sequence (a merged run whose destination starts inside its own source, i.e.
``src < dst < src + length``, is left unmerged).
"""

from __future__ import annotations

import ctypes
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from llmdd._base.lazy import np, numpy_constants, when_numpy_loaded
from llmdd._base.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    import numpy
    from llmdd._memory.manager import CacheRecord

__all__ = [
    "COPY_OP_DTYPE",
    "Bounds",
    "make_copy_ops",
    "coalesce_copy_ops",
    "block_copy_ops",
    "slot_copy_ops",
    "check_copy_ops",
    "execute",
    "as_index_array",
    "copy_slot",
    "copy_block_lists",
]

COPY_OP_DTYPE: numpy.dtype   # a numpy dtype, defined when numpy is first used (llmdd._base.lazy)


@when_numpy_loaded
def _define_dtypes(numpy: ModuleType) -> None:
    global COPY_OP_DTYPE
    COPY_OP_DTYPE = numpy.dtype([("src", "<u8"), ("dst", "<u8"), ("length", "<u8")])


__getattr__ = numpy_constants(globals(), "COPY_OP_DTYPE")

_memmove = ctypes.memmove


def _invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


class Bounds:
    """Sorted, disjoint address ranges ``[start, end)`` that a copy may touch (vectorised checks)."""

    __slots__ = ("starts", "ends")

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        self.starts = starts
        self.ends = ends

    @classmethod
    def from_ranges(cls, ranges: Iterable[tuple[int, int]]) -> "Bounds":
        """From ``(addr, size)`` pairs; empty ranges are ignored; overlapping ranges are refused."""
        items = sorted((int(a), int(a) + int(s)) for a, s in ranges if int(s) > 0)
        starts = np.fromiter((a for a, _ in items), dtype=np.uint64, count=len(items))
        ends = np.fromiter((e for _, e in items), dtype=np.uint64, count=len(items))
        if len(items) > 1 and bool(np.any(starts[1:] < ends[:-1])):
            raise _invalid("address ranges overlap")
        return cls(starts, ends)

    def __len__(self) -> int:
        return len(self.starts)

    def check(self, addrs: np.ndarray, lengths: np.ndarray, side: str) -> None:
        """``LLMException(LLM_PARAM_INVALID)`` unless each ``[addr, addr+len)`` lies inside one range."""
        n = len(addrs)
        if n == 0:
            return
        addrs = np.asarray(addrs, dtype=np.uint64)
        lengths = np.asarray(lengths, dtype=np.uint64)
        if len(self.starts) == 0:
            raise _invalid(f"{side} address {int(addrs[0]):#x} is not inside registered memory")
        idx = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        found = idx >= 0
        idx_c = np.maximum(idx, 0)
        end = self.ends[idx_c]
        # addr + len <= end, written overflow-free: addr <= end and len <= end - addr
        ok = found & (addrs <= end) & (lengths <= end - np.minimum(addrs, end))
        if not bool(ok.all()):
            i = int(np.argmin(ok))
            raise _invalid(f"{side} range [{int(addrs[i]):#x}, +{int(lengths[i])}) of op {i} is outside "
                           f"registered memory")


def as_index_array(values: Sequence[int], name: str, limit: int) -> np.ndarray:
    """Indices as an int64 array; ``LLM_PARAM_INVALID`` unless every one is in ``[0, limit)``."""
    if isinstance(values, np.ndarray):
        arr = values.astype(np.int64, copy=False)
    else:
        try:
            arr = np.fromiter(values, dtype=np.int64, count=len(values))
        except OverflowError:
            raise _invalid(f"{name} holds an index out of range [0, {limit})") from None
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        bad = arr[(arr < 0) | (arr >= limit)][0]
        raise _invalid(f"{name} index {int(bad)} out of range [0, {limit})")
    return arr


def make_copy_ops(src, dst, length) -> np.ndarray:
    """An op array from scalars or arrays (broadcast)."""
    s, d, n = np.broadcast_arrays(np.asarray(src, dtype=np.uint64), np.asarray(dst, dtype=np.uint64),
                                  np.asarray(length, dtype=np.uint64))
    ops = np.empty(s.size, dtype=COPY_OP_DTYPE)
    ops["src"] = s.reshape(-1)
    ops["dst"] = d.reshape(-1)
    ops["length"] = n.reshape(-1)
    return ops


def block_copy_ops(src_bases: Sequence[int], dst_bases: Sequence[int], block_size: int,
                   src_blocks: np.ndarray, dst_blocks: np.ndarray) -> np.ndarray:
    """Ops copying block ``src_blocks[j]`` of tensor ``i`` to block ``dst_blocks[j]`` of tensor ``i``.

    ``src_bases`` / ``dst_bases`` are per-tensor base addresses (same count); ops are
    tensor-major, blocks in the order given.  Indices must already be range-checked.
    """
    sb = np.asarray(src_bases, dtype=np.uint64)[:, None]
    db = np.asarray(dst_bases, dtype=np.uint64)[:, None]
    bs = np.uint64(block_size)
    src = sb + np.asarray(src_blocks, dtype=np.uint64)[None, :] * bs
    dst = db + np.asarray(dst_blocks, dtype=np.uint64)[None, :] * bs
    return make_copy_ops(src, dst, bs)


def slot_copy_ops(src_bases: Sequence[int], dst_bases: Sequence[int], src_offset: int, dst_offset: int,
                  length: int) -> np.ndarray:
    """Ops copying ``length`` bytes at ``src_base + src_offset`` to ``dst_base + dst_offset``, per tensor."""
    src = np.asarray(src_bases, dtype=np.uint64) + np.uint64(src_offset)
    dst = np.asarray(dst_bases, dtype=np.uint64) + np.uint64(dst_offset)
    return make_copy_ops(src, dst, length)


def coalesce_copy_ops(ops: np.ndarray) -> np.ndarray:
    """Merge consecutive ops that continue each other on both sides (order kept, semantics kept)."""
    ops = ops[ops["length"] > 0]
    if len(ops) < 2:
        return np.ascontiguousarray(ops)
    s, d, n = ops["src"], ops["dst"], ops["length"]
    cont = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    if not bool(cont.any()):
        return np.ascontiguousarray(ops)
    for _ in range(2):
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        run_len = np.add.reduceat(n, starts)
        rs, rd = s[starts], d[starts]
        # a merged memmove differs from the sequence when the destination starts inside the source
        bad = (rs < rd) & (rd < rs + run_len) & (np.diff(np.append(starts, len(ops))) > 1)
        if not bool(bad.any()):
            break
        run_id = np.cumsum(np.concatenate(([True], ~cont))) - 1
        cont = cont & ~bad[run_id[1:]]
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = ops[starts].copy()
    out["length"] = np.add.reduceat(n, starts)
    return out


def check_copy_ops(ops: np.ndarray, src_bounds: Bounds, dst_bounds: Bounds) -> None:
    """Validate every op on both sides; raises before anything is copied."""
    if not isinstance(ops, np.ndarray) or ops.dtype != COPY_OP_DTYPE:   # np first: defines COPY_OP_DTYPE
        raise _invalid(f"copy ops must have dtype COPY_OP_DTYPE, got {ops.dtype}")
    src, dst, n = ops["src"], ops["dst"], ops["length"]
    if len(ops) and (bool(np.any(src + n < src)) or bool(np.any(dst + n < dst))):
        raise _invalid("copy op range wraps around the address space")
    src_bounds.check(src, n, "source")
    dst_bounds.check(dst, n, "destination")


def execute(ops: np.ndarray, *, src_bounds: Bounds, dst_bounds: Bounds) -> int:
    """Check all ops, coalesce, copy; returns the bytes copied."""
    check_copy_ops(ops, src_bounds, dst_bounds)
    runs = coalesce_copy_ops(ops)
    total = 0
    for s, d, n in zip(runs["src"].tolist(), runs["dst"].tolist(), runs["length"].tolist()):
        _memmove(d, s, n)
        total += n
    return total


def copy_slot(s: "CacheRecord", d: "CacheRecord", src_batch_index: int, dst_batch_index: int, offset: int,
              size: int) -> int:
    """Copy ``size`` bytes (``-1``: the rest of the slot) at ``offset`` of batch slot ``src_batch_index``
    of ``s`` to the same offset of slot ``dst_batch_index`` of ``d``, every tensor: the checks of the
    contract's ``copy_cache`` on the two records' geometry (``LLM_PARAM_INVALID``), then the bytes.
    Returns the bytes copied."""
    if s.desc.num_tensors != d.desc.num_tensors:
        raise _invalid(f"src num_tensors:{s.desc.num_tensors} and dst num_tensors:{d.desc.num_tensors} must be equal")
    if src_batch_index >= s.rows:
        raise _invalid(f"src_batch_index:{src_batch_index} must be in [0, {s.rows})")
    if dst_batch_index >= d.rows:
        raise _invalid(f"dst_batch_index:{dst_batch_index} must be in [0, {d.rows})")
    if offset >= s.stride:
        raise _invalid(f"offset:{offset} must be less than the src batch stride {s.stride}")
    length = s.stride - offset if size == -1 else size
    if offset + length > s.stride:
        raise _invalid(f"offset + size ({offset + length}) exceeds the src batch stride {s.stride}")
    if offset + length > d.stride:
        raise _invalid(f"offset + size ({offset + length}) exceeds the dst batch stride {d.stride}")
    ops = slot_copy_ops(s.addrs, d.addrs, src_batch_index * s.stride + offset, dst_batch_index * d.stride + offset,
                        length)
    return execute(ops, src_bounds=s.bounds(), dst_bounds=d.bounds())


def copy_block_lists(s: "CacheRecord", d: "CacheRecord", src_blocks: Sequence[int],
                     dst_lists: Sequence[Sequence[int]], *, dst_label: str = "dst_blocks_list[{i}] block") -> int:
    """Copy block ``src_blocks[j]`` of ``s`` to block ``dst[j]`` of ``d`` for every list ``dst`` of
    ``dst_lists``, every tensor: both records' geometry checked and every list checked before the
    first byte moves (``LLM_PARAM_INVALID``; ``dst_label``, formatted with the list's index ``i``,
    names a list's blocks in the message).  Returns the bytes copied."""
    if s.desc.num_tensors != d.desc.num_tensors:
        raise _invalid(f"src num_tensors:{s.desc.num_tensors} and dst num_tensors:{d.desc.num_tensors} must be equal")
    if s.stride != d.stride:
        raise _invalid(f"block sizes differ: src {s.stride} bytes, dst {d.stride} bytes")
    src_idx = as_index_array(src_blocks, "src block", s.rows)
    plans = []
    for i, dst_blocks in enumerate(dst_lists):
        if len(dst_blocks) != len(src_blocks):
            raise _invalid(f"dst_blocks_list[{i}] has {len(dst_blocks)} blocks, src_blocks {len(src_blocks)}")
        plans.append(block_copy_ops(s.addrs, d.addrs, s.stride, src_idx,
                                    as_index_array(dst_blocks, dst_label.format(i=i), d.rows)))
    total = 0
    for ops in plans:
        total += execute(ops, src_bounds=s.bounds(), dst_bounds=d.bounds())
    return total
