"""The transfer planner: block lists, batch indices, sizes and layer ranges -> coalesced ops.

Theory of operation
-------------------
A cache is ``num_tensors`` tensors of ``tensor_size`` bytes each; every tensor is one
registered region whose offset 0 is the tensor's first byte (:class:`CacheLayout`). The
tensor is cut into ``units`` equal units of ``unit_size = tensor_size // units`` bytes:
blocks for a blocks cache (``shape[0]`` = num_blocks) or batch slots for a non-blocks cache
(``shape[0]`` = batch_size), as upstream's C++ engine defines its stride.

Every planning function validates all of its arguments first (tensor ranges, unit indices,
sizes, block indices on both sides) and raises :class:`~llmdd._base.status.LocalUsageError`
(an ``LLMException`` with ``LLM_PARAM_INVALID``) before returning anything; an op array that
is returned never touches a byte outside ``[0, tensor_size)`` of a tensor's region on either
side (or outside ``[0, region_size)`` of a raw destination region).

The result is a numpy array of :data:`~llmdd._seam.ops.OP_DTYPE`. The ``local_*`` fields describe
the side that runs the transfer (``local="dst"`` for a pull, ``local="src"`` for a push), the
``remote_*`` fields the peer. Ops are ordered tensor by tensor, then in block-list order.

No Python object is made per block: block lists become one ``int64`` array each
(``np.asarray`` once), runs where both sides advance by one block are found with ``np.diff``
and become one op, and the ``tensors x runs`` op grid is filled by broadcasting. A pull of
256 blocks consecutive on both sides is therefore one op per tensor.
"""

from __future__ import annotations

import operator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence, Union

if TYPE_CHECKING:
    import numpy

import attrs

from llmdd._seam import ops as _ops
from llmdd._base.lazy import np, when_numpy_loaded
from llmdd._base.status import LLMStatusCode, LocalUsageError

__all__ = [
    "CacheLayout",
    "BlockList",
    "tensor_range",
    "block_array",
    "plan_cache",
    "plan_blocks",
    "plan_contiguous_to_blocks",
    "plan_to_addresses",
    "total_bytes",
    "count_runs",
]

#: A block list as the API accepts it: a list/tuple of ``int`` or a 1-d numpy integer array.
BlockList = Union[Sequence[int], "np.ndarray"]

OP_DTYPE: numpy.dtype   # llmdd._seam.ops.OP_DTYPE, once numpy is in use (llmdd._base.lazy)


@when_numpy_loaded
def _numpy_loaded(numpy: ModuleType) -> None:
    global OP_DTYPE
    OP_DTYPE = _ops.OP_DTYPE

_U32 = 2**32
_I63 = 2**63


