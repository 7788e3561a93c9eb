"""The conformance suite's shared pieces (:mod:`llmdd.testing._conformance`): the callables a
suite is given, a side of a pair with its numpy-backed regions, opening and closing a pair, and
running a batch through the seam's one refusal path."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Iterator, Union

import numpy as np

from llmdd._seam.abc import Channel, Completion, Endpoint, MemRegion, RegionDescriptor
from llmdd._seam.errors import Refused
from llmdd._seam.ops import OP_FIELDS, make_ops
from llmdd._base.enums import Placement
from llmdd._base.status import TransportError

__all__ = ["MakePair", "Stall", "MakeTransport"]

MakePair = Callable[[], "tuple[Any, Any]"]
Stall = Callable[[Any], ContextManager[None]]
MakeTransport = Callable[[], Any]

_SENTINEL = 0xA5
_TIMEOUT = 20.0


class _Side:
    """One endpoint with a few numpy-backed regions."""

    def __init__(self, ep: Endpoint, seed: int) -> None:
        self.ep = ep
        self.rng = np.random.default_rng(seed)
        self.bufs: dict[int, np.ndarray] = {}
        self.descs: dict[int, RegionDescriptor] = {}

    def region(self, rid: int, size: int, *, remote: bool = True, fill: Union[str, int] = "random") -> np.ndarray:
        buf = np.empty(size, dtype=np.uint8)
        if fill == "random":
            buf[:] = self.rng.integers(0, 256, size, dtype=np.uint8)
        else:
            buf[:] = fill
        self.bufs[rid] = buf
        self.descs[rid] = self.ep.register(MemRegion(region_id=rid, addr=buf.ctypes.data, size=size,
                                                     remote_accessible=remote, placement=int(Placement.HOST)))
        return buf


@contextlib.contextmanager
def _pair(make_pair: MakePair, *, connect: bool = True) -> Iterator[tuple[_Side, _Side, Any]]:
    a, b = make_pair()
    sa, sb = _Side(a, 1), _Side(b, 2)
    ch = None
    try:
        if connect:
            ch = a.connect(b.describe(), timeout=_TIMEOUT)
        yield sa, sb, ch
    finally:
        if ch is not None:
            ch.close()
        a.close()
        b.close()


def _learn(ch: Channel, side: _Side, rid: int, size: Union[int, None] = None) -> None:
    ch.add_remote_region(rid, len(side.bufs[rid]) if size is None else size, side.descs[rid])


def _submit(fn: Callable[..., Completion], ops: np.ndarray, deadline: float) -> Completion:
    """Submit a batch.  The seam's one refusal path: read()/write() never raise a TransportError, every
    failure (a refusal, a closed channel, a past deadline) is the returned completion's error."""
    try:
        c = fn(ops, deadline=deadline)
    except TransportError as exc:
        raise AssertionError(f"{getattr(fn, '__name__', 'submit')}() raised {exc!r}: the seam reports every "
                             "refusal and failure through the returned completion") from None
    assert isinstance(c, Completion), f"{getattr(fn, '__name__', 'submit')}() returned {c!r}, not a Completion"
    return c


def _run(fn: Callable[..., Completion], ops: np.ndarray, timeout: float = 5.0) -> Union[TransportError, None]:
    """Submit, wait, return the completion's error."""
    c = _submit(fn, ops, time.monotonic() + timeout)
    assert c.wait(timeout + 5.0), "completion did not finish after its deadline"
    assert c.done()
    return c.error


def _ok(fn: Callable[..., Completion], ops: np.ndarray, timeout: float = _TIMEOUT) -> None:
    err = _run(fn, ops, timeout)
    assert err is None, f"batch failed: {err!r}"


def _disjoint_ops(rng: np.random.Generator, n: int, block: int, lr: int, rr: int, lsize: int,
                  rsize: int, *, vary: bool = False) -> np.ndarray:
    """``n`` ops of up to ``block`` bytes at distinct block slots on both sides (random tables)."""
    lslots = rng.permutation(lsize // block)[:n]
    rslots = rng.permutation(rsize // block)[:n]
    lengths = rng.integers(1, block + 1, n) if vary else np.full(n, block)
    return make_ops(lr, lslots * block, rr, rslots * block, lengths)


def _expect_copied(ops: np.ndarray, dst: dict, src: dict, *, read: bool) -> None:
    for op in ops:  # checks are not the hot path
        lr, lo, rr, ro, ln = (int(op[n]) for n in OP_FIELDS)
        d, s = (dst[lr][lo:lo + ln], src[rr][ro:ro + ln]) if read else (dst[rr][ro:ro + ln], src[lr][lo:lo + ln])
        assert np.array_equal(d, s), f"op {op} moved wrong bytes"




def _refused(fn: Callable[[], Any], what: str) -> None:
    try:
        got = fn()
    except Refused:
        return
    except TransportError as exc:
        raise AssertionError(f"{what}: expected Refused, got {exc!r}") from None
    close = getattr(got, "close", None)
    if close is not None:
        close()
    raise AssertionError(f"{what} was accepted")
