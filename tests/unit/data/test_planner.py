"""Transfer planner: layer ranges, cache/blocks/contiguous/raw plans, coalescing, validation."""

from __future__ import annotations

import time

import attrs
import numpy as np
import pytest

from llmdd._seam.ops import OP_DTYPE
from llmdd._data.planner import (
    CacheLayout,
    block_array,
    count_runs,
    plan_blocks,
    plan_cache,
    plan_contiguous_to_blocks,
    plan_to_addresses,
    tensor_range,
    total_bytes,
)
from llmdd._base.status import LLMException, LLMStatusCode

INVALID = LLMStatusCode.LLM_PARAM_INVALID


def blocks_layout(cache_id=1, tensors=4, units=16, block=64, base=0):
    return CacheLayout(cache_id, tuple(range(base, base + tensors)), units * block, units, True)


def cache_layout(cache_id=1, tensors=4, batch=4, slot=256, base=0):
    return CacheLayout(cache_id, tuple(range(base, base + tensors)), batch * slot, batch, False)


def ops_list(ops):
    return [tuple(int(x) for x in op) for op in ops]


def raises_invalid(fn, match=None):
    with pytest.raises(LLMException, match=match) as info:
        fn()
    assert info.value.status_code is INVALID
    return info.value


# --------------------------------------------------------------------------- CacheLayout


def test_layout_properties():
    lay = CacheLayout(3, [7, 8, 9], 1024, 16, True)
    assert lay.region_ids == (7, 8, 9)
    assert lay.unit_size == 64 and lay.num_tensors == 3
    assert lay.regions(range(1, 3)).tolist() == [8, 9]
    assert lay == CacheLayout(3, (7, 8, 9), 1024, 16, True)
    assert hash(lay) == hash(CacheLayout(3, (7, 8, 9), 1024, 16, True))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        lay.units = 3  # type: ignore[misc]


@pytest.mark.parametrize("args, match", [
    ((1, (), 64, 1, True), "at least one tensor"),
    ((1, (2**32,), 64, 1, True), "region ids"),
    ((1, (-1,), 64, 1, True), "region ids"),
    ((1, (0,), -1, 1, True), "tensor_size"),
    ((1, (0,), 64, 0, True), "units"),
    ((1, (0,), 65, 2, True), "not a multiple"),
    ((1, (0,), 64, 2, "yes"), "is_blocks"),
    ((1, (0,), 64.0, 2, True), "tensor_size must be an int"),
    ((1, (0,), 64, True, True), "units must be an int"),
])
def test_layout_validation(args, match):
    raises_invalid(lambda: CacheLayout(*args), match)


# --------------------------------------------------------------------------- tensor_range


@pytest.mark.parametrize("layers, num_tensors, tnpl, expected", [
    (None, 6, 2, range(0, 6)),
    (None, 5, 2, range(0, 5)),          # no layer range: no divisibility requirement
    (range(0, 3), 6, 2, range(0, 6)),
    (range(1, 2), 6, 2, range(2, 4)),
    (range(1, 2), 6, 3, range(3, 6)),
    (range(3, 5), 5, 1, range(3, 5)),
])
def test_tensor_range(layers, num_tensors, tnpl, expected):
    assert tensor_range(layers, num_tensors, tnpl) == expected


@pytest.mark.parametrize("layers, num_tensors, tnpl, match", [
    (range(0, 4, 2), 8, 2, "step 1"),
    (range(2, 2), 8, 2, "0 <= start < stop"),
    (range(3, 1), 8, 2, "0 <= start < stop"),
    (range(-1, 2), 8, 2, "0 <= start < stop"),
    (range(0, 1), 7, 2, "not a multiple"),
    (range(0, 5), 8, 2, "exceeds"),
    (range(4, 5), 8, 2, "exceeds"),
    (range(0, 1), 8, 0, "tensor_num_per_layer"),
    (range(0, 1), 0, 1, "num_tensors"),
    ([0, 1], 8, 2, "must be a range"),
])
def test_tensor_range_errors(layers, num_tensors, tnpl, match):
    raises_invalid(lambda: tensor_range(layers, num_tensors, tnpl), match)


# --------------------------------------------------------------------------- plan_cache