def _invalid(msg: str) -> LocalUsageError:
    return LocalUsageError(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _int(value: Any, name: str) -> int:
    """``value`` as a Python int (numpy integers accepted, bool and float refused)."""
    if isinstance(value, (bool, np.bool_)):
        raise _invalid(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise _invalid(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


# --------------------------------------------------------------------------- layout


def _region_ids(value: Any) -> tuple:
    return tuple(value)


@attrs.frozen
class CacheLayout:
    """How one cache lies in registered memory, as far as moving bytes is concerned.

    ``region_ids[t]`` is the region holding tensor ``t`` (region offset 0 = the tensor's
    first byte); ``tensor_size`` the bytes of one tensor; ``units`` the number of blocks
    (blocks cache) or batch slots (non-blocks cache).
    """

    cache_id: int
    region_ids: tuple = attrs.field(converter=_region_ids)
    tensor_size: int
    units: int
    is_blocks: bool
    _regions: np.ndarray = attrs.field(init=False, eq=False, repr=False, hash=False)

    def as_kind(self, blocks: bool) -> "CacheLayout":
        """This layout planned as a blocks (``blocks`` True) or non-blocks cache: the same geometry
        (units are blocks or batch slots alike), the other kind when it differs (the C++ API's caches
        are of upstream's "mix" kind, usable by cache and by block transfers)."""
        return self if self.is_blocks == blocks else attrs.evolve(self, is_blocks=blocks)

    def __attrs_post_init__(self) -> None:
        cid = _int(self.cache_id, "cache_id")
        size = _int(self.tensor_size, "tensor_size")
        units = _int(self.units, "units")
        ids = tuple(_int(r, "region id") for r in self.region_ids)
        if not ids:
            raise _invalid(f"cache {cid}: a layout needs at least one tensor region")
        if any(not 0 <= r < _U32 for r in ids):
            raise _invalid(f"cache {cid}: region ids must be in [0, 2**32), got {ids}")
        if not 0 <= size < _I63:
            raise _invalid(f"cache {cid}: tensor_size must be in [0, 2**63), got {size}")
        if units < 1:
            raise _invalid(f"cache {cid}: units (num_blocks / batch_size) must be >= 1, got {units}")
        if size % units:
            raise _invalid(f"cache {cid}: tensor_size {size} is not a multiple of units {units}")
        if not isinstance(self.is_blocks, (bool, np.bool_)):
            raise _invalid(f"cache {cid}: is_blocks must be a bool, got {self.is_blocks!r}")
        object.__setattr__(self, "cache_id", cid)
        object.__setattr__(self, "tensor_size", size)
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "is_blocks", bool(self.is_blocks))
        object.__setattr__(self, "region_ids", ids)
        regions = np.asarray(ids, dtype=np.uint32)
        regions.setflags(write=False)
        object.__setattr__(self, "_regions", regions)

    @property
    def unit_size(self) -> int:
        """Bytes of one block (blocks cache) or one batch slot (non-blocks cache): the stride."""
        return self.tensor_size // self.units

    @property
    def num_tensors(self) -> int:
        return len(self.region_ids)

    @property
    def kind(self) -> str:
        return "blocks cache" if self.is_blocks else "cache"

    def regions(self, tensors: range) -> np.ndarray:
        """The region ids of ``tensors`` as a read-only ``uint32`` array (a view, no copy)."""
        return self._regions[tensors.start:tensors.stop]


# --------------------------------------------------------------------------- argument checks


def tensor_range(layer_range: Union[range, None], num_tensors: int, tnpl: int = 2) -> range:
    """Tensor indices ``[start*tnpl, (start+len)*tnpl)`` of a layer range; ``None`` -> all tensors.

    Raises ``LLM_PARAM_INVALID`` for a step other than 1, an empty or negative range, a
    ``num_tensors`` that is not a multiple of ``tnpl`` (when a layer range is given), or
    layers past the cache's last layer.
    """
    num_tensors = _int(num_tensors, "num_tensors")
    tnpl = _int(tnpl, "tensor_num_per_layer")
    if num_tensors < 1:
        raise _invalid(f"num_tensors must be >= 1, got {num_tensors}")
    if tnpl < 1:
        raise _invalid(f"tensor_num_per_layer must be > 0, got {tnpl}")
    if layer_range is None:
        return range(num_tensors)
    if not isinstance(layer_range, range):
        raise _invalid(f"layer range must be a range or None, got {type(layer_range).__name__}")
    if layer_range.step != 1:
        raise _invalid(f"layer range {layer_range} must have step 1")
    if not 0 <= layer_range.start < layer_range.stop:
        raise _invalid(f"layer range {layer_range} must satisfy 0 <= start < stop")
    if num_tensors % tnpl:
        raise _invalid(f"num_tensors {num_tensors} is not a multiple of tensor_num_per_layer {tnpl}")
    num_layers = num_tensors // tnpl
    if layer_range.stop > num_layers:
        raise _invalid(f"layer range {layer_range} exceeds the cache's {num_layers} layers "
                       f"({num_tensors} tensors, {tnpl} per layer)")
    return range(layer_range.start * tnpl, layer_range.stop * tnpl)


def _check_tensors(tensors: Any, layout: CacheLayout, name: str) -> range:
    if not isinstance(tensors, range):
        raise _invalid(f"{name} must be a range of tensor indices, got {type(tensors).__name__}")
    if tensors.step != 1:
        raise _invalid(f"{name} {tensors} must have step 1")
    if not 0 <= tensors.start < tensors.stop <= layout.num_tensors:
        raise _invalid(f"{name} {tensors} must be non-empty and inside [0, {layout.num_tensors}) "
                       f"(tensors of cache {layout.cache_id})")
    return tensors


def _check_pair(src: CacheLayout, dst: CacheLayout, src_tensors: Any, dst_tensors: Any) -> tuple:
    if not isinstance(src, CacheLayout) or not isinstance(dst, CacheLayout):
        raise _invalid("src and dst must be CacheLayout values")
    st = _check_tensors(src_tensors, src, "src tensor range")
    dt = _check_tensors(dst_tensors, dst, "dst tensor range")
    if len(st) != len(dt):
        raise _invalid(f"src and dst tensor ranges differ in length: {st} ({len(st)} tensors) "
                       f"vs {dt} ({len(dt)} tensors)")
    return st, dt


def _check_local(local: Any) -> str:
    if local not in ("src", "dst"):
        raise _invalid(f"local must be 'src' (push) or 'dst' (pull), got {local!r}")
    return local


def _check_unit(unit: Any, layout: CacheLayout, name: str) -> int:
    unit = _int(unit, name)
    if not 0 <= unit < layout.units:
        what = "block" if layout.is_blocks else "batch index"
        raise _invalid(f"{name} {unit} out of range: {what} must be in [0, {layout.units}) "
                       f"for cache {layout.cache_id}")
    return unit


def _check_kind(layout: CacheLayout, blocks: bool, side: str) -> None:
    if layout.is_blocks != blocks:
        want = "a blocks cache" if blocks else "a non-blocks cache"
        raise _invalid(f"{side} cache {layout.cache_id} must be {want}, it is a {layout.kind}")


def block_array(blocks: BlockList, name: str, limit: Union[int, None] = None) -> np.ndarray:
    """A validated, non-empty 1-d ``int64`` array of block indices in ``[0, limit)``.

    ``blocks`` is a list/tuple of ints or a numpy integer array (converted once, no per-item
    Python work). ``limit`` ``None`` only checks ``>= 0``. Raises ``LLM_PARAM_INVALID``.
    """
    if isinstance(blocks, np.ndarray):
        arr = blocks
    elif isinstance(blocks, (list, tuple, range)):
        if not len(blocks):
            raise _invalid(f"{name} must not be empty")
        try:
            arr = np.asarray(blocks)
        except (ValueError, TypeError, OverflowError) as exc:
            raise _invalid(f"{name} must be a flat list of ints: {exc}") from None
    else:
        raise _invalid(f"{name} must be a list or tuple of ints, got {type(blocks).__name__}")
    if arr.ndim != 1:
        raise _invalid(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise _invalid(f"{name} must not be empty")
    if arr.dtype.kind not in "iu":
        raise _invalid(f"{name} must contain ints only (got dtype {arr.dtype})")
    lo = arr.min()
    hi = arr.max()
    if lo < 0 or (limit is not None and hi >= limit):
        bad = arr < 0 if lo < 0 else arr >= limit
        i = int(np.argmax(bad))
        rng = f"[0, {limit})" if limit is not None else ">= 0"
        raise _invalid(f"{name}[{i}] = {int(arr[i])} is out of range {rng}")
    if hi >= _I63:
        raise _invalid(f"{name} holds an index >= 2**63")
    return arr.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- op building


def last_pair_wins(src_idx: np.ndarray, dst_idx: np.ndarray) -> tuple:
    """The (src, dst) pairs without a repeated destination: where a destination block is listed more
    than once, only its last pair is kept (in the callers' order).

    Upstream (hicann/hixl) accepts repeated destination blocks in pull/push of blocks and copies the
    runs in list order, so the last listed source is what the block holds.  llmdd keeps that
    outcome but makes it certain: its ops run on several streams at once, so two writes of one block
    could otherwise race; dropping the earlier pairs before planning leaves one writer per block."""
    if len(dst_idx) < 2:
        return src_idx, dst_idx
    _, first_in_reversed = np.unique(dst_idx[::-1], return_index=True)
    if len(first_in_reversed) == len(dst_idx):
        return src_idx, dst_idx
    keep = np.sort(len(dst_idx) - 1 - first_in_reversed)
    return src_idx[keep], dst_idx[keep]


def _runs(src_idx: np.ndarray, dst_idx: np.ndarray) -> tuple:
    """Maximal runs in which both index arrays advance by exactly one: (src starts, dst starts, counts)."""
    n = len(src_idx)
    if n == 1:
        return src_idx, dst_idx, np.ones(1, dtype=np.int64)
    brk = (np.diff(src_idx) != 1) | (np.diff(dst_idx) != 1)
    if not brk.any():
        return src_idx[:1], dst_idx[:1], np.array([n], dtype=np.int64)
    starts = np.flatnonzero(brk)
    starts += 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), starts))
    counts = np.diff(np.append(starts, n))
    return src_idx[starts], dst_idx[starts], counts


