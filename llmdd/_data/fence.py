"""Block fences: a pull that reports success never carries bytes of blocks the owner gave back.

The owner keeps a *generation* per (registered blocks cache, block), and a random *epoch* per
registration.  Before it hands blocks back to their user for reuse (a lease that expired, an
aborted request, a read that was acknowledged), the owner *fences* them
(:meth:`FenceTable.fence`: their generations go up by one).  A puller that names the generations it
expects (:class:`BlockFence`, built by the owner with :meth:`FenceTable.expect` and carried to the
puller by the application) makes its pull *fenced*: the transport copies as for any pull, and then,
before the pull may report success, one control round trip (:data:`~llmdd._protocol.port.RequestOp.FENCE_CHECK`)
asks the owner whether those blocks still have the expected generations.  The owner fences before
any reuse and answers under the same lock, so a copy that completed before a successful check read
the blocks before they were handed back: valid bytes.  A check that fails ends the pull with
``LLM_KV_CACHE_NOT_EXIST`` (the blocks the pull named no longer hold what it expected); the bytes
already copied into the caller's blocks are then not to be used.  The same holds for every
transport (shm, tcp, ucx, any plugin): the check needs nothing of the transport, only that its
completion means the copy is done (the seam's contract).

Costs: nothing on an unfenced pull (the engine's one ``is None`` test); a fenced pull pays one
round trip after its copy, the owner a lock and a vectorized compare of the named blocks.

Every number of a peer's check is bounded before work: the cache must be one this engine serves
that peer; at most :data:`MAX_FENCE_SPANS` spans, sorted, disjoint and inside the cache's blocks
(so the compared blocks are at most the cache's); generations and the epoch are 63-bit.
"""

from __future__ import annotations

import secrets
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import attrs

from llmdd._base.lazy import np
from llmdd._base.status import LLMException, LLMStatusCode, code_2_status
from llmdd._data.peer_input import PeerInputError, peer_bounds, peer_int
from llmdd._protocol.port import ControlPort, LinkView, RequestOp

if TYPE_CHECKING:
    from llmdd._memory.manager import CacheRecord, MemoryManager

__all__ = ["BlockFence", "FenceTable", "FencedPulls", "MAX_FENCE_SPANS", "FENCE_FAILED", "GEN_MAX"]

S = LLMStatusCode

#: the most spans one fence check may name (sorted disjoint runs of blocks of equal generation)
MAX_FENCE_SPANS = 1 << 16
#: generations and epochs are non-negative 63-bit integers (JSON-able, msgpack ints)
GEN_MAX = (1 << 63) - 1
#: the status of a fenced pull whose blocks were fenced (handed back) before its check
FENCE_FAILED = S.LLM_KV_CACHE_NOT_EXIST


def _generations(value: "Iterable[int]") -> "tuple[int, ...]":
    return tuple(value)


@attrs.frozen
class BlockFence:
    """What a fenced pull expects of the owner's blocks (llmdd extension): the epoch of the owner's
    registration of the cache and, for each source block of the pull in the pull's order, its
    generation.  Built on the owner by ``CacheManager.block_fence``; plain integers, so an
    application may carry it in its own messages (``as_dict`` / ``from_dict``)."""

    epoch: int
    generations: "tuple[int, ...]" = attrs.field(converter=_generations)

    def __attrs_post_init__(self) -> None:
        for name, value in (("epoch", self.epoch), *(("generations", g) for g in self.generations)):
            if type(value) is not int or not 0 <= value <= GEN_MAX:
                raise ValueError(f"BlockFence {name} must be an integer in [0, 2**63), got {value!r}")

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "generations": list(self.generations)}

    @classmethod
    def from_dict(cls, value: Any) -> "BlockFence":
        if not isinstance(value, dict) or not isinstance(value.get("generations"), (list, tuple)):
            raise ValueError("a BlockFence dict needs 'epoch' and a list 'generations'")
        epoch = value.get("epoch")
        if type(epoch) is not int:
            raise ValueError(f"BlockFence epoch must be an integer, got {epoch!r}")
        return cls(epoch=epoch, generations=value["generations"])


