"""Repeated destination blocks: upstream (hicann/hixl) accepts them and copies in list order, so the
last listed source is what the block holds; llmdd plans one writer per destination block (the last
pair), so no two streams race on it.  Checked against a byte-level reference copy on seeded data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from llmdd._data.planner import CacheLayout, last_pair_wins, plan_blocks, plan_contiguous_to_blocks

NB, BS, NT = 8, 16, 2


def _layouts():
    src = CacheLayout(cache_id=1, region_ids=(1, 2), tensor_size=NB * BS, units=NB, is_blocks=True)
    dst = CacheLayout(cache_id=2, region_ids=(3, 4), tensor_size=NB * BS, units=NB, is_blocks=True)
    return src, dst


def _apply(ops, mem):
    for op in ops:
        mem[int(op["local_region"])][int(op["local_offset"]):int(op["local_offset"]) + int(op["length"])] = \
            mem[int(op["remote_region"])][int(op["remote_offset"]):int(op["remote_offset"]) + int(op["length"])]


def _memory(seed):
    rng = np.random.default_rng(seed)
    return {r: rng.integers(0, 256, NB * BS, dtype=np.uint8) for r in (1, 2)} | \
        {r: np.zeros(NB * BS, np.uint8) for r in (3, 4)}


def _reference(src_blocks, dst_blocks, mem):
    want = {r: mem[r].copy() for r in (3, 4)}
    for s, d in zip(src_blocks, dst_blocks):      # upstream's order: later pairs overwrite earlier ones
        for sr, dr in ((1, 3), (2, 4)):
            want[dr][d * BS:(d + 1) * BS] = mem[sr][s * BS:(s + 1) * BS]
    return want


pairs = st.integers(1, 20).flatmap(lambda n: st.tuples(st.lists(st.integers(0, NB - 1), min_size=n, max_size=n),
                                                       st.lists(st.integers(0, NB - 1), min_size=n, max_size=n)))


@example(([0, 1], [3, 3]))                 # the finding: two sources for one destination block
@example(([5, 6, 7, 0], [1, 2, 1, 2]))
@example(([0, 1, 2, 3], [0, 1, 2, 3]))     # control: no repeat, nothing dropped
@given(pairs)
def test_repeated_destination_blocks_hold_the_last_listed_source(pair):
    src_blocks, dst_blocks = pair
    src, dst = _layouts()
    mem = _memory(len(src_blocks))
    want = _reference(src_blocks, dst_blocks, mem)
    for blocks in ((list(src_blocks), list(dst_blocks)),                      # the few-blocks path
                   (np.asarray(src_blocks), np.asarray(dst_blocks))):         # the numpy path
        got = {r: mem[r].copy() for r in mem}
        ops = plan_blocks(src=src, dst=dst, src_blocks=blocks[0], dst_blocks=blocks[1], src_tensors=range(NT),
                          dst_tensors=range(NT), local="dst")
        # one writer per destination byte: no two ops overlap on the destination side
        spans = sorted((int(o["local_region"]), int(o["local_offset"]), int(o["local_offset"]) + int(o["length"]))
                       for o in ops)
        for a, b in zip(spans, spans[1:]):
            assert a[0] != b[0] or a[2] <= b[1], (a, b)
        _apply(ops, got)
        for r in (3, 4):
            np.testing.assert_array_equal(got[r], want[r])


def test_last_pair_wins_keeps_order_and_drops_only_earlier_repeats():
    s, d = last_pair_wins(np.array([0, 1, 2, 3, 4]), np.array([7, 5, 7, 6, 5]))
    assert s.tolist() == [2, 3, 4] and d.tolist() == [7, 6, 5]
    s, d = last_pair_wins(np.array([0, 1]), np.array([1, 0]))
    assert s.tolist() == [0, 1] and d.tolist() == [1, 0]


def test_contiguous_to_blocks_with_a_repeated_destination_block_takes_the_last_chunk():
    src = CacheLayout(cache_id=1, region_ids=(1, 2), tensor_size=4 * NB * BS, units=1, is_blocks=False)
    _, dst = _layouts()
    ops = plan_contiguous_to_blocks(src=src, dst=dst, src_unit=0, dst_blocks=[2, 2, 5], src_tensors=range(NT),
                                    dst_tensors=range(NT), local="dst")
    by_dst = {(int(o["local_region"]), int(o["local_offset"])): int(o["remote_offset"]) for o in ops}
    assert by_dst[(3, 2 * BS)] == 1 * BS and by_dst[(3, 5 * BS)] == 2 * BS and len(ops) == 2 * NT
