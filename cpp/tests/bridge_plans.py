"""The bridge's kept block-transfer plans (docs/cpp.md) never outlive what they were made for:
against a Python prompt, pulls and pushes by blocks reuse a plan, and after the peer deallocates
the cache (and makes another), after an unlink and a new link, after the local cache is
deallocated, each call answers as a first call would, bytes checked.  Run by ctest (one engine
per process: the prompt is a child process); exits non-zero on the first failure."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import llmdd_cpp_bridge as br  # noqa: E402

NOT_EXIST = 0x5010B002
ROWS, INTS = 8, 1024
BLOCK = INTS * 4

PEER = textwrap.dedent("""
    import ctypes, sys, llmdd
    from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMRole
    c = LLMConfig(); c.device_id = 0; c.enable_cache_manager = True; c.enable_remote_cache_accessible = True
    c.mem_pool_cfg = '{"memory_size": 16777216}'; c.listen_ip_info = "127.0.0.1:" + sys.argv[1]
    dd = llmdd.LLMDataDist(LLMRole.PROMPT, 1); dd.init(c.generate_options()); cm = dd.cache_manager
    def make(model_id, seed):
        cache = cm.allocate_blocks_cache(CacheDesc(2, [8, 1024], DataType.DT_INT32), BlocksCacheKey(1, model_id))
        for t, a in enumerate(cache.tensor_addrs):
            ctypes.memset(a, seed + t, 8 * 4096)
        return cache
    a = make(1, 10)
    print("READY", a.cache_id, flush=True)
    sys.stdin.readline(); cm.deallocate_blocks_cache(a); b = make(2, 20)
    print("SWAPPED", b.cache_id, flush=True)
    sys.stdin.readline(); dd.finalize(); print("DONE", flush=True)
""")


def expect(got, want, what):
    if got[0] != want:
        raise SystemExit(f"[ERROR] {what}: status {got[0]:#x}, want {want:#x} ({got[1]})")


def block_is(addr: int, block: int, byte: int) -> bool:
    return ctypes.string_at(addr + block * BLOCK, BLOCK) == bytes([byte]) * BLOCK


def main() -> None:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    port, own_port = ports
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert peer.stdout.readline().split() == ["READY", "1"]
        b = br.make(2, 3)  # mix: pulls and pushes
        expect(b.initialize({"llm.DeviceId": "0", "llm.BufPoolCfg": '{"buf_pool_size": 16777216}',
                             "llm.ListenIpInfo": f"127.0.0.1:{own_port}"}), 0, "init")
        cluster = [(1, [("127.0.0.1", 0)], [("127.0.0.1", port)])]
        expect(b.link(cluster, 5000), 0, "link")
        st, _, (cid, addrs) = b.allocate((1, 2, 3, [ROWS, INTS]))
        expect((st, ""), 0, "allocate")
        every, layer0 = ((-1, -1), (-1, -1), 2), ((0, 0), (0, 0), 1)
        for i in range(ROWS):  # one plan per shape, reused with other blocks
            expect(b.pull_blocks((1, 1, 0), cid, [i], [ROWS - 1 - i], every), 0, f"pull {i}")
        assert all(block_is(addrs[t], r, 10 + t) for t in range(2) for r in range(ROWS)), "pulled bytes"
        ctypes.memset(addrs[0], 77, ROWS * BLOCK)
        expect(b.push_blocks(cid, (1, 1, 0), [0, 1], [5, 6], layer0), 0, "push")
        expect(b.push_blocks(cid, (1, 1, 0), [2], [7], layer0), 0, "push again")
        expect(b.pull_blocks((1, 1, 0), cid, [5, 6, 7, 0], [0, 1, 2, 3], every), 0, "read back")
        assert all(block_is(addrs[0], r, 77) for r in range(3)) and block_is(addrs[0], 3, 10), "pushed bytes"
        expect(b.pull_blocks((1, 1, 0), cid, [ROWS], [0], every), 0x5010B005, "block past the end, plan kept")
        # the peer drops cache 1 and makes cache 2: the kept plan goes with cache 1's table entry
        peer.stdin.write("\n")
        peer.stdin.flush()
        assert peer.stdout.readline().split() == ["SWAPPED", "2"]
        # the table update travels on its own: until it is here, cache 1 still reads (0); once the
        # owner has deregistered its region but before the update is applied here, the transport
        # refuses the stale region (PARAM_INVALID, naming it); once it is here, NOT_EXIST
        deadline = time.monotonic() + 5
        seen = []
        while True:
            got = b.pull_blocks((1, 1, 0), cid, [0], [0], every)
            seen.append(got[0])
            if got[0] == 0x5010B005 and "not registered by its owner any more" not in got[1]:
                expect(got, NOT_EXIST, "pull from a cache the peer deallocated (an unexpected refusal)")
            if got[0] not in (0, 0x5010B005) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        expect(got, NOT_EXIST, f"pull from a cache the peer deallocated (statuses seen: {seen})")
        expect(b.push_blocks(cid, (1, 1, 0), [0], [0], layer0), NOT_EXIST, "push into it")
        expect(b.pull_blocks((1, 2, 0), cid, [3], [4], every), 0, "pull from the new cache")
        assert all(block_is(addrs[t], 4, 20 + t) for t in range(2)), "new cache's bytes"
        # a new link: plans of the old one are not used
        expect(b.unlink(cluster, 1000, False), 0, "unlink")
        expect(b.pull_blocks((1, 2, 0), cid, [0], [0], every), 0x5010B007, "pull after unlink")
        expect(b.link(cluster, 5000), 0, "relink")
        expect(b.pull_blocks((1, 2, 0), cid, [5], [6], every), 0, "pull over the new link")
        assert all(block_is(addrs[t], 6, 20 + t) for t in range(2)), "bytes over the new link"
        # the local cache deallocated
        expect(b.deallocate(cid), 0, "deallocate")
        expect(b.pull_blocks((1, 2, 0), cid, [0], [0], every), NOT_EXIST, "pull into a deallocated cache")
        expect(b.unlink(cluster, 1000, False), 0, "unlink")
        b.finalize()
        peer.stdin.write("\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "DONE"
        assert peer.wait(30) == 0
    finally:
        if peer.poll() is None:
            peer.kill()
    print("bridge_plans: passed", flush=True)


if __name__ == "__main__":
    main()