def test_plan_cache_pull_whole_slot():
    src = cache_layout(1, tensors=4, batch=4, slot=256, base=10)
    dst = cache_layout(2, tensors=4, batch=2, slot=512, base=20)
    ops = plan_cache(src=src, dst=dst, src_tensors=range(2, 4), dst_tensors=range(0, 2),
                     src_unit=3, dst_unit=1, local="dst")
    assert ops.dtype == OP_DTYPE
    # pull: local = dst side
    assert ops_list(ops) == [(20, 512, 12, 768, 256), (21, 512, 13, 768, 256)]
    assert total_bytes(ops) == 512


def test_plan_cache_push_with_size():
    src = cache_layout(1, tensors=2, batch=4, slot=256, base=0)
    dst = cache_layout(5, tensors=2, batch=4, slot=256, base=100)
    ops = plan_cache(src=src, dst=dst, src_tensors=range(2), dst_tensors=range(2),
                     src_unit=1, dst_unit=2, size=100, local="src")
    # push: local = src side
    assert ops_list(ops) == [(0, 256, 100, 512, 100), (1, 256, 101, 512, 100)]


@pytest.mark.parametrize("kw, match", [
    (dict(src_unit=4), "batch index 4 out of range"),
    (dict(src_unit=-1), "batch index -1 out of range"),
    (dict(dst_unit=2), "batch index 2 out of range"),
    (dict(size=0), "-1 or > 0"),
    (dict(size=-2), "-1 or > 0"),
    (dict(size=257), "exceeds a batch slot"),
    (dict(size=1.5), "size must be an int"),
    (dict(src_tensors=range(0, 3)), "differ in length"),
    (dict(src_tensors=range(0, 5), dst_tensors=range(0, 5)), "inside"),
    (dict(src_tensors=range(2, 2), dst_tensors=range(2, 2)), "non-empty"),
    (dict(src_tensors=range(0, 4, 2), dst_tensors=range(0, 4, 2)), "step 1"),
    (dict(src_tensors=[0, 1]), "must be a range"),
    (dict(local="both"), "local must be"),
    (dict(src=blocks_layout(1, tensors=4, units=4, block=256)), "must be a non-blocks cache"),
    (dict(dst=cache_layout(2, tensors=4, batch=4, slot=128)), "pass an explicit size"),
    (dict(dst="layout"), "CacheLayout"),
])
def test_plan_cache_errors(kw, match):
    args = dict(src=cache_layout(1, tensors=4, batch=4, slot=256), dst=cache_layout(2, tensors=4, batch=2, slot=512),
                src_tensors=range(0, 2), dst_tensors=range(2, 4), src_unit=0, dst_unit=0, size=-1, local="dst")
    args.update(kw)
    raises_invalid(lambda: plan_cache(**args), match)


# --------------------------------------------------------------------------- plan_blocks


BLOCK_CASES = [
    # (src_blocks, dst_blocks, expected runs per tensor as (src_block, dst_block, count))
    ("single", [5], [9], [(5, 9, 1)]),
    ("all consecutive", list(range(16)), list(range(16)), [(0, 0, 16)]),
    ("shifted run", [2, 3, 4, 5], [10, 11, 12, 13], [(2, 10, 4)]),
    ("interleaved", [0, 2, 4, 6], [1, 3, 5, 7], [(0, 1, 1), (2, 3, 1), (4, 5, 1), (6, 7, 1)]),
    ("src runs, dst not", [0, 1, 2, 3], [3, 2, 1, 0], [(0, 3, 1), (1, 2, 1), (2, 1, 1), (3, 0, 1)]),
    ("partial runs", [0, 1, 2, 7, 8, 3], [4, 5, 6, 0, 1, 9], [(0, 4, 3), (7, 0, 2), (3, 9, 1)]),
    ("dst breaks run", [0, 1, 2, 3], [0, 1, 5, 6], [(0, 0, 2), (2, 5, 2)]),
    ("repeat block", [4, 4, 5], [1, 2, 3], [(4, 1, 1), (4, 2, 2)]),
]


