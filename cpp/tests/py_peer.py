"""Python peers of the C++ tests: the guide's prompt and decoder written against llmdd's Python API,
with the same line protocol and seeded data as examples/cpp (prompt.cc, decoder.cc).

    py_peer.py prompt <port>   # listens; caches 1..4; pushes into the decoder; force unlink
    py_peer.py decoder <port>  # links; pulls; checks the prompt's pushes; unlink, relink, force
    py_peer.py serve <port>    # listens with caches for remote_checks / exit_without_finalize

A C++ cache is a blocks cache to a Python peer (docs/cpp.md): its blocks are pulled by
``BlocksCacheKey(cluster_id, model_id=cache_id)`` and pushed by ``CacheKeyByIdAndIndex``; its
batch slot ``b`` is its block ``b``.
"""

from __future__ import annotations

import ctypes
import struct
import sys
import time

import llmdd
from llmdd._protocol.port import RequestOp
from llmdd import (BlocksCacheKey, CacheDesc, CacheKeyByIdAndIndex, DataType, LLMClusterInfo, LLMConfig, LLMRole,
                   LLMStatusCode)

PROMPT, DECODER = 1, 2
NUM_TENSORS = 4
TENSOR_BYTES = 8 * 16 * 4
BLOCK = TENSOR_BYTES // 8
MASK = (1 << 64) - 1


def pattern(seed: int, tensor: int, nbytes: int) -> bytes:
    state = (seed * 1000003 + tensor) & MASK
    words = []
    for _ in range((nbytes + 7) // 8):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        words.append(z ^ (z >> 31))
    return struct.pack(f"<{len(words)}Q", *words)[:nbytes]


def fill(cache, seed: int, nbytes: int = TENSOR_BYTES) -> None:
    for t, addr in enumerate(cache.tensor_addrs):
        ctypes.memmove(addr, pattern(seed, t, nbytes), nbytes)


def same(cache, t: int, offset: int, seed: int, src_offset: int, length: int, nbytes: int = TENSOR_BYTES) -> bool:
    got = ctypes.string_at(cache.tensor_addrs[t] + offset, length)
    return got == pattern(seed, t, nbytes)[src_offset:src_offset + length]


def say(word: str) -> None:
    print(word, flush=True)


def expect(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"[ERROR] expected command {word}, got {line!r}")


def engine(cluster_id: int, role: LLMRole, port: int | None) -> llmdd.LLMDataDist:
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.mem_pool_cfg = '{"memory_size": 67108864}'
    if port is not None:
        config.listen_ip_info = f"127.0.0.1:{port}"
    dd = llmdd.LLMDataDist(role, cluster_id)
    dd.init(config.generate_options())
    return dd


def cluster(remote: int, port: int | None = None) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote
    if port is not None:
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
    return info


def see_peer_tables(dd, peer: int) -> None:
    """The decoder made its caches after the link: their announcement may still be on its way.
    One request round trip with the peer (its answer follows every update it sent before) makes
    them visible here. (Internal API: llmdd's public API has no such barrier.)"""
    core = dd._core
    link = core.link_manager.require(peer)
    core.link_manager.request(link, RequestOp.ENGINE_INFO, {}, deadline=time.monotonic() + 5.0)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"[ERROR] {what}: bytes differ")


def desc(rows: int = 8) -> CacheDesc:
    return CacheDesc(NUM_TENSORS, [rows, 16], DataType.DT_INT32)


def prompt(port: int) -> None:
    dd = engine(PROMPT, LLMRole.PROMPT, port)
    cm = dd.cache_manager
    caches = [cm.allocate_cache(desc()), cm.allocate_blocks_cache(desc()),
              cm.allocate_blocks_cache(desc()), cm.allocate_blocks_cache(desc())]
    for i, c in enumerate(caches):
        fill(c, 10 + i)
    say("READY")
    expect("PUSH")
    see_peer_tables(dd, DECODER)
    # the decoder's caches are C++ caches (blocks caches here): slot 0 is block 0
    cm.push_blocks(CacheKeyByIdAndIndex(DECODER, 3, 0), caches[2], [0], [0], src_layer_range=range(0, 1),
                   dst_layer_range=range(0, 1))
    cm.push_blocks(CacheKeyByIdAndIndex(DECODER, 4, 0), caches[3], [0, 1, 2, 3], [3, 2, 1, 0],
                   src_layer_range=range(0, 1), dst_layer_range=range(0, 1))
    say("PUSHED")
    expect("FORCE")
    status, rets = dd.unlink_clusters([cluster(DECODER)], 1000, force=True)
    if status != LLMStatusCode.LLM_SUCCESS or any(r != LLMStatusCode.LLM_SUCCESS for r in rets):
        raise SystemExit(f"[ERROR] force unlink: {status} {rets}")
    say("UNLINKED")
    cm.deallocate_cache(caches[0])
    for c in caches[1:]:
        cm.deallocate_blocks_cache(c)
    dd.finalize()
    say("DONE")


