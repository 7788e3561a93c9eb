"""The conformance check of the seam's optional prepared path (``Channel.prepare``, issue 37)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from llmdd._base.status import TransportError
from llmdd._seam.abc import Channel, PreparedTransfer
from llmdd._seam.ops import make_ops
from llmdd.testing._conformance_kit import _SENTINEL, _TIMEOUT, MakePair, _learn, _ok, _pair

__all__ = ["check_prepared"]


def _prepared_or_none(ch: Channel, pairs: list, bs: int, su: int, du: int, push: bool) -> Optional[PreparedTransfer]:
    try:
        got = ch.prepare(pairs, bs, su, du, push, timeout_s=_TIMEOUT)
    except TransportError as exc:
        raise AssertionError(f"prepare() raised {exc!r}: a shape it cannot take is None") from None
    assert got is None or callable(got), f"prepare() returned {got!r}: a PreparedTransfer or None"
    return got


def _block_ops(pairs: list, bs: int, src_blocks: list, dst_blocks: list, push: bool) -> np.ndarray:
    """The batch path's ops of a prepared call: per tensor pair, block ``src[j]`` to block ``dst[j]``."""
    rows = []
    for lr, rr in pairs:
        for s, d in zip(src_blocks, dst_blocks):
            lo, ro = (s, d) if push else (d, s)
            rows.append((lr, lo * bs, rr, ro * bs, bs))
    arr = np.array(rows, dtype=np.int64)
    return make_ops(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4])


def check_prepared(make_pair: MakePair) -> None:
    """The prepared path (``Channel.prepare``), for a transport that offers it: a prepared pull and push
    move byte for byte what the batch path moves for the same blocks, and a prepared transfer whose
    tables went stale declines (a negative result, nothing moved): after the remote region table
    changed (a region removed, then announced again) and after a local region was deregistered, while
    a transfer prepared anew on the tables of now moves again.  A transport without a prepared path
    returns None for the shape and has nothing more to check here (the engine takes the batch path)."""
    bs, nb, n = 4096, 32, 6
    with _pair(make_pair) as (a, b, ch):
        rng = np.random.default_rng(37)
        for rid in (1, 2, 3, 4):                 # 1, 2: the prepared path's; 3, 4: the batch path's
            a.region(rid, bs * nb, fill=0)
        for rid in (10, 11, 12, 13, 14, 15):     # 10, 11: read; 12, 13 / 14, 15: written by each path
            b.region(rid, bs * nb, fill="random" if rid < 12 else 0)
            _learn(ch, b, rid)
        pull = _prepared_or_none(ch, [(1, 10), (2, 11)], bs, nb, nb, False)
        push = _prepared_or_none(ch, [(1, 12), (2, 13)], bs, nb, nb, True)
        if pull is None and push is None:
            return
        src = [int(x) for x in rng.integers(0, nb, n)]
        dst = [int(x) for x in rng.permutation(nb)[:n]]   # distinct destinations: one outcome per block
        if pull is not None:
            moved = pull(src, dst)
            assert moved == 2 * n * bs, f"a fresh prepared pull of {n} blocks x 2 tensors moved {moved}"
            _ok(ch.read, _block_ops([(3, 10), (4, 11)], bs, src, dst, False))
            assert np.array_equal(a.bufs[1], a.bufs[3]) and np.array_equal(a.bufs[2], a.bufs[4]), \
                "the prepared pull and the batch path landed different bytes"
            assert a.bufs[1].any(), "the prepared pull moved nothing"
        if push is not None:
            for rid in (1, 2):
                a.bufs[rid][:] = a.rng.integers(0, 256, bs * nb, dtype=np.uint8)
                a.bufs[rid + 2][:] = a.bufs[rid]
            moved = push(src, dst)
            assert moved == 2 * n * bs, f"a fresh prepared push of {n} blocks x 2 tensors moved {moved}"
            _ok(ch.write, _block_ops([(3, 14), (4, 15)], bs, src, dst, True))
            assert np.array_equal(b.bufs[12], b.bufs[14]) and np.array_equal(b.bufs[13], b.bufs[15]), \
                "the prepared push and the batch path landed different bytes"
            assert b.bufs[12].any(), "the prepared push moved nothing"

        def declines(fn: PreparedTransfer, what: str, dst_side: dict, rids: tuple) -> None:
            before = {rid: dst_side[rid].copy() for rid in rids}
            got = fn(src, dst)
            assert got < 0, f"a prepared transfer {what} still moved {got} bytes: it must decline"
            for rid in rids:
                assert np.array_equal(dst_side[rid], before[rid]), f"a declined transfer {what} landed bytes"

        # the remote table changed: a region removed, then announced again (a newer table)
        for rid in (10, 11):
            b.bufs[rid][:] = b.rng.integers(0, 256, bs * nb, dtype=np.uint8)
        if pull is not None:
            ch.remove_remote_region(11)
            declines(pull, "after its remote region was removed", a.bufs, (1, 2))
            _learn(ch, b, 11)
            declines(pull, "after the remote table changed", a.bufs, (1, 2))
            again = _prepared_or_none(ch, [(1, 10), (2, 11)], bs, nb, nb, False)
            assert again is not None and again(src, dst) == 2 * n * bs, "a pull prepared anew did not move"
            for j, (s, d) in enumerate(zip(src, dst)):
                if d not in dst[j + 1:]:
                    assert np.array_equal(a.bufs[2][d * bs:(d + 1) * bs], b.bufs[11][s * bs:(s + 1) * bs])
        if push is not None:
            ch.remove_remote_region(13)
            declines(push, "after its remote region was removed", b.bufs, (12, 13))
            _learn(ch, b, 13)
            declines(push, "after the remote table changed", b.bufs, (12, 13))
        # a local region deregistered (a fresh transfer of the same shape is the control)
        fresh_pull = _prepared_or_none(ch, [(1, 10), (2, 11)], bs, nb, nb, False) if pull is not None else None
        fresh_push = _prepared_or_none(ch, [(1, 12), (2, 13)], bs, nb, nb, True) if push is not None else None
        a.ep.deregister(2)
        a.bufs[2][:] = _SENTINEL
        if fresh_pull is not None:
            declines(fresh_pull, "after its local region was deregistered", a.bufs, (1, 2))
            assert (a.bufs[2] == _SENTINEL).all(), "bytes landed in a deregistered local region"
        if fresh_push is not None:
            declines(fresh_push, "after its local region was deregistered", b.bufs, (12, 13))
        assert _prepared_or_none(ch, [(1, 10), (2, 11)], bs, nb, nb, False) is None, \
            "prepare() accepted a local region that is no longer registered"