@pytest.mark.parametrize("local", ["dst", "src"])
@pytest.mark.parametrize("name, sb, db, runs", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
def test_plan_blocks_runs(name, sb, db, runs, local):
    src = blocks_layout(1, tensors=4, units=16, block=64, base=0)
    dst = blocks_layout(2, tensors=6, units=16, block=64, base=50)
    ops = plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=range(1, 3),
                      dst_tensors=range(3, 5), local=local)
    expected = []
    for st, dt in ((1, 53), (2, 54)):
        for s, d, n in runs:
            if local == "dst":
                expected.append((dt, d * 64, st, s * 64, n * 64))
            else:
                expected.append((st, s * 64, dt, d * 64, n * 64))
    assert ops_list(ops) == expected
    assert total_bytes(ops) == 2 * len(sb) * 64
    assert count_runs(sb, db) == len(runs)


@pytest.mark.parametrize("conv", [list, tuple, lambda x: np.asarray(x, dtype=np.int64),
                                  lambda x: np.asarray(x, dtype=np.uint32), lambda x: np.asarray(x, dtype=np.int16)])
def test_plan_blocks_accepts_lists_tuples_arrays(conv):
    src = blocks_layout(1, units=8)
    dst = blocks_layout(2, units=8)
    ops = plan_blocks(src=src, dst=dst, src_blocks=conv([0, 1, 2, 5]), dst_blocks=conv([3, 4, 5, 0]),
                      src_tensors=range(4), dst_tensors=range(4), local="dst")
    assert len(ops) == 8
    assert ops_list(ops[:2]) == [(0, 3 * 64, 0, 0, 3 * 64), (0, 0, 0, 5 * 64, 64)]


def test_256_consecutive_blocks_is_one_op_per_tensor():
    src = blocks_layout(1, tensors=64, units=1024, block=65536)
    dst = blocks_layout(2, tensors=64, units=512, block=65536, base=1000)
    ops = plan_blocks(src=src, dst=dst, src_blocks=list(range(100, 356)), dst_blocks=list(range(256)),
                      src_tensors=range(64), dst_tensors=range(64), local="dst")
    assert len(ops) == 64
    assert (ops["length"] == 256 * 65536).all()
    assert (ops["remote_offset"] == 100 * 65536).all() and (ops["local_offset"] == 0).all()
    assert ops["local_region"].tolist() == list(range(1000, 1064))
    assert ops["remote_region"].tolist() == list(range(64))


@pytest.mark.parametrize("kw, match", [
    (dict(src_blocks=[0, 1], dst_blocks=[0]), "differ in length"),
    (dict(src_blocks=[], dst_blocks=[]), "must not be empty"),
    (dict(src_blocks=np.array([], dtype=np.int64), dst_blocks=[0]), "must not be empty"),
    (dict(src_blocks=[16], dst_blocks=[0]), r"src_blocks\[0\] = 16 is out of range \[0, 16\)"),
    (dict(src_blocks=[0, 1, -1], dst_blocks=[0, 1, 2]), r"src_blocks\[2\] = -1"),
    (dict(src_blocks=[0], dst_blocks=[8]), r"dst_blocks\[0\] = 8 is out of range \[0, 8\)"),
    (dict(src_blocks=[0], dst_blocks=[2**64]), "ints"),
    (dict(src_blocks=[0.0], dst_blocks=[0]), "ints only"),
    (dict(src_blocks=[True], dst_blocks=[0]), "ints only"),
    (dict(src_blocks=["1"], dst_blocks=[0]), "ints only"),
    (dict(src_blocks=[[0, 1]], dst_blocks=[0]), "one-dimensional"),
    (dict(src_blocks=[0, [1]], dst_blocks=[0, 1]), "flat list"),
    (dict(src_blocks=5, dst_blocks=[0]), "list or tuple"),
    (dict(src_blocks={0}, dst_blocks=[0]), "list or tuple"),
    (dict(dst=blocks_layout(2, units=8, block=32)), "block sizes differ"),
    (dict(src=cache_layout(1, batch=16, slot=64)), "must be a blocks cache"),
    (dict(dst=cache_layout(2, batch=8, slot=64)), "must be a blocks cache"),
    (dict(src_tensors=range(0, 4), dst_tensors=range(0, 3)), "differ in length"),
    (dict(src_tensors=range(0, 4), dst_tensors=range(1, 5)), "inside"),
    (dict(local=None), "local must be"),
])
def test_plan_blocks_errors(kw, match):
    args = dict(src=blocks_layout(1, units=16), dst=blocks_layout(2, units=8), src_blocks=[0], dst_blocks=[0],
                src_tensors=range(4), dst_tensors=range(4), local="dst")
    args.update(kw)
    raises_invalid(lambda: plan_blocks(**args), match)