class _Gens:
    """One registration's fence state: the record it belongs to, its epoch, one generation per block."""

    __slots__ = ("rec", "epoch", "gens")

    def __init__(self, rec: "CacheRecord") -> None:
        self.rec = rec
        self.epoch = secrets.randbits(62) + 1
        self.gens = np.zeros(rec.rows, dtype=np.int64)


class FenceTable:
    """The owner's generations (llmdd._data.owner serves the checks).  Lock: ``_lock``, a leaf."""

    def __init__(self, memory: "MemoryManager") -> None:
        self._memory = memory
        self._lock = threading.Lock()
        self._tables: dict[int, _Gens] = {}

    def _entry(self, rec: "CacheRecord") -> _Gens:
        """(under ``_lock``) the state of ``rec``'s registration, made on first use; entries of
        released caches are dropped then."""
        entry = self._tables.get(rec.cache_id)
        if entry is None or entry.rec is not rec:
            for cid in [c for c, e in self._tables.items() if not e.rec.live]:
                del self._tables[cid]
            entry = self._tables[rec.cache_id] = _Gens(rec)
        return entry

    @staticmethod
    def _blocks(rec: "CacheRecord", blocks: Sequence[int]) -> "np.ndarray":
        if not rec.is_blocks:
            raise LLMException(f"cache {rec.cache_id} is not a blocks cache: only blocks are fenced",
                               status_code=S.LLM_PARAM_INVALID)
        arr = np.asarray(list(blocks), dtype=np.int64)
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= rec.rows):
            raise LLMException(f"blocks outside [0, {rec.rows}) of cache {rec.cache_id}",
                               status_code=S.LLM_PARAM_INVALID)
        return arr

    def fence(self, rec: "CacheRecord", blocks: Sequence[int]) -> None:
        """Bump the generation of ``blocks`` (each once, duplicates counted once): a fenced pull that
        expects an older generation fails its check from now on."""
        arr = np.unique(self._blocks(rec, blocks))
        with self._lock:
            self._entry(rec).gens[arr] += 1

    def expect(self, rec: "CacheRecord", blocks: Sequence[int]) -> BlockFence:
        """What a pull of ``blocks`` (in this order) must find at its check."""
        arr = self._blocks(rec, blocks)
        with self._lock:
            entry = self._entry(rec)
            return BlockFence(epoch=entry.epoch, generations=tuple(entry.gens[arr].tolist()))

    def serve_check(self, link: LinkView, args: Any, rec: Optional["CacheRecord"]) -> tuple[int, dict]:
        """A puller's check (``RequestOp.FENCE_CHECK``): ``(0, {})`` when every named block still has
        the expected generation, ``(FENCE_FAILED, {"error": ...})`` otherwise (or when the cache,
        ``rec`` None, is gone).  The arguments are bounded first (a violation raises PeerInputError)."""
        if not isinstance(args, dict):
            raise PeerInputError("fence_check arguments must be a map")
        epoch = peer_int(args.get("epoch"), "fence_check epoch", 0, GEN_MAX)
        gens = args.get("gens")
        if not isinstance(gens, (list, tuple)) or len(gens) > MAX_FENCE_SPANS:
            raise PeerInputError(f"fence_check gens must be a list of at most {MAX_FENCE_SPANS} generations")
        if rec is None or not rec.live:
            return FENCE_FAILED.value, {"error": "the cache was released"}
        if not rec.is_blocks:
            raise PeerInputError(f"fence_check: cache {rec.cache_id} is not a blocks cache")
        spans = peer_bounds(args.get("bounds"), "fence_check blocks", rec.rows, max_spans=MAX_FENCE_SPANS)
        if len(spans) != len(gens):
            raise PeerInputError(f"fence_check: {len(spans)} spans for {len(gens)} generations")
        last = 0
        for start, stop in spans:      # sorted and disjoint: the compared blocks are at most the cache's
            if start < last or start >= stop:
                raise PeerInputError("fence_check spans must be non-empty, sorted and disjoint")
            last = stop
        want = [peer_int(g, "fence_check generation", 0, GEN_MAX) for g in gens]
        with self._lock:
            entry = self._tables.get(rec.cache_id)
            if entry is None or entry.rec is not rec or entry.epoch != epoch:
                return FENCE_FAILED.value, {"error": "another registration of the cache (epoch differs)"}
            g = entry.gens
            for (start, stop), w in zip(spans, want):
                if stop - start == 1:
                    ok = int(g[start]) == w
                else:
                    ok = bool((g[start:stop] == w).all())
                if not ok:
                    return FENCE_FAILED.value, {"error": f"blocks [{start}, {stop}) were fenced"}
        return 0, {}


