"""Property tests for the transfer planner (hypothesis).

Every plan is applied with numpy to two fake memories (one byte array per region and side)
and compared with a naive per-block reference copy; every op must stay inside its region on
both sides; coalescing is maximal and never changes the bytes moved.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from llmdd._seam.ops import coalesce_ops
from llmdd._data.planner import (  # noqa: I001
    last_pair_wins,
    CacheLayout,
    count_runs,
    plan_blocks,
    plan_cache,
    plan_contiguous_to_blocks,
    plan_to_addresses,
    tensor_range,
    total_bytes,
)
from llmdd._base.status import LLMException, LLMStatusCode

SETTINGS = settings(max_examples=150, deadline=None)
INVALID = LLMStatusCode.LLM_PARAM_INVALID
SRC_BASE, DST_BASE = 0, 1000


# --------------------------------------------------------------------------- fake memories


def memory(sizes: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {rid: rng.integers(0, 256, size, dtype=np.uint8) for rid, size in sizes.items()}


def layout_memory(layout: CacheLayout, seed: int) -> dict:
    return memory({r: layout.tensor_size for r in layout.region_ids}, seed)


def clone(mem: dict) -> dict:
    return {k: v.copy() for k, v in mem.items()}


def apply(ops: np.ndarray, src_mem: dict, dst_mem: dict, local: str) -> None:
    """Run ``ops`` in order: src -> dst, whichever side is local."""
    for lr, lo, rr, ro, ln in ops.tolist():
        if local == "dst":
            dst_mem[lr][lo:lo + ln] = src_mem[rr][ro:ro + ln]
        else:
            dst_mem[rr][ro:ro + ln] = src_mem[lr][lo:lo + ln]


def sides(ops: np.ndarray, local: str) -> tuple:
    """((src regions, offsets), (dst regions, offsets)) of ``ops``, as int arrays."""
    loc = (ops["local_region"].astype(np.int64), ops["local_offset"].astype(np.int64))
    rem = (ops["remote_region"].astype(np.int64), ops["remote_offset"].astype(np.int64))
    return (rem, loc) if local == "dst" else (loc, rem)


def assert_in_bounds(ops: np.ndarray, local: str, src_limits: dict, dst_limits: dict) -> None:
    """Every op lies inside [0, limit) of a region its side allows (``*_limits``: region -> bytes)."""
    assert len(ops) > 0
    assert (ops["length"] > 0).all()
    length = ops["length"].astype(np.int64)
    for (regions, offsets), limits in zip(sides(ops, local), (src_limits, dst_limits)):
        for region, offset, n in zip(regions.tolist(), offsets.tolist(), length.tolist()):
            assert region in limits
            assert 0 <= offset and offset + n <= limits[region]


def assert_maximal(ops: np.ndarray) -> None:
    """No two ops in sequence continue each other on both sides (coalescing is complete)."""
    assert len(coalesce_ops(ops, sort=False)) == len(ops)


# --------------------------------------------------------------------------- strategies


@st.composite
def runny_blocks(draw, n: int, units: int):
    """``n`` block indices in [0, units) with runs: ``None`` continues the previous block."""
    steps = draw(st.lists(st.one_of(st.none(), st.integers(0, units - 1)), min_size=n, max_size=n))
    out, prev = [], draw(st.integers(0, units - 1))
    for s in steps:
        prev = (prev + 1) % units if s is None else s
        out.append(prev)
    return out


@st.composite
def tensor_pair(draw, n_src: int, n_dst: int):
    k = draw(st.integers(1, min(n_src, n_dst)))
    s0 = draw(st.integers(0, n_src - k))
    d0 = draw(st.integers(0, n_dst - k))
    return range(s0, s0 + k), range(d0, d0 + k)


@st.composite
def as_blocks_input(draw, blocks: list):
    kind = draw(st.sampled_from(["list", "tuple", "int64", "uint32"]))
    if kind == "list":
        return list(blocks)
    if kind == "tuple":
        return tuple(blocks)
    return np.asarray(blocks, dtype=kind)


def blocks_layouts(draw, block: int, is_blocks_src: bool = True, is_blocks_dst: bool = True):
    nt_s, nt_d = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    u_s, u_d = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    src = CacheLayout(1, range(SRC_BASE, SRC_BASE + nt_s), u_s * block, u_s, is_blocks_src)
    dst = CacheLayout(2, range(DST_BASE, DST_BASE + nt_d), u_d * block, u_d, is_blocks_dst)
    return src, dst


def limits(layout: CacheLayout, tensors: range) -> dict:
    return {layout.region_ids[t]: layout.tensor_size for t in tensors}


# --------------------------------------------------------------------------- blocks -> blocks


@st.composite
def blocks_case(draw):
    block = draw(st.integers(1, 16))
    src, dst = blocks_layouts(draw, block)
    n = draw(st.integers(1, 20))
    sb = draw(runny_blocks(n, src.units))
    db = draw(runny_blocks(n, dst.units))
    sr, dr = draw(tensor_pair(src.num_tensors, dst.num_tensors))
    return src, dst, sb, db, sr, dr, draw(st.sampled_from(["src", "dst"])), draw(as_blocks_input(sb)), \
        draw(as_blocks_input(db)), draw(st.integers(0, 2**16))


@SETTINGS
@given(blocks_case())
def test_plan_blocks_matches_per_block_copy(case):
    src, dst, sb, db, sr, dr, local, sb_in, db_in, seed = case
    ops = plan_blocks(src=src, dst=dst, src_blocks=sb_in, dst_blocks=db_in, src_tensors=sr, dst_tensors=dr,
                      local=local)
    bs = src.unit_size
    assert_in_bounds(ops, local, limits(src, sr), limits(dst, dr))
    # a destination block listed twice keeps only its last pair (one writer per block)
    ksb, kdb = (a.tolist() for a in last_pair_wins(np.asarray(sb, np.int64), np.asarray(db, np.int64)))
    assert total_bytes(ops) == len(sr) * len(set(db)) * bs
    assert len(ops) == len(sr) * count_runs(ksb, kdb)
    assert_maximal(ops)

    src_mem, dst_mem = layout_memory(src, seed), layout_memory(dst, seed + 1)
    expected = clone(dst_mem)
    for s_t, d_t in zip(sr, dr):
        s_reg, d_reg = src.region_ids[s_t], dst.region_ids[d_t]
        for s, d in zip(sb, db):
            expected[d_reg][d * bs:(d + 1) * bs] = src_mem[s_reg][s * bs:(s + 1) * bs]
    apply(ops, src_mem, dst_mem, local)
    for r in dst.region_ids:
        assert np.array_equal(dst_mem[r], expected[r])


@SETTINGS
@given(st.data())
def test_plan_blocks_refuses_bad_indices_before_any_op(data):
    block = data.draw(st.integers(1, 8))
    src, dst = blocks_layouts(data.draw, block)
    n = data.draw(st.integers(1, 10))
    sb = data.draw(st.lists(st.integers(-3, src.units + 3), min_size=n, max_size=n))
    db = data.draw(st.lists(st.integers(-3, dst.units + 3), min_size=n, max_size=n))
    if data.draw(st.booleans()):
        db = db + [0]
    sr, dr = data.draw(tensor_pair(src.num_tensors, dst.num_tensors))
    bad = (len(sb) != len(db) or any(not 0 <= b < src.units for b in sb)
           or any(not 0 <= b < dst.units for b in db))
    try:
        ops = plan_blocks(src=src, dst=dst, src_blocks=sb, dst_blocks=db, src_tensors=sr, dst_tensors=dr,
                          local="dst")
    except LLMException as exc:
        assert exc.status_code is INVALID
        assert bad
    else:
        assert not bad
        assert_in_bounds(ops, "dst", limits(src, sr), limits(dst, dr))


# --------------------------------------------------------------------------- cache -> cache


@SETTINGS
@given(st.data())
def test_plan_cache_matches_slot_copy(data):
    nt_s, nt_d = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    slot_s, slot_d = data.draw(st.integers(1, 64)), data.draw(st.integers(1, 64))
    b_s, b_d = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    src = CacheLayout(1, range(SRC_BASE, SRC_BASE + nt_s), b_s * slot_s, b_s, False)
    dst = CacheLayout(2, range(DST_BASE, DST_BASE + nt_d), b_d * slot_d, b_d, False)
    tnpl = data.draw(st.sampled_from([1, 2, 3]))
    layers_s, layers_d = nt_s // tnpl, nt_d // tnpl
    if nt_s % tnpl == 0 and nt_d % tnpl == 0 and data.draw(st.booleans()):
        k = data.draw(st.integers(1, min(layers_s, layers_d)))
        a, b = data.draw(st.integers(0, layers_s - k)), data.draw(st.integers(0, layers_d - k))
        sr = tensor_range(range(a, a + k), nt_s, tnpl)
        dr = tensor_range(range(b, b + k), nt_d, tnpl)
        assert len(sr) == len(dr) == k * tnpl and sr.start == a * tnpl
    else:
        sr, dr = data.draw(tensor_pair(nt_s, nt_d))
    su, du = data.draw(st.integers(0, b_s - 1)), data.draw(st.integers(0, b_d - 1))
    size = data.draw(st.one_of(st.just(-1), st.integers(1, 70)))
    local = data.draw(st.sampled_from(["src", "dst"]))
    want = slot_s if size == -1 else size
    ok = want <= slot_d and want <= slot_s
    try:
        ops = plan_cache(src=src, dst=dst, src_tensors=sr, dst_tensors=dr, src_unit=su, dst_unit=du, size=size,
                         local=local)
    except LLMException as exc:
        assert exc.status_code is INVALID and not ok
        return
    assert ok
    assert_in_bounds(ops, local, limits(src, sr), limits(dst, dr))
    assert len(ops) == len(sr) and total_bytes(ops) == len(sr) * want
    seed = data.draw(st.integers(0, 2**16))
    src_mem, dst_mem = layout_memory(src, seed), layout_memory(dst, seed + 1)
    expected = clone(dst_mem)
    for s_t, d_t in zip(sr, dr):
        expected[dst.region_ids[d_t]][du * slot_d:du * slot_d + want] = \
            src_mem[src.region_ids[s_t]][su * slot_s:su * slot_s + want]
    apply(ops, src_mem, dst_mem, local)
    for r in dst.region_ids:
        assert np.array_equal(dst_mem[r], expected[r])


# --------------------------------------------------------------------------- contiguous -> blocks


@SETTINGS
@given(st.data())
def test_plan_contiguous_to_blocks_matches_chunk_copy(data):
    block = data.draw(st.integers(1, 16))
    src_blocks_per_slot = data.draw(st.integers(1, 8))
    batch = data.draw(st.integers(1, 4))
    nt_s, nt_d = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    units = data.draw(st.integers(1, 12))
    extra = data.draw(st.integers(0, block - 1))        # slot need not be a whole number of blocks
    slot = src_blocks_per_slot * block + extra
    src = CacheLayout(1, range(SRC_BASE, SRC_BASE + nt_s), batch * slot, batch, False)
    dst = CacheLayout(2, range(DST_BASE, DST_BASE + nt_d), units * block, units, True)
    n = data.draw(st.integers(1, src_blocks_per_slot + 1))
    db = data.draw(runny_blocks(n, units))
    su = data.draw(st.integers(0, batch - 1))
    sr, dr = data.draw(tensor_pair(nt_s, nt_d))
    local = data.draw(st.sampled_from(["src", "dst"]))
    try:
        ops = plan_contiguous_to_blocks(src=src, dst=dst, src_unit=su, dst_blocks=data.draw(as_blocks_input(db)),
                                        src_tensors=sr, dst_tensors=dr, local=local)
    except LLMException as exc:
        assert exc.status_code is INVALID and n * block > slot
        return
    assert n * block <= slot
    assert_in_bounds(ops, local, limits(src, sr), limits(dst, dr))
    kc, kdb = (a.tolist() for a in last_pair_wins(np.arange(n, dtype=np.int64), np.asarray(db, np.int64)))
    assert total_bytes(ops) == len(sr) * len(set(db)) * block
    assert len(ops) == len(sr) * count_runs(kc, kdb)
    assert_maximal(ops)
    seed = data.draw(st.integers(0, 2**16))
    src_mem, dst_mem = layout_memory(src, seed), layout_memory(dst, seed + 1)
    expected = clone(dst_mem)
    for s_t, d_t in zip(sr, dr):
        for i, d in enumerate(db):
            s_off = su * slot + i * block
            expected[dst.region_ids[d_t]][d * block:(d + 1) * block] = \
                src_mem[src.region_ids[s_t]][s_off:s_off + block]
    apply(ops, src_mem, dst_mem, local)
    for r in dst.region_ids:
        assert np.array_equal(dst_mem[r], expected[r])


# --------------------------------------------------------------------------- raw destination addresses


@SETTINGS
@given(st.data())
def test_plan_to_addresses_matches_reference(data):
    mode = data.draw(st.sampled_from(["cache", "blocks", "cache_to_blocks"]))
    nt = data.draw(st.integers(1, 5))
    block = data.draw(st.integers(1, 16))
    if mode == "blocks":
        units = data.draw(st.integers(1, 12))
        src = CacheLayout(1, range(SRC_BASE, SRC_BASE + nt), units * block, units, True)
    else:
        batch = data.draw(st.integers(1, 4))
        slot = data.draw(st.integers(1, 8)) * block + data.draw(st.integers(0, block - 1))
        src = CacheLayout(1, range(SRC_BASE, SRC_BASE + nt), batch * slot, batch, False)
    k = data.draw(st.integers(1, nt))
    s0 = data.draw(st.integers(0, nt - k))
    sr = range(s0, s0 + k)
    su = data.draw(st.integers(0, src.units - 1))
    sb = db = None
    if mode == "blocks":
        n = data.draw(st.integers(1, 16))
        sb = data.draw(runny_blocks(n, src.units))
        db = data.draw(runny_blocks(n, 20))
        extent = (max(db) + 1) * block
    elif mode == "cache_to_blocks":
        n = data.draw(st.integers(1, src.unit_size // block))
        db = data.draw(runny_blocks(n, 20))
        extent = (max(db) + 1) * block
    else:
        extent = src.unit_size
    region_ids = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=k, max_size=k, unique=True))
    bases = data.draw(st.lists(st.integers(0, 64), min_size=k, max_size=k))
    slack = data.draw(st.lists(st.integers(-2, 8), min_size=k, max_size=k))
    sizes = [b + extent + s for b, s in zip(bases, slack)]
    fits = all(s >= 0 for s in slack)
    dst = [(r, b, max(size, 0)) for r, b, size in zip(region_ids, bases, sizes)]
    local = data.draw(st.sampled_from(["src", "dst"]))
    try:
        ops = plan_to_addresses(src=src, src_tensors=sr, dst=dst, src_unit=su, src_blocks=sb, dst_blocks=db,
                                dst_block_size=None if mode == "cache" else block, local=local)
    except LLMException as exc:
        assert exc.status_code is INVALID and not fits
        return
    assert fits
    dst_limits = {r: size for r, _, size in dst}
    assert_in_bounds(ops, local, limits(src, sr), dst_limits)
    seed = data.draw(st.integers(0, 2**16))
    src_mem, dst_mem = layout_memory(src, seed), memory(dst_limits, seed + 1)
    expected = clone(dst_mem)
    for t, (r, base, _) in zip(sr, dst):
        s_mem, d_mem = src_mem[src.region_ids[t]], expected[r]
        if mode == "cache":
            d_mem[base:base + src.unit_size] = s_mem[su * src.unit_size:(su + 1) * src.unit_size]
        elif mode == "blocks":
            for s, d in zip(sb, db):
                d_mem[base + d * block:base + (d + 1) * block] = s_mem[s * block:(s + 1) * block]
        else:
            for i, d in enumerate(db):
                off = su * src.unit_size + i * block
                d_mem[base + d * block:base + (d + 1) * block] = s_mem[off:off + block]
    apply(ops, src_mem, dst_mem, local)
    for r in dst_limits:
        assert np.array_equal(dst_mem[r], expected[r])
    want = {"cache": src.unit_size, "blocks": len(set(db or ())) * block,
            "cache_to_blocks": len(set(db or ())) * block}[mode]
    assert total_bytes(ops) == k * want


# --------------------------------------------------------------------------- layer ranges


@SETTINGS
@given(st.integers(1, 64), st.integers(1, 4), st.integers(-2, 20), st.integers(-2, 20), st.integers(1, 2))
def test_tensor_range_is_layer_range_times_tnpl(num_tensors, tnpl, start, stop, step):
    layers = range(start, stop, step)
    valid = step == 1 and 0 <= start < stop and num_tensors % tnpl == 0 and stop <= num_tensors // tnpl
    try:
        got = tensor_range(layers, num_tensors, tnpl)
    except LLMException as exc:
        assert exc.status_code is INVALID and not valid
        return
    assert valid
    assert got == range(start * tnpl, stop * tnpl)
    assert 0 <= got.start < got.stop <= num_tensors
