"""The op format of a batch and the helpers that check and shape batches (public in :mod:`llmdd.lowlevel`).

``OP_DTYPE`` is one op: (local region, offset, remote region, offset, length), packed.  A batch is a
1-d numpy array of it; no per-op Python object crosses the seam.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:
    import numpy
    from numpy.typing import ArrayLike

from llmdd._base.lazy import np, numpy_constants, when_numpy_loaded
from llmdd._seam.errors import Refused

__all__ = ["OP_DTYPE", "RegionTable", "as_ops", "check_ops", "make_ops", "coalesce_ops", "split_ops", "block_runs"]

#: One op of a batch: (local region, offset, remote region, offset, length), packed (a numpy
#: dtype, defined when numpy is first used: see llmdd._base.lazy).
OP_DTYPE: numpy.dtype
#: its fields, in order
OP_FIELDS = ("local_region", "local_offset", "remote_region", "remote_offset", "length")


@when_numpy_loaded
def _define_dtypes(numpy: ModuleType) -> None:
    global OP_DTYPE
    OP_DTYPE = numpy.dtype(list(zip(OP_FIELDS, ("<u4", "<u8", "<u4", "<u8", "<u8"))))


__getattr__ = numpy_constants(globals(), "OP_DTYPE")


#: batches of at most this many ops are checked with plain Python integers
_SMALL_BATCH = 8


class RegionTable:
    """An immutable snapshot ``region_id -> size`` kept as sorted numpy arrays.

    Endpoints rebuild it on register/deregister (rare) so that validating a batch is a few
    vectorised numpy calls, whatever its length.
    """

    __slots__ = ("ids", "sizes", "by_id", "private")

    def __init__(self, sizes: Union[Mapping[int, Any], Iterable[tuple[int, Any]]] = (), *,
                 private: Sequence[int] = ()) -> None:
        items = sorted((int(k), int(v.size if hasattr(v, "size") else v)) for k, v in dict(sizes).items())
        self.ids = np.fromiter((k for k, _ in items), dtype=np.int64, count=len(items))
        self.sizes = np.fromiter((v for _, v in items), dtype=np.uint64, count=len(items))
        #: the same table as a dict, for batches of a few ops (no numpy fixed costs)
        self.by_id = dict(items)
        #: ids registered by the owner but not remote-accessible: refused as such, not as "not registered"
        self.private = frozenset(int(k) for k in private)

    def _missing(self, side: str, rid: int) -> Refused:
        """The one refusal for an op naming a region outside this table."""
        if rid in self.private:
            return Refused(f"{side} region {rid} is not remote-accessible")
        return Refused(f"{side} region {rid} is not registered")

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, region_id: object) -> bool:
        i = int(np.searchsorted(self.ids, region_id))
        return i < len(self.ids) and int(self.ids[i]) == region_id

    def check(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, side: str) -> None:
        """Raise :class:`Refused` unless every ``(id, offset, length)`` lies inside its region."""
        n = len(ids)
        if not n:
            return
        if n <= _SMALL_BATCH:
            # plain integer compares: same checks, same messages, without numpy's per-call costs
            by_id = self.by_id
            for i, (rid, off, ln) in enumerate(zip(ids.tolist(), offsets.tolist(), lengths.tolist())):
                size = by_id.get(rid)
                if size is None:
                    raise self._missing(side, rid)
                if off < 0 or ln < 0 or off > size or ln > size - off:
                    raise Refused(f"{side} op {i} out of bounds: region {rid} offset {off % 2**64} "
                                  f"length {ln % 2**64} size {size}")
            return
        ids = ids.astype(np.int64, copy=False)
        if not len(self.ids):
            raise self._missing(side, int(ids[0]))
        pos = np.searchsorted(self.ids, ids)
        np.minimum(pos, len(self.ids) - 1, out=pos)
        found = self.ids[pos] == ids
        if not found.all():
            raise self._missing(side, int(ids[np.argmin(found)]))
        size = self.sizes[pos]
        offsets = offsets.astype(np.uint64, copy=False)
        lengths = lengths.astype(np.uint64, copy=False)
        inside = offsets <= size
        # size - offsets is only evaluated (and only meaningful) where offsets <= size
        ok = inside & (lengths <= np.where(inside, size - np.minimum(offsets, size), 0))
        if not ok.all():
            i = int(np.argmin(ok))
            raise Refused(f"{side} op {i} out of bounds: region {int(ids[i])} offset {int(offsets[i])} "
                          f"length {int(lengths[i])} size {int(size[i])}")


def _as_table(regions: Union[RegionTable, Mapping[int, Any]]) -> RegionTable:
    return regions if isinstance(regions, RegionTable) else RegionTable(regions)


def as_ops(ops: Any) -> np.ndarray:
    """Return ``ops`` as a 1-d C-contiguous array of :data:`OP_DTYPE` (no copy when it already is)."""
    if type(ops) is np.ndarray and ops.dtype is OP_DTYPE and ops.ndim == 1 and ops.flags.c_contiguous:
        return ops
    arr = np.asarray(ops)
    if arr.dtype != OP_DTYPE:
        raise Refused(f"ops must be a numpy array of OP_DTYPE, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1))


def check_ops(ops: ArrayLike, local_regions: Union[RegionTable, Mapping[int, Any]],
              remote_regions: Union[RegionTable, Mapping[int, Any]]) -> np.ndarray:
    """Validate every op against both sides' region bounds before a byte moves.

    ``local_regions`` / ``remote_regions`` map region id -> size (an int or anything with
    ``.size``, e.g. a :class:`MemRegion`), or are :class:`RegionTable` snapshots.
    Returns the ops as a contiguous :data:`OP_DTYPE` array; raises :class:`Refused`.
    """
    arr = as_ops(ops)
    _as_table(local_regions).check(arr["local_region"], arr["local_offset"], arr["length"], "local")
    _as_table(remote_regions).check(arr["remote_region"], arr["remote_offset"], arr["length"], "remote")
    return arr


def make_ops(local_region: ArrayLike, local_offset: ArrayLike, remote_region: ArrayLike, remote_offset: ArrayLike,
             length: ArrayLike) -> np.ndarray:
    """Build an :data:`OP_DTYPE` array from scalars or arrays (broadcast)."""
    cols = np.broadcast_arrays(*(np.asarray(x) for x in
                                 (local_region, local_offset, remote_region, remote_offset, length)))
    out = np.empty(cols[0].size, dtype=OP_DTYPE)
    for name, col in zip(OP_FIELDS, cols):
        out[name] = col.reshape(-1)
    return out


def coalesce_ops(ops: np.ndarray, *, sort: bool = True) -> np.ndarray:
    """Merge ops that continue each other on both sides into one op (vectorised).

    With ``sort`` the batch is first ordered by (remote region, remote offset, local region,
    local offset): ops of a batch are unordered, and block tables that are runs on both
    sides then merge into a few large ops. Zero-length ops are dropped.
    """
    ops = ops[ops["length"] > 0]
    if len(ops) < 2:
        return np.ascontiguousarray(ops)
    if sort:
        order = np.lexsort((ops["local_offset"], ops["local_region"], ops["remote_offset"], ops["remote_region"]))
        ops = ops[order]
    lr, lo, rr, ro, ln = (ops[n] for n in ("local_region", "local_offset", "remote_region", "remote_offset", "length"))
    cont = ((lr[1:] == lr[:-1]) & (rr[1:] == rr[:-1])
            & (lo[:-1] + ln[:-1] == lo[1:]) & (ro[:-1] + ln[:-1] == ro[1:]))
    if not cont.any():
        return np.ascontiguousarray(ops)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = ops[starts].copy()
    out["length"] = np.add.reduceat(ln, starts)
    return out


def split_ops(ops: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split ``ops`` into at most ``parts`` consecutive slices of about equal bytes."""
    if parts <= 1 or len(ops) < 2:
        return [ops]
    ends = np.cumsum(ops["length"], dtype=np.uint64)
    total = int(ends[-1])
    cuts = np.searchsorted(ends, [total * k // parts for k in range(1, parts)], side="left") + 1
    cuts = np.unique(np.clip(cuts, 1, len(ops) - 1))
    return [p for p in np.split(ops, cuts) if len(p)]


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int], src_units: int, dst_units: int, max_blocks: int) -> Optional[list]:
    """A small transfer's block pairs as runs ``[src start, dst start, count]`` of blocks consecutive on
    both sides, in the caller's order (as the engine's ``PreparedPlan.ops`` merges them), in plain Python
    (a channel's one-call path); None when a one-call path does not take them: not 1 to ``max_blocks``
    pairs, a block that is not an exact int in range (no ``bool``, no numpy int), or a destination
    block twice (the ops path decides which pair wins)."""
    n = len(dst_blocks)
    if not 0 < n <= max_blocks or len(src_blocks) != n:
        return None
    for b in src_blocks:
        if type(b) is not int or not 0 <= b < src_units:
            return None
    for b in dst_blocks:
        if type(b) is not int or not 0 <= b < dst_units:
            return None
    if n == 1:
        return [[src_blocks[0], dst_blocks[0], 1]]
    if len(set(dst_blocks)) != n:
        return None
    runs: list[list[int]] = []
    ps = pd = -2
    for a, b in zip(src_blocks, dst_blocks):
        if a == ps + 1 and b == pd + 1:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
        ps, pd = a, b
    return runs
