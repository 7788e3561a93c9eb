"""A prompt-side client written against upstream ``llm_datadist`` (omni-infer gen 2 style), unchanged."""
import sys
import time

import numpy as np
import llm_datadist
from llm_datadist import BlocksCacheKey, CacheDesc, LLMConfig, LLMDataDist, LLMRole
from llm_datadist.v2.llm_types import Cache  # noqa: F401  (omni-infer imports from here)

port = int(sys.argv[1])
cluster_id = int(sys.argv[2])
config = LLMConfig()
config.device_id = 0
config.local_comm_res = ""
config.sync_kv_timeout = 5000
config.enable_remote_cache_accessible = True
config.listen_ip_info = f"127.0.0.1:{port}"
engine = LLMDataDist(LLMRole.PROMPT, cluster_id)
engine.init(config.generate_options())
kv = np.arange(2 * 16 * 4096, dtype=np.uint32).reshape(2, 16 * 4096) % 251
cache = engine.cache_manager.register_blocks_cache(
    CacheDesc(num_tensors=2, shape=(16, 4096 * 4), data_type=llm_datadist.DataType.DT_UINT8),
    [int(kv[0].ctypes.data), int(kv[1].ctypes.data)], BlocksCacheKey(engine.cluster_id, model_id=0))
print("READY", flush=True)
sys.stdin.readline()  # the decoder is done
# no finalize: the client relies on the exit handler, as vllm-ascend does
