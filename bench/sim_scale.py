"""How long N whole engines on one simulated world take for a simple workload (issue 38, docs/simulation-runtime.md).

Half the engines are prompts (a listener), half decoders; each decoder links to two prompts, then the
decoders pull ``--ops`` times in turn (2 seeded random blocks from one of its prompts, chosen by the
world's seed), each pull's bytes compared with the owner's; then every decoder unlinks and every
engine finalizes, and the world must be empty.  Prints one line: the phases' wall times, the world's
steps and simulated seconds, and its trace hash.

    python bench/sim_scale.py --engines 200 --ops 20000 [--seed S] [--latency] [--loss P]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMRole, LLMStatusCode
from llmdd.testing.sim import SimProcess, World

BLOCKS, ELEMS, BASE_PORT = 16, 64, 20000


def _options(listen: str | None) -> dict:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.enable_remote_cache_accessible = True
    if listen:
        cfg.listen_ip_info = listen
    return dict(cfg.generate_options())


def _cluster(cid: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cid
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", BASE_PORT + cid)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=200)
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--latency", action="store_true", help="every message takes 0.1-1 ms (seeded)")
    ap.add_argument("--loss", type=float, default=0.0, help="the chance a message is lost (retransmitted)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    world = World(args.seed)
    rng = np.random.default_rng(args.seed)
    if args.latency:
        world.net.latency = lambda _sock, _n: world.random.uniform(1e-4, 1e-3)
    world.net.loss = args.loss
    engines = []
    for i in range(args.engines):
        cid = i + 1
        role = LLMRole.PROMPT if i % 2 == 0 else LLMRole.DECODER
        proc = SimProcess(world, role, cid)
        proc.init(_options(f"127.0.0.1:{BASE_PORT + cid}" if role is LLMRole.PROMPT else None))
        buf = rng.standard_normal((BLOCKS, ELEMS)).astype(np.float32)
        cache = proc.dd.cache_manager.register_blocks_cache(CacheDesc(1, [BLOCKS, ELEMS], DataType.DT_FLOAT),
                                                            [buf.ctypes.data], BlocksCacheKey(cid, 0))
        engines.append((proc, buf, cache, cid))
    prompts, decoders = engines[0::2], engines[1::2]
    t1 = time.perf_counter()
    peers = {}
    for j, (proc, _buf, _cache, cid) in enumerate(decoders):
        mine = [prompts[j % len(prompts)], prompts[(j + 1) % len(prompts)]]
        code, codes = proc.dd.link_clusters([_cluster(p[3]) for p in mine], 5000)
        assert code is LLMStatusCode.LLM_SUCCESS, codes
        peers[cid] = mine
    t2 = time.perf_counter()
    r = world.random
    for k in range(args.ops):
        proc, buf, cache, cid = decoders[k % len(decoders)]
        peer = peers[cid][r.randrange(2)]
        src, dst = r.sample(range(BLOCKS), 2), r.sample(range(BLOCKS), 2)
        proc.dd.cache_manager.pull_blocks(BlocksCacheKey(peer[3], 0), cache, src_blocks=src, dst_blocks=dst)
        assert (buf[dst] == peer[1][src]).all(), (cid, peer[3], src, dst)
    t3 = time.perf_counter()
    for proc, _buf, _cache, cid in decoders:
        code, codes = proc.dd.unlink_clusters([_cluster(p[3]) for p in peers[cid]], 5000)
        assert code is LLMStatusCode.LLM_SUCCESS, codes
    for proc, *_ in engines:
        proc.finalize()
    world.settle()
    t4 = time.perf_counter()
    assert world.failures == [], world.failures[:3]
    assert not any(world.leftovers().values()), world.leftovers()
    print(f"sim_scale engines={args.engines} ops={args.ops} seed={args.seed} latency={args.latency} "
          f"loss={args.loss} init_s={t1 - t0:.2f} link_s={t2 - t1:.2f} ops_s={t3 - t2:.2f} "
          f"teardown_s={t4 - t3:.2f} total_s={t4 - t0:.2f} cpu_s={time.process_time():.2f} steps={world.steps} "
          f"sim_s={world.now - 1000.0:.3f} trace={world.trace_hash()}")


if __name__ == "__main__":
    main()