def decoder(port: int) -> None:
    dd = engine(DECODER, LLMRole.DECODER, None)
    cm = dd.cache_manager
    status, rets = dd.link_clusters([cluster(PROMPT, port)], 3000)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"[ERROR] link: {status} {rets}")
    caches = [cm.allocate_blocks_cache(desc()) for _ in range(4)]
    for i, c in enumerate(caches):
        fill(c, 90 + i)
    # batch slot 0 of the prompt's C++ cache 1 is its block 0
    cm.pull_blocks(BlocksCacheKey(PROMPT, 1), caches[0], [0], [0])
    for t in range(NUM_TENSORS):
        check(same(caches[0], t, 0, 10, 0, BLOCK) and same(caches[0], t, BLOCK, 90, BLOCK, TENSOR_BYTES - BLOCK),
              "pull slot 0")
    cm.pull_blocks(BlocksCacheKey(PROMPT, 2), caches[1], [0, 1, 2, 3], [3, 2, 1, 0])
    for t in range(NUM_TENSORS):
        for s, d in zip([0, 1, 2, 3], [3, 2, 1, 0]):
            check(same(caches[1], t, d * BLOCK, 11, s * BLOCK, BLOCK), "pull_blocks")
        check(same(caches[1], t, 4 * BLOCK, 91, 4 * BLOCK, 4 * BLOCK), "pull_blocks (blocks not named)")
    say("PULLED")
    expect("VERIFY")
    for t in range(NUM_TENSORS):
        pushed = t < 2
        check(same(caches[2], t, 0, 12 if pushed else 92, 0, BLOCK)
              and same(caches[2], t, BLOCK, 92, BLOCK, TENSOR_BYTES - BLOCK), "PushKvCache")
        for s, d in zip([0, 1, 2, 3], [3, 2, 1, 0]):
            check(same(caches[3], t, d * BLOCK, 13 if pushed else 93, s * BLOCK if pushed else d * BLOCK, BLOCK),
                  "PushKvBlocks")
    for c in caches:
        cm.deallocate_blocks_cache(c)
    status, rets = dd.unlink_clusters([cluster(PROMPT, port)], 1000)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"[ERROR] unlink: {status} {rets}")
    status, rets = dd.link_clusters([cluster(PROMPT, port)], 3000)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise SystemExit(f"[ERROR] relink: {status} {rets}")
    say("VERIFIED")
    expect("FORCE")
    status, rets = dd.unlink_clusters([cluster(PROMPT)], 1000, force=True)
    if status != LLMStatusCode.LLM_SUCCESS or any(r != LLMStatusCode.LLM_SUCCESS for r in rets):
        raise SystemExit(f"[ERROR] force unlink: {status} {rets}")
    say("UNLINKED")
    dd.finalize()
    say("DONE")


def serve(port: int) -> None:
    """Caches for remote_checks: 1 (non-blocks, seed 10), 2 (blocks, seed 11), 3 (64 blocks, seed 12)."""
    dd = engine(PROMPT, LLMRole.PROMPT, port)
    cm = dd.cache_manager
    c1 = cm.allocate_cache(desc())
    # blocks keys as the C++ library gives its caches: model_id = cache id
    c2 = cm.allocate_blocks_cache(desc(), BlocksCacheKey(PROMPT, 2))
    c3 = cm.allocate_blocks_cache(desc(64), BlocksCacheKey(PROMPT, 3))
    fill(c1, 10)
    fill(c2, 11)
    fill(c3, 12, 64 * BLOCK)
    say("READY")
    expect("EXIT")
    dd.finalize()
    say("DONE")


if __name__ == "__main__":
    {"prompt": prompt, "decoder": decoder, "serve": serve}[sys.argv[1]](int(sys.argv[2]))
