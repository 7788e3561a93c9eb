"""Tensor parallelism: which KV heads each rank holds, and which prefill rank each decode rank
reads which heads from (pure functions, no vLLM import).

vLLM shards a layer's KV heads over the tensor-parallel ranks: with ``H`` KV heads and ``t`` ranks,
rank ``r`` holds heads ``[r*H/t, (r+1)*H/t)`` when ``H >= t``, and the one head ``r*H//t`` when
``H < t`` (each head then replicated on ``t/H`` ranks).  vLLM's CPU KV cache of one layer is
``[blocks, local heads, block_size, 2*head_size]`` (its ``LBHNC`` layout): one head of one block is
contiguous, so a contiguous head range of a block is one contiguous byte range.  The connector
registers each layer with llmdd in *units* of one head of one block (unit ``b*local_heads + j`` is
local head ``j`` of block ``b``); a pull names units, and llmdd's planner merges units that advance
together on both sides into one copy (a whole block with all its heads, and consecutive blocks,
become one run when both sides hold the same heads).

A replicated head is read from one rank only, its *primary* holder (the first rank holding it);
other holders are never read (:func:`serves`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["MAX_TP", "heads_of", "serves", "source_rank", "Piece", "plan", "readers", "check_tp"]

#: the largest tensor-parallel size accepted from a peer (bounds the work its parameters cause)
MAX_TP = 1024


def check_tp(tp: int, kv_heads: int) -> None:
    """``ValueError`` unless ``tp`` ranks can shard ``kv_heads`` heads the way vLLM does."""
    if not (isinstance(tp, int) and isinstance(kv_heads, int) and 0 < tp <= MAX_TP and kv_heads > 0):
        raise ValueError(f"tensor-parallel size {tp!r} and KV heads {kv_heads!r} must be positive integers "
                         f"(tp <= {MAX_TP})")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"{kv_heads} KV heads cannot be sharded over {tp} ranks (one must divide the other)")


def heads_of(rank: int, tp: int, kv_heads: int) -> range:
    """The global KV heads that rank ``rank`` of ``tp`` holds."""
    if kv_heads >= tp:
        n = kv_heads // tp
        return range(rank * n, rank * n + n)
    h = rank * kv_heads // tp
    return range(h, h + 1)


def serves(rank: int, tp: int, kv_heads: int) -> bool:
    """Whether any reader ever reads from prefill rank ``rank``: every rank when the heads are
    sharded, only a replicated head's first holder otherwise."""
    return kv_heads >= tp or rank % (tp // kv_heads) == 0


def source_rank(head: int, tp: int, kv_heads: int) -> int:
    """The prefill rank a head is read from (its first holder)."""
    if kv_heads >= tp:
        return head // (kv_heads // tp)
    return head * tp // kv_heads


@dataclasses.dataclass(frozen=True)
class Piece:
    """One decode rank's read from one prefill rank: a contiguous head range, in units."""

    rank: int           # the prefill rank read from
    src: list           # units on the prefill rank
    dst: list           # units on the decode rank
    heads: range        # the global heads moved


def plan(d_rank: int, d_tp: int, p_tp: int, kv_heads: int, src_blocks: list, dst_blocks: list) -> list:
    """The pieces decode rank ``d_rank`` of ``d_tp`` pulls for remote blocks ``src_blocks`` (on
    every prefill rank of ``p_tp``: one block table per instance) into local ``dst_blocks``: one
    piece per prefill rank read from, each head read once, one unit per (block, head)."""
    need = heads_of(d_rank, d_tp, kv_heads)
    d_n = len(need)
    out = []
    start = need.start
    while start < need.stop:                       # contiguous head ranges, one per source rank
        rank = source_rank(start, p_tp, kv_heads)
        held = heads_of(rank, p_tp, kv_heads)
        stop = min(need.stop, held.stop)
        p_n, p_off, d_off = len(held), start - held.start, start - need.start
        count = stop - start
        src = [b * p_n + p_off + i for b in src_blocks for i in range(count)]
        dst = [b * d_n + d_off + i for b in dst_blocks for i in range(count)]
        out.append(Piece(rank=rank, src=src, dst=dst, heads=range(start, stop)))
        start = stop
    return out


def readers(p_rank: int, p_tp: int, d_tp: int, kv_heads: int) -> int:
    """How many decode ranks read from prefill rank ``p_rank`` (the owner frees a request's blocks
    after that many reads acknowledged)."""
    return sum(1 for d in range(d_tp)
               if any(source_rank(h, p_tp, kv_heads) == p_rank for h in heads_of(d, d_tp, kv_heads)))