def check_args(cache_id: int, src_blocks: Optional[Sequence[int]], fence: BlockFence, *, blocks: bool = True) -> dict:
    """The FENCE_CHECK request of a pull of ``src_blocks`` (of a blocks cache: ``blocks``) expecting
    ``fence``: sorted disjoint runs of consecutive blocks of one generation (a block named twice must
    expect one generation)."""
    if not blocks or not src_blocks:
        raise LLMException("a fenced pull reads blocks of a blocks cache (src_blocks)", status_code=S.LLM_PARAM_INVALID)
    if len(fence.generations) != len(src_blocks):
        raise LLMException(f"the fence names {len(fence.generations)} generations for {len(src_blocks)} source "
                           "blocks", status_code=S.LLM_PARAM_INVALID)
    want: dict[int, int] = {}
    for b, g in zip(src_blocks, fence.generations):
        if want.setdefault(int(b), g) != g:
            raise LLMException(f"the fence expects two generations of block {b}", status_code=S.LLM_PARAM_INVALID)
    bounds: list = []
    gens: list = []
    for b in sorted(want):
        g = want[b]
        if bounds and bounds[-1] == b and gens[-1] == g:
            bounds[-1] = b + 1
        else:
            bounds += [b, b + 1]
            gens.append(g)
    if len(gens) > MAX_FENCE_SPANS:
        raise LLMException(f"the fence needs {len(gens)} spans (at most {MAX_FENCE_SPANS})",
                           status_code=S.LLM_PARAM_INVALID)
    return {"cache_id": int(cache_id), "epoch": fence.epoch, "bounds": bounds, "gens": gens}


class FencedPulls:
    """The puller's side: the check of a fenced pull after its copy (the engine's hook point), and a
    reader's notes to the owner."""

    def __init__(self, port: ControlPort, timeout_s: float, *, clock: Callable[[], float]) -> None:
        self._lm = port
        self.timeout_s = timeout_s
        self._clock = clock     # the runtime's monotonic clock (simulated time under llmdd.testing.sim)

    def failure(self, link: LinkView, args: dict) -> Optional[LLMException]:
        """:meth:`verify`'s outcome as a value: None when the check passed, else its error."""
        try:
            self.verify(link, args)
        except LLMException as exc:
            return exc
        return None

    def verify(self, link: LinkView, args: dict) -> None:
        """Ask the owner whether the pulled blocks still have the expected generations (``args``:
        :func:`check_args`); raises ``FENCE_FAILED`` when not, the request's error (``LLM_TIMEOUT``,
        ``LLM_LINK_FAILED``) when the owner does not answer: no success without a passed check."""
        status, result = self._lm.request(link, RequestOp.FENCE_CHECK, args,
                                          deadline=self._clock() + self.timeout_s)
        if status != 0:
            why = result.get("error") if isinstance(result, dict) else None
            raise LLMException(f"fenced pull from cluster {link.peer_cluster_id}: the owner handed the blocks back "
                               f"before the pull's check ({why or status}); the bytes read are not valid",
                               status_code=FENCE_FAILED)

    def notify(self, link: LinkView, cache_id: int, notes: list) -> None:
        """Deliver ``notes`` to the owner's ``peer_note`` event on its cache ``cache_id`` (RequestOp.PEER_NOTE:
        how a reader renews or gives up what the owner holds for it, llmdd_vllm's leases); returns once
        the owner handled them, raises the owner's status otherwise."""
        status, result = self._lm.request(link, RequestOp.PEER_NOTE, {"cache_id": int(cache_id), "notes": list(notes)},
                                          deadline=self._clock() + self.timeout_s)
        if status != 0:
            why = result.get("error") if isinstance(result, dict) else None
            raise LLMException(f"cluster {link.peer_cluster_id} refused the notes on cache {cache_id}: {why or status}",
                               status_code=code_2_status(status))