def _emit(src_regions: np.ndarray, dst_regions: np.ndarray, src_off: Any, dst_off: Any, length: Any,
          local: str) -> np.ndarray:
    """Fill the ``tensors x runs`` op grid by broadcasting and return it flattened.

    ``*_regions`` have one entry per tensor (shape ``(T,)``); ``src_off``, ``dst_off`` and
    ``length`` are scalars, per-run ``(R,)`` arrays or per-tensor-and-run ``(T, R)`` arrays.
    """
    rows = len(src_regions)
    cols = max(np.size(x) if np.ndim(x) < 2 else np.shape(x)[1] for x in (src_off, dst_off, length))
    out = np.empty((rows, cols), dtype=OP_DTYPE)
    if local == "dst":
        out["local_region"] = dst_regions[:, None]
        out["local_offset"] = dst_off
        out["remote_region"] = src_regions[:, None]
        out["remote_offset"] = src_off
    else:
        out["local_region"] = src_regions[:, None]
        out["local_offset"] = src_off
        out["remote_region"] = dst_regions[:, None]
        out["remote_offset"] = dst_off
    out["length"] = length
    return out.reshape(-1)


# --------------------------------------------------------------------------- planners


def plan_cache(*, src: CacheLayout, dst: CacheLayout, src_tensors: range, dst_tensors: range,
               src_unit: int, dst_unit: int, size: int = -1, local: str) -> np.ndarray:
    """Cache to cache (``pull_cache`` / ``push_cache``): one op per tensor.

    Copies ``size`` bytes from the start of batch slot ``src_unit`` of each src tensor to the
    start of batch slot ``dst_unit`` of the matching dst tensor. ``size == -1`` copies the
    whole src slot (``src.unit_size``), which must fit into a dst slot; an explicit ``size``
    must be ``> 0`` and ``<=`` both slot sizes.
    """
    local = _check_local(local)
    st, dt = _check_pair(src, dst, src_tensors, dst_tensors)
    _check_kind(src, False, "src")
    _check_kind(dst, False, "dst")
    su = _check_unit(src_unit, src, "src batch index")
    du = _check_unit(dst_unit, dst, "dst batch index")
    size = _int(size, "size")
    if size == -1:
        size = src.unit_size
        if size > dst.unit_size:
            raise _invalid(f"size -1 copies a whole src batch slot of {size} bytes, more than a dst "
                           f"batch slot ({dst.unit_size} bytes); pass an explicit size")
    elif size <= 0:
        raise _invalid(f"size must be -1 or > 0, got {size}")
    elif size > src.unit_size or size > dst.unit_size:
        raise _invalid(f"size {size} exceeds a batch slot: src {src.unit_size} bytes, "
                       f"dst {dst.unit_size} bytes")
    if size == 0:
        raise _invalid(f"nothing to copy: batch slots of cache {src.cache_id} are empty")
    return _emit(src.regions(st), dst.regions(dt), su * src.unit_size, du * dst.unit_size, size, local)


