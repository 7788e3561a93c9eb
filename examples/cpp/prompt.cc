// Prompt side of the LLM-DataDist C++ guide on llmdd: listens, allocates caches the decoder
// pulls (by cache and by blocks), pushes a cache and blocks into the decoder, unlinks with force.
// Usage: prompt <listen_port> ; paced by one-word commands on stdin (docs/cpp.md, "Running the examples":
// cpp/tests/run_case.py drives both programs, or type the commands by hand as each program asks).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"

using namespace llm_datadist;
using namespace example;

namespace {
int Failed(const char *what, Status ret) {
  std::printf("[ERROR] %s failed, ret = %u (%s)\n", what, ret, llmdd::LastErrorMessage());
  std::fflush(stdout);
  return -1;
}

void OnError(LlmDataDist &llm_data_dist, std::vector<Cache> &caches) {
  for (auto &cache : caches) {
    if (cache.cache_id > 0) {
      (void)llm_data_dist.DeallocateCache(cache.cache_id);
    }
  }
  llm_data_dist.Finalize();
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::printf("usage: %s <listen_port>\n%s\n", argv[0], kPacing);
    return 2;
  }
  const std::string port = argv[1];
  LlmDataDist llm_data_dist(PROMPT_CLUSTER_ID, LlmRole::kPrompt);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_LISTEN_IP_INFO] = ("127.0.0.1:" + port).c_str();
  // the guide's pool is 2 GiB; 64 MiB is plenty here (it is reserved shared memory)
  options[OPTION_BUF_POOL_CFG] = R"({
    "buf_cfg":[{"total_size":2097152,"blk_size":256,"max_buf_size":8192}],
    "buf_pool_size": 67108864
  })";
  auto ret = llm_data_dist.Initialize(options);
  if (ret != LLM_SUCCESS) {
    return Failed("Initialize", ret);
  }

  // caches 1..4: pulled by cache, pulled by blocks, pushed by cache, pushed by blocks
  std::vector<Cache> caches(4);
  for (size_t i = 0; i < caches.size(); ++i) {
    CacheDesc kv_cache_desc{};
    kv_cache_desc.num_tensors = NUM_TENSORS;
    kv_cache_desc.data_type = DT_INT32;
    kv_cache_desc.shape = {8, 16};
    ret = llm_data_dist.AllocateCache(kv_cache_desc, caches[i]);
    if (ret != LLM_SUCCESS) {
      Failed("AllocateCache", ret);
      OnError(llm_data_dist, caches);
      return -1;
    }
    Fill(caches[i], 10U + i);  // "full inference" writes the caches
  }
  Say("READY");

  if (Expect("PUSH", "once the decoder printed PULLED") != "PUSH") {
    OnError(llm_data_dist, caches);
    return -1;
  }
  // push layer 0 of batch slot 0 of cache 3 into the decoder's cache 3
  CacheIndex dst_cache_index{DECODER_CLUSTER_ID, 3, 0};
  KvCacheExtParam ext_param{};
  ext_param.src_layer_range = std::pair<int32_t, int32_t>(0, 0);
  ext_param.dst_layer_range = std::pair<int32_t, int32_t>(0, 0);
  ext_param.tensor_num_per_layer = 2;
  ret = llm_data_dist.PushKvCache(caches[2], dst_cache_index, 0, -1, ext_param);
  if (ret != LLM_SUCCESS) {
    Failed("PushKvCache", ret);
    OnError(llm_data_dist, caches);
    return -1;
  }
  // push layer 0 of blocks {0,1,2,3} of cache 4 into blocks {3,2,1,0} of the decoder's cache 4
  CacheIndex dst_blocks_index{DECODER_CLUSTER_ID, 4};
  std::vector<uint64_t> prompt_blocks = {0, 1, 2, 3};
  std::vector<uint64_t> decoder_blocks = {3, 2, 1, 0};
  ret = llm_data_dist.PushKvBlocks(caches[3], dst_blocks_index, prompt_blocks, decoder_blocks, ext_param);
  if (ret != LLM_SUCCESS) {
    Failed("PushKvBlocks", ret);
    OnError(llm_data_dist, caches);
    return -1;
  }
  Say("PUSHED");

  // the decoder unlinks, relinks; then both sides unlink with force
  if (Expect("FORCE", "once the decoder printed VERIFIED") != "FORCE") {
    OnError(llm_data_dist, caches);
    return -1;
  }
  std::vector<Status> rets;
  std::vector<ClusterInfo> clusters;
  ClusterInfo cluster_info;
  cluster_info.remote_cluster_id = DECODER_CLUSTER_ID;  // a forced unlink needs no address
  clusters.emplace_back(std::move(cluster_info));
  ret = llm_data_dist.UnlinkLlmClusters(clusters, rets, 1000, true);
  if (ret != LLM_SUCCESS) {
    Failed("UnlinkLlmClusters(force)", ret);
    OnError(llm_data_dist, caches);
    return -1;
  }
  for (const auto &inner_ret : rets) {
    if (inner_ret != LLM_SUCCESS) {
      Failed("UnlinkLlmClusters(force) of a cluster", inner_ret);
      OnError(llm_data_dist, caches);
      return -1;
    }
  }
  Say("UNLINKED");

  for (auto &cache : caches) {
    ret = llm_data_dist.DeallocateCache(cache.cache_id);
    if (ret != LLM_SUCCESS) {
      return Failed("DeallocateCache", ret);
    }
  }
  llm_data_dist.Finalize();
  Say("DONE");
  return 0;
}