# --------------------------------------------------------------------------- plan_contiguous_to_blocks


@pytest.mark.parametrize("db, runs", [
    ([3, 4, 5, 6], [(0, 3, 4)]),
    ([6, 5, 4, 3], [(0, 6, 1), (1, 5, 1), (2, 4, 1), (3, 3, 1)]),
    ([0, 1, 7, 8], [(0, 0, 2), (2, 7, 2)]),
    ([9], [(0, 9, 1)]),
])
def test_plan_contiguous_to_blocks(db, runs):
    src = cache_layout(1, tensors=2, batch=3, slot=256, base=40)   # slot = 4 blocks of 64
    dst = blocks_layout(2, tensors=2, units=16, block=64, base=0)
    ops = plan_contiguous_to_blocks(src=src, dst=dst, src_unit=2, dst_blocks=db, src_tensors=range(2),
                                    dst_tensors=range(2), local="dst")
    expected = [(t, d * 64, 40 + t, 512 + c * 64, n * 64) for t in range(2) for c, d, n in runs]
    assert ops_list(ops) == expected
    assert total_bytes(ops) == 2 * 64 * len(db)


@pytest.mark.parametrize("kw, match", [
    (dict(dst_blocks=[0, 1, 2, 3, 4]), "do not fit"),
    (dict(dst_blocks=[]), "must not be empty"),
    (dict(dst_blocks=[16]), "out of range"),
    (dict(src_unit=3), "batch index 3 out of range"),
    (dict(src=blocks_layout(1, tensors=2, units=3, block=256)), "must be a non-blocks cache"),
    (dict(dst=cache_layout(2, tensors=2, batch=16, slot=64)), "must be a blocks cache"),
    (dict(dst_tensors=range(0, 1)), "differ in length"),
])
def test_plan_contiguous_to_blocks_errors(kw, match):
    args = dict(src=cache_layout(1, tensors=2, batch=3, slot=256), dst=blocks_layout(2, tensors=2, units=16),
                src_unit=0, dst_blocks=[0], src_tensors=range(2), dst_tensors=range(2), local="dst")
    args.update(kw)
    raises_invalid(lambda: plan_contiguous_to_blocks(**args), match)


# --------------------------------------------------------------------------- plan_to_addresses


def test_plan_to_addresses_cache_to_cache():
    src = cache_layout(1, tensors=4, batch=2, slot=128, base=0)
    dst = [(70, 1000, 4096), (71, 0, 128)]
    ops = plan_to_addresses(src=src, src_tensors=range(2, 4), src_unit=1, dst=dst)
    assert ops_list(ops) == [(2, 128, 70, 1000, 128), (3, 128, 71, 0, 128)]
    ops = plan_to_addresses(src=src, src_tensors=range(2, 4), src_unit=1, dst=dst, dst_block_size=0, local="dst")
    assert ops_list(ops) == [(70, 1000, 2, 128, 128), (71, 0, 3, 128, 128)]


def test_plan_to_addresses_blocks_to_blocks():
    src = blocks_layout(1, tensors=2, units=8, block=64)
    dst = [(9, 100, 100 + 10 * 64), (8, 0, 10 * 64)]
    ops = plan_to_addresses(src=src, src_tensors=range(2), dst=dst, src_blocks=[0, 1, 2, 6],
                            dst_blocks=[7, 8, 9, 0], dst_block_size=64)
    assert ops_list(ops) == [(0, 0, 9, 100 + 7 * 64, 192), (0, 384, 9, 100, 64),
                             (1, 0, 8, 7 * 64, 192), (1, 384, 8, 0, 64)]
    same = plan_to_addresses(src=src, src_tensors=range(2), dst=dst, src_blocks=[0, 1, 2, 6],
                             dst_blocks=[7, 8, 9, 0])
    assert ops_list(same) == ops_list(ops)


def test_plan_to_addresses_cache_to_blocks():
    src = cache_layout(1, tensors=2, batch=2, slot=300, base=5)
    dst = np.array([(3, 0, 4096), (4, 64, 4096)])
    ops = plan_to_addresses(src=src, src_tensors=range(2), src_unit=1, dst=dst, dst_blocks=[4, 5, 1],
                            dst_block_size=100)
    assert ops_list(ops) == [(5, 300, 3, 400, 200), (5, 500, 3, 100, 100),
                             (6, 300, 4, 64 + 400, 200), (6, 500, 4, 64 + 100, 100)]