def plan_blocks(*, src: CacheLayout, dst: CacheLayout, src_blocks: BlockList, dst_blocks: BlockList,
                src_tensors: range, dst_tensors: range, local: str) -> np.ndarray:
    """Blocks to blocks (``pull_blocks`` / ``push_blocks``): block ``src_blocks[i]`` of each src
    tensor goes to block ``dst_blocks[i]`` of the matching dst tensor.

    Both lists are non-empty, of equal length, with indices in ``[0, units)`` of their side;
    both caches have the same block size. Runs consecutive on both sides become one op.
    """
    local = _check_local(local)
    st, dt = _check_pair(src, dst, src_tensors, dst_tensors)
    _check_kind(src, True, "src")
    _check_kind(dst, True, "dst")
    if src.unit_size != dst.unit_size:
        raise _invalid(f"block sizes differ: src cache {src.cache_id} has {src.unit_size}-byte blocks, "
                       f"dst cache {dst.cache_id} has {dst.unit_size}-byte blocks")
    if src.unit_size == 0:
        raise _invalid(f"nothing to copy: blocks of cache {src.cache_id} are empty")
    few = _plan_blocks_few(src, dst, src_blocks, dst_blocks, st, dt, local)
    if few is not None:
        return few
    s = block_array(src_blocks, "src_blocks", src.units)
    d = block_array(dst_blocks, "dst_blocks", dst.units)
    if len(s) != len(d):
        raise _invalid(f"src_blocks and dst_blocks differ in length: {len(s)} vs {len(d)}")
    s, d = last_pair_wins(s, d)
    bs = src.unit_size
    s0, d0, counts = _runs(s, d)
    return _emit(src.regions(st), dst.regions(dt), s0 * bs, d0 * bs, counts * bs, local)


