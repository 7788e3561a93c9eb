"""A decoder-side client written against upstream ``llm_datadist``, unchanged."""
import sys

import numpy as np
import llm_datadist
from llm_datadist import (BlocksCacheKey, CacheDesc, LLMClusterInfo, LLMConfig, LLMDataDist, LLMException,
                          LLMRole, LLMStatusCode)

port = int(sys.argv[1])
prompt_cluster = int(sys.argv[2])
config = LLMConfig()
config.device_id = 0
config.local_comm_res = ""
config.sync_kv_timeout = 5000
config.enable_remote_cache_accessible = True
engine = LLMDataDist(LLMRole.DECODER, 7)
engine.init(config.generate_options())
dst = np.zeros((2, 16 * 4096 * 4), dtype=np.uint8)
cache = engine.cache_manager.register_blocks_cache(
    CacheDesc(2, [16, 4096 * 4], llm_datadist.DataType.DT_UINT8), [int(dst[0].ctypes.data), int(dst[1].ctypes.data)],
    None)
info = LLMClusterInfo()
info.remote_cluster_id = prompt_cluster
info.append_local_ip_info("127.0.0.1", 0)
info.append_remote_ip_info("127.0.0.1", port)
ret, _ = engine.link_clusters([info], timeout=5000)
if ret != LLMStatusCode.LLM_SUCCESS:
    raise Exception("link failed")
src_blocks, dst_blocks = [3, 4, 5, 0], [0, 9, 10, 15]
engine.cache_manager.pull_blocks(BlocksCacheKey(prompt_cluster, 0), cache, src_blocks, dst_blocks)
expected = (np.arange(2 * 16 * 4096, dtype=np.uint32).reshape(2, 16 * 4096) % 251).view(np.uint8)
block = 4096 * 4
for s, d in zip(src_blocks, dst_blocks):
    assert (dst[:, d * block:(d + 1) * block] == expected[:, s * block:(s + 1) * block]).all()
try:
    engine.cache_manager.pull_blocks(BlocksCacheKey(prompt_cluster + 1, 0), cache, [0], [0])
except LLMException as e:
    assert e.status_code in (LLMStatusCode.LLM_NOT_YET_LINK,)
print("PULLED OK", flush=True)
ret, _ = engine.unlink_clusters([info], timeout=5000, force=True)
assert ret == LLMStatusCode.LLM_SUCCESS
