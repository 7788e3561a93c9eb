"""The Python heap does not grow with the bytes moved.

The decoder pulls 256 MiB (64 tensors x 256 blocks x 16 KiB, a random block table) under
``tracemalloc``; the traced peak (every Python and numpy allocation made while pulling) must stay
under 4 MiB over each transport: per-block work is numpy op arrays, never per-byte buffers.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from llmdd import BlocksCacheKey

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _dataplane_peers as P  # noqa: E402

ENV = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
PROMPT = 1
PEAK_LIMIT = 4 << 20
NT, NB, BS = 64, 256, 16384  # 256 MiB

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def peer_pool():
    pool = P.PeerPool(ENV)
    yield pool
    pool.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pulling_256_mib_keeps_the_heap_flat(peer_pool, transport):
    p, d, port = peer_pool.pair(transport, prompt_kw={"sync_ms": 30000}, decoder_kw={"sync_ms": 30000})
    try:
        p.call(P.register, "src", NT, [NB, BS], blocks=True, seed=7, key=BlocksCacheKey(PROMPT, 0), timeout=60)
        d.call(P.register, "dst", NT, [NB, BS], blocks=True, timeout=30)
        assert d.call(P.link, PROMPT, port) == ["LLM_SUCCESS", "LLM_SUCCESS"]
        rng = np.random.default_rng(3)
        src_blocks = rng.permutation(NB).tolist()
        dst_blocks = rng.permutation(NB).tolist()
        out = d.call(P.traced_pulls, "pull_blocks", (BlocksCacheKey(PROMPT, 0), P.Ref("dst"), src_blocks,
                                                      dst_blocks), {}, 1, timeout=60)
        assert out["moved"] == NT * NB * BS
        assert out["peak"] < PEAK_LIMIT, f"traced heap peak {out['peak']} bytes while moving 256 MiB"
        # and the bytes are right (sampled tensors, to keep the check cheap)
        check = d.call(P.digest_blocks, "dst", [0, 31, 63], dst_blocks, BS, timeout=30)
        assert check == p.call(P.digest_blocks, "src", [0, 31, 63], src_blocks, BS, timeout=30)
    finally:
        peer_pool.discard()  # frees the 512 MiB at once