#: block lists up to this length (and op grids up to _FEW_OPS) are planned with plain Python ints
_FEW_BLOCKS = 16
_FEW_OPS = 64


def _plan_blocks_few(src: CacheLayout, dst: CacheLayout, src_blocks: BlockList, dst_blocks: BlockList, st: range, dt: range,
                     local: str) -> Union[np.ndarray, None]:
    """:func:`plan_blocks` for a few blocks given as lists of in-range Python ints (the latency
    path: numpy's fixed per-call costs dominate there). Returns None for anything else (other
    types, out-of-range or unequal lists), which the numpy path then plans or refuses with its
    usual message; the ops are identical to the numpy path's."""
    if type(src_blocks) not in (list, tuple) or type(dst_blocks) not in (list, tuple):
        return None
    n = len(src_blocks)
    if not 0 < n <= _FEW_BLOCKS or len(dst_blocks) != n:
        return None
    su, du = src.units, dst.units
    for b in src_blocks:
        if type(b) is not int or not 0 <= b < su:
            return None
    for b in dst_blocks:
        if type(b) is not int or not 0 <= b < du:
            return None
    if len(set(dst_blocks)) != n:   # a destination block listed twice: the last pair wins
        pairs = [(a, b) for i, (a, b) in enumerate(zip(src_blocks, dst_blocks)) if b not in dst_blocks[i + 1:]]
    else:
        pairs = list(zip(src_blocks, dst_blocks))
    runs: list[list[int]] = []
    ps = pd = -2
    for a, b in pairs:
        if a == ps + 1 and b == pd + 1:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
        ps, pd = a, b
    if len(runs) * len(st) > _FEW_OPS:
        return None
    bs = src.unit_size
    sreg, dreg = src.region_ids, dst.region_ids
    if local == "dst":
        rows = [(dreg[t2], d0 * bs, sreg[t1], s0 * bs, c * bs)
                for t1, t2 in zip(st, dt) for s0, d0, c in runs]
    else:
        rows = [(sreg[t1], s0 * bs, dreg[t2], d0 * bs, c * bs)
                for t1, t2 in zip(st, dt) for s0, d0, c in runs]
    return np.array(rows, dtype=OP_DTYPE)