@pytest.mark.parametrize("kw, match", [
    (dict(src_blocks=[0]), "not supported"),
    (dict(dst_blocks=[0]), "dst_block_memory_size is required"),
    (dict(dst_blocks=[0], dst_block_size=0), "dst_block_memory_size is required"),
    (dict(dst_blocks=[0, 1, 2], dst_block_size=100), "do not fit"),
    (dict(dst_block_size=64), "None or 0"),
    (dict(dst_block_size=-1), ">= 0"),
    (dict(src_unit=2), "out of range"),
    (dict(dst=[(1, 0, 256)]), "names 1 tensors"),
    (dict(dst=[(1, 0), (2, 0)]), "triples"),
    (dict(dst=[(1, 0, 256), (2, -1, 256)]), ">= 0"),
    (dict(dst=[(1, 0, 256), (2**32, 0, 256)]), "< 2\\*\\*32"),
    (dict(dst=[(1, 0, 256), (2, 1, 256)]), "no room"),
    (dict(dst_blocks=[0, 4], dst_block_size=64), "no room"),
    (dict(dst_blocks=[-1], dst_block_size=64), "out of range"),
    (dict(src_tensors=range(0, 3)), "inside"),
    (dict(local="x"), "local must be"),
])
def test_plan_to_addresses_cache_errors(kw, match):
    args = dict(src=cache_layout(1, tensors=2, batch=2, slot=256), src_tensors=range(2), src_unit=0,
                dst=[(1, 0, 256), (2, 0, 256)])
    args.update(kw)
    raises_invalid(lambda: plan_to_addresses(**args), match)


@pytest.mark.parametrize("kw, match", [
    (dict(dst_block_size=32), "differs from the src block size"),
    (dict(src_blocks=[0, 1], dst_blocks=[0]), "differ in length"),
    (dict(src_blocks=[8], dst_blocks=[0]), "out of range"),
    (dict(dst_blocks=[4]), "no room"),
    (dict(src_blocks=[]), "must not be empty"),
    (dict(src=cache_layout(1, tensors=2, batch=8, slot=64)), "must be a blocks cache"),
])
def test_plan_to_addresses_blocks_errors(kw, match):
    args = dict(src=blocks_layout(1, tensors=2, units=8, block=64), src_tensors=range(2),
                dst=[(1, 0, 256), (2, 0, 256)], src_blocks=[0], dst_blocks=[3])
    args.update(kw)
    raises_invalid(lambda: plan_to_addresses(**args), match)


# --------------------------------------------------------------------------- helpers


def test_block_array_and_count_runs():
    assert block_array((3, 1), "b", 4).dtype == np.int64
    assert block_array(np.array([2**40], dtype=np.uint64), "b").tolist() == [2**40]
    raises_invalid(lambda: block_array(np.array([2**63], dtype=np.uint64), "b"), "2\\*\\*63")
    assert count_runs(range(256)) == 1
    assert count_runs([0, 1, 2, 9, 10, 4]) == 3
    assert count_runs([0, 1, 2], [5, 6, 8]) == 2
    raises_invalid(lambda: count_runs([0, 1], [0]), "differ in length")
    assert total_bytes(np.zeros(0, dtype=OP_DTYPE)) == 0


def test_planning_time(capsys):
    """Not an assertion on time: prints what planning costs at the DESIGN.md section 8 sizes."""
    rng = np.random.default_rng(1)
    src = blocks_layout(1, tensors=64, units=4096, block=16384)
    dst = blocks_layout(2, tensors=64, units=4096, block=16384, base=64)
    cases = {
        "64 x 256 consecutive": (list(range(256)), list(range(1000, 1256))),
        "64 x 1024 random": (rng.choice(4096, 1024, replace=False).tolist(),
                             rng.choice(4096, 1024, replace=False).tolist()),
    }
    lines = []
    for name, (sb, db) in cases.items():
        def plan():
            return plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=range(64),
                               dst_tensors=range(64), local="dst")
        ops = plan()
        best = float("inf")
        for _ in range(5):
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                plan()
            best = min(best, (time.perf_counter() - t0) / n)
        lines.append(f"planner {name}: {len(ops)} ops, {best * 1e6:.0f} us per plan")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
