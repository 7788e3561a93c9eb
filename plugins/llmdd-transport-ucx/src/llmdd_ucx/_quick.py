"""The ucx channel's one-call small transfers (issue 21): a planned ``pull_blocks`` / ``push_blocks``
shape as one NIXL request, in the calling thread, in plain Python.

The engine plans a call shape once (which local and remote region each tensor pair uses, the block
size, the two caches' block counts, the direction; ``llmdd._data.prepared``) and asks the channel for a
prepared transfer (the seam's ``Channel.prepare``): :func:`prepare` has the channel resolve each pair against the endpoint's and its own tables of now
(:meth:`UcxChannel.prepared_rows`: local base, remote base, remote device, and both tables' versions)
and returns ``fast``.  A
call of ``fast(src_blocks, dst_blocks)`` checks the blocks (exact ints in range, no destination
twice), merges runs of consecutive blocks as ``PreparedPlan.ops`` does, builds the two descriptor lists
and hands them to :meth:`UcxChannel.quick_run`, which posts them as one ``Xfer`` batch of one
chunk, registered where every other batch is (the channel's batch set, the endpoint's registry), so
that a deregistration, a DRAIN, a peer's BYE or a close either sees it in flight (fails and drains
it) or makes it decline.  ``fast`` returns the bytes moved, a negative number when it did nothing
(the engine's ops path then runs the call), or raises the transport error of the request it posted.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from llmdd.lowlevel import block_runs

from . import _nixl
from ._options import OPT_CHUNK_BYTES, OPT_CHUNK_DESCS


class QuickEndpoint(Protocol):
    """What a plan uses of the endpoint (:class:`~llmdd_ucx._endpoint.UcxEndpoint`): its NIXL agent (None
    once closed), its options and its table's version."""

    @property
    def agent(self) -> Any: ...

    @property
    def cfg(self) -> Mapping[str, Any]: ...

    @property
    def table_version(self) -> int: ...


class QuickChannel(Protocol):
    """What a plan uses of the channel (:class:`~llmdd_ucx._channel.UcxChannel`): its endpoint, its table's
    version, both tables read together (``prepared_rows``) and the post of one call (``quick_run``)."""

    @property
    def endpoint(self) -> QuickEndpoint: ...

    @property
    def table_version(self) -> int: ...

    def prepared_rows(self, pairs: Sequence[tuple[int, int]], local_min: int,
                      remote_min: int) -> Optional[tuple[int, int, list]]: ...

    def quick_run(self, op: str, ldesc: Any, rdesc: Any, nbytes: int, nops: int, local_ids: frozenset,
                  remote_ids: frozenset, ev: int, cv: int, deadline: float) -> int: ...

__all__ = ["prepare", "STALE", "SHAPE", "LARGE", "MAX_BLOCKS"]

#: what ``fast`` returns when it did nothing: a table changed since the plan (or the channel, the
#: endpoint or the peer went), blocks it does not take (not exact ints in range, a destination
#: twice, more than :data:`MAX_BLOCKS`, descriptors NIXL does not build), more bytes or descriptors
#: than one chunk holds
STALE, SHAPE, LARGE = -1, -2, -3
#: the most blocks one call takes (the engine's small-transfer path plans at most 16 in Python)
MAX_BLOCKS = 16


def prepare(ch: QuickChannel, pairs: Sequence[tuple[int, int]], block_bytes: int, src_units: int,
               dst_units: int, push: bool, timeout_s: float) -> Optional[Callable[[Any, Any], int]]:
    """``fast(src_blocks, dst_blocks)`` for this shape on channel ``ch``, or None when the channel
    cannot take it (closed, peer gone, a local region not registered, a remote region not announced
    or not remote-accessible, a cache larger than its region)."""
    bs, su, du = int(block_bytes), int(src_units), int(dst_units)
    if bs <= 0 or su <= 0 or du <= 0 or not pairs:
        return None
    ep = ch.endpoint
    agent = ep.agent
    if agent is None:
        return None
    make_dlist = _nixl.load().nixlBind.nixlXferDList   # what agent.get_xfer_descs builds from tuples
    dram = agent.nixl_mems["DRAM"]
    lunits, runits = (su, du) if push else (du, su)
    tables = ch.prepared_rows(pairs, lunits * bs, runits * bs)
    if tables is None:
        return None
    ev, cv, rows = tables
    local_ids = frozenset(int(lid) for lid, _ in pairs)
    remote_ids = frozenset(int(rid) for _, rid in pairs)
    max_bytes, max_descs = int(ep.cfg[OPT_CHUNK_BYTES]), int(ep.cfg[OPT_CHUNK_DESCS])
    op = "WRITE" if push else "READ"
    timeout = float(timeout_s)
    run = ch.quick_run
    monotonic = time.monotonic

    def fast(src_blocks: Any, dst_blocks: Any) -> int:
        if ep.table_version != ev or ch.table_version != cv:
            return STALE
        runs = block_runs(src_blocks, dst_blocks, su, du, MAX_BLOCKS)
        if runs is None:
            return SHAPE
        n = len(dst_blocks)
        ldesc = []
        rdesc = []
        for lbase, rbase, dev in rows:
            for s0, d0, c in runs:
                length = c * bs
                if push:   # local = source
                    ldesc.append((lbase + s0 * bs, length, 0))
                    rdesc.append((rbase + d0 * bs, length, dev))
                else:
                    ldesc.append((lbase + d0 * bs, length, 0))
                    rdesc.append((rbase + s0 * bs, length, dev))
        total = n * bs * len(rows)
        nops = len(ldesc)
        if total > max_bytes or nops > max_descs:
            return LARGE
        try:
            lxfer, rxfer = make_dlist(dram, ldesc), make_dlist(dram, rdesc)
        except Exception:  # noqa: BLE001 - NIXL would not take them: the ops path runs (and reports) the call
            return SHAPE
        return run(op, lxfer, rxfer, total, nops, local_ids, remote_ids, ev, cv, monotonic() + timeout)

    return fast