def plan_contiguous_to_blocks(*, src: CacheLayout, dst: CacheLayout, src_unit: int, dst_blocks: BlockList,
                              src_tensors: range, dst_tensors: range, local: str) -> np.ndarray:
    """Contiguous cache to blocks (``pull_blocks`` with a non-blocks key): the ``i``-th
    block-sized chunk of src batch slot ``src_unit`` goes to block ``dst_blocks[i]``.

    The chunks must fit in the slot: ``len(dst_blocks) * dst.unit_size <= src.unit_size``.
    """
    local = _check_local(local)
    st, dt = _check_pair(src, dst, src_tensors, dst_tensors)
    _check_kind(src, False, "src")
    _check_kind(dst, True, "dst")
    su = _check_unit(src_unit, src, "src batch index")
    bs = dst.unit_size
    if bs == 0:
        raise _invalid(f"nothing to copy: blocks of cache {dst.cache_id} are empty")
    d = block_array(dst_blocks, "dst_blocks", dst.units)
    if len(d) * bs > src.unit_size:
        raise _invalid(f"{len(d)} blocks of {bs} bytes ({len(d) * bs} bytes) do not fit in a src batch "
                       f"slot of {src.unit_size} bytes (cache {src.cache_id})")
    chunks, d = last_pair_wins(np.arange(len(d), dtype=np.int64), d)
    c0, d0, counts = _runs(chunks, d)
    return _emit(src.regions(st), dst.regions(dt), su * src.unit_size + c0 * bs, d0 * bs, counts * bs, local)


def _raw_dst(dst: Any, count: int) -> tuple:
    """(region ids uint32, base offsets int64, region sizes int64) of raw destinations."""
    try:
        arr = np.asarray(dst)
    except (ValueError, TypeError, OverflowError) as exc:
        raise _invalid(f"dst must be a list of (region_id, offset, region_size) triples: {exc}") from None
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.dtype.kind not in "iu":
        raise _invalid(f"dst must be a list of (region_id, offset, region_size) int triples, "
                       f"got shape {arr.shape} dtype {arr.dtype}")
    if len(arr) != count:
        raise _invalid(f"dst names {len(arr)} tensors, the src tensor range has {count}")
    if (arr < 0).any():
        raise _invalid("dst region ids, offsets and sizes must be >= 0")
    if (arr[:, 0] >= _U32).any():
        raise _invalid("dst region ids must be < 2**32")
    if (arr[:, 1:] >= _I63).any():
        raise _invalid("dst offsets and region sizes must be < 2**63")
    arr = arr.astype(np.int64, copy=False)
    return arr[:, 0].astype(np.uint32), arr[:, 1], arr[:, 2]


def plan_to_addresses(*, src: CacheLayout, src_tensors: range, dst: Any, src_unit: int = 0,
                      src_blocks: Union[BlockList, None] = None, dst_blocks: Union[BlockList, None] = None,
                      dst_block_size: Union[int, None] = None, local: str = "src") -> np.ndarray:
    """Cache to raw destination addresses (``transfer_cache_async`` with ``TransferConfig``).

    ``dst`` has one ``(region_id, offset, region_size)`` triple per tensor of ``src_tensors``:
    the caller resolved each raw destination address to the peer region holding it, the
    address's offset in that region and that region's size (checked, never overrun).

    * ``src_blocks`` and ``dst_blocks`` ``None``: cache -> cache; batch slot ``src_unit`` of each
      src tensor (``src.unit_size`` bytes) goes to ``offset`` (``dst_block_size`` None or 0).
    * both given: blocks -> blocks; block ``src_blocks[i]`` goes to
      ``offset + dst_blocks[i] * dst_block_size``; ``dst_block_size`` (None -> the src block
      size) must equal the src block size. ``src_unit`` is ignored.
    * ``dst_blocks`` only: cache -> blocks; the ``i``-th ``dst_block_size`` chunk of batch slot
      ``src_unit`` goes to ``offset + dst_blocks[i] * dst_block_size``; the chunks must fit in
      the slot and ``dst_block_size`` is required.
    * ``src_blocks`` only (blocks -> cache) is not supported upstream: ``LLM_PARAM_INVALID``.
    """
    local = _check_local(local)
    if not isinstance(src, CacheLayout):
        raise _invalid("src must be a CacheLayout")
    st = _check_tensors(src_tensors, src, "src tensor range")
    regions, base, limit = _raw_dst(dst, len(st))
    if dst_block_size is not None:
        dst_block_size = _int(dst_block_size, "dst_block_memory_size")
        if dst_block_size < 0:
            raise _invalid(f"dst_block_memory_size must be >= 0, got {dst_block_size}")
    if src_blocks is None and dst_blocks is None:
        _check_kind(src, False, "src")
        su = _check_unit(src_unit, src, "src batch index")
        if dst_block_size not in (None, 0):
            raise _invalid("dst_block_memory_size must be None or 0 for a non-blocks destination")
        size = src.unit_size
        if size == 0:
            raise _invalid(f"nothing to copy: batch slots of cache {src.cache_id} are empty")
        rel_src = np.full(1, su * size, dtype=np.int64)
        rel_dst = np.zeros(1, dtype=np.int64)
        lengths = np.full(1, size, dtype=np.int64)
        extent = size
    elif src_blocks is not None and dst_blocks is None:
        raise _invalid("transferring blocks to a non-blocks destination is not supported")
    elif src_blocks is not None:
        _check_kind(src, True, "src")
        bs = src.unit_size
        if dst_block_size is None:
            dst_block_size = bs
        if dst_block_size != bs:
            raise _invalid(f"dst_block_memory_size {dst_block_size} differs from the src block size {bs}")
        if bs == 0:
            raise _invalid(f"nothing to copy: blocks of cache {src.cache_id} are empty")
        s = block_array(src_blocks, "src_block_indices", src.units)
        d = block_array(dst_blocks, "dst_block_indices")
        if len(s) != len(d):
            raise _invalid(f"src and dst block indices differ in length: {len(s)} vs {len(d)}")
        s, d = last_pair_wins(s, d)
        s0, d0, counts = _runs(s, d)
        rel_src, rel_dst, lengths = s0 * bs, d0 * bs, counts * bs
        extent = (int(d.max()) + 1) * bs
    else:
        _check_kind(src, False, "src")
        su = _check_unit(src_unit, src, "src batch index")
        if not dst_block_size:
            raise _invalid("dst_block_memory_size is required (> 0) to transfer a cache into blocks")
        bs = dst_block_size
        d = block_array(dst_blocks, "dst_block_indices")
        if len(d) * bs > src.unit_size:
            raise _invalid(f"{len(d)} blocks of {bs} bytes ({len(d) * bs} bytes) do not fit in a src "
                           f"batch slot of {src.unit_size} bytes (cache {src.cache_id})")
        c0, d0, counts = _runs(*last_pair_wins(np.arange(len(d), dtype=np.int64), d))
        rel_src, rel_dst, lengths = su * src.unit_size + c0 * bs, d0 * bs, counts * bs
        extent = (int(d.max()) + 1) * bs
    room = limit - base
    if (room < extent).any():
        t = int(np.argmax(room < extent))
        raise _invalid(f"dst of tensor {st.start + t} (region {int(regions[t])} offset {int(base[t])}, "
                       f"region size {int(limit[t])}) has no room for {extent} bytes")
    return _emit(src.regions(st), regions, rel_src, base[:, None] + rel_dst, lengths, local)


# --------------------------------------------------------------------------- helpers


def total_bytes(ops: np.ndarray) -> int:
    """Bytes moved by ``ops``."""
    return int(np.asarray(ops)["length"].sum(dtype=np.uint64))


def count_runs(src_blocks: BlockList, dst_blocks: Union[BlockList, None] = None) -> int:
    """Number of maximal runs in which ``src_blocks`` (and ``dst_blocks``, when given) advance by one:
    the op count per tensor that :func:`plan_blocks` produces for these lists."""
    s = block_array(src_blocks, "src_blocks")
    d = s if dst_blocks is None else block_array(dst_blocks, "dst_blocks")
    if len(s) != len(d):
        raise _invalid(f"src_blocks and dst_blocks differ in length: {len(s)} vs {len(d)}")
    return len(_runs(s, d)[2])
