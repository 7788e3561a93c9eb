// Decoder side of the LLM-DataDist C++ guide on llmdd: links to the prompt, pulls a cache and
// blocks {0,1,2,3} -> {3,2,1,0}, checks what the prompt pushed, unlinks, relinks, force-unlinks.
// Usage: decoder <prompt_port> ; paced by one-word commands on stdin (docs/cpp.md, "Running the examples":
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

int Mismatch(const char *what) {
  std::printf("[ERROR] %s: bytes differ\n", what);
  std::fflush(stdout);
  return -1;
}

Status Link(LlmDataDist &llm_data_dist, const std::vector<ClusterInfo> &clusters) {
  std::vector<Status> rets;
  // 3 s instead of the 1 s default: the first link also sets up the transports, which takes
  // longer than a second on a loaded 2-core CI machine (seen: LLM_LINK_FAILED at 1 s)
  auto ret = llm_data_dist.LinkLlmClusters(clusters, rets, 3000);
  if (ret != LLM_SUCCESS) {
    return ret;
  }
  for (const auto &inner_ret : rets) {
    if (inner_ret != LLM_SUCCESS) {
      return inner_ret;
    }
  }
  return LLM_SUCCESS;
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::printf("usage: %s <prompt_port>\n%s\n", argv[0], kPacing);
    return 2;
  }
  const uint16_t port = static_cast<uint16_t>(std::atoi(argv[1]));
  LlmDataDist llm_data_dist(DECODER_CLUSTER_ID, LlmRole::kDecoder);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_BUF_POOL_CFG] = R"({ "buf_pool_size": 67108864 })";
  auto ret = llm_data_dist.Initialize(options);
  if (ret != LLM_SUCCESS) {
    return Failed("Initialize", ret);
  }
  std::vector<ClusterInfo> clusters;
  clusters.emplace_back(Cluster(PROMPT_CLUSTER_ID, "127.0.0.1", port));
  ret = Link(llm_data_dist, clusters);
  if (ret != LLM_SUCCESS) {
    return Failed("LinkLlmClusters", ret);
  }

  std::vector<Cache> caches(4);
  for (size_t i = 0; i < caches.size(); ++i) {
    CacheDesc kv_cache_desc{};
    kv_cache_desc.num_tensors = NUM_TENSORS;
    kv_cache_desc.data_type = DT_INT32;
    kv_cache_desc.shape = {8, 16};
    ret = llm_data_dist.AllocateCache(kv_cache_desc, caches[i]);
    if (ret != LLM_SUCCESS) {
      return Failed("AllocateCache", ret);
    }
    Fill(caches[i], 90U + i);  // stale contents: a transfer that does nothing is caught
  }

  // pull batch slot 0 of the prompt's cache 1 into slot 0 of cache 1
  CacheIndex cache_index{PROMPT_CLUSTER_ID, 1, 0};
  ret = llm_data_dist.PullKvCache(cache_index, caches[0], 0);
  if (ret != LLM_SUCCESS) {
    return Failed("PullKvCache", ret);
  }
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    if (!Same(caches[0], t, 0, 10U, 0, kBlockBytes) ||
        !Same(caches[0], t, kBlockBytes, 90U, kBlockBytes, kTensorBytes - kBlockBytes)) {
      return Mismatch("PullKvCache");
    }
  }
  // pull blocks {0,1,2,3} of the prompt's cache 2 into blocks {3,2,1,0} of cache 2
  CacheIndex blocks_index{PROMPT_CLUSTER_ID, 2, 0};
  std::vector<uint64_t> prompt_blocks = {0, 1, 2, 3};
  std::vector<uint64_t> decoder_blocks = {3, 2, 1, 0};
  ret = llm_data_dist.PullKvBlocks(blocks_index, caches[1], prompt_blocks, decoder_blocks);
  if (ret != LLM_SUCCESS) {
    return Failed("PullKvBlocks", ret);
  }
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    for (size_t i = 0; i < prompt_blocks.size(); ++i) {
      if (!Same(caches[1], t, decoder_blocks[i] * kBlockBytes, 11U, prompt_blocks[i] * kBlockBytes, kBlockBytes)) {
        return Mismatch("PullKvBlocks");
      }
    }
    if (!Same(caches[1], t, 4 * kBlockBytes, 91U, 4 * kBlockBytes, 4 * kBlockBytes)) {
      return Mismatch("PullKvBlocks (blocks not named)");
    }
  }
  Say("PULLED");

  // the prompt pushed layer 0 (tensors 0, 1): slot 0 of cache 3, blocks {0..3} -> {3..0} of cache 4
  if (Expect("VERIFY", "once the prompt printed PUSHED") != "VERIFY") {
    return -1;
  }
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    const bool pushed = t < 2;
    if (!Same(caches[2], t, 0, pushed ? 12U : 92U, 0, kBlockBytes) ||
        !Same(caches[2], t, kBlockBytes, 92U, kBlockBytes, kTensorBytes - kBlockBytes)) {
      return Mismatch("PushKvCache");
    }
    for (size_t i = 0; i < prompt_blocks.size(); ++i) {
      const size_t at = decoder_blocks[i] * kBlockBytes;
      if (!Same(caches[3], t, at, pushed ? 13U : 93U, pushed ? prompt_blocks[i] * kBlockBytes : at, kBlockBytes)) {
        return Mismatch("PushKvBlocks");
      }
    }
  }
  for (auto &cache : caches) {
    ret = llm_data_dist.DeallocateCache(cache.cache_id);
    if (ret != LLM_SUCCESS) {
      return Failed("DeallocateCache", ret);
    }
  }

  // unlink (no fault: the decoder asks the prompt), relink, then unlink with force on both sides
  std::vector<Status> rets;
  ret = llm_data_dist.UnlinkLlmClusters(clusters, rets);
  if (ret != LLM_SUCCESS) {
    return Failed("UnlinkLlmClusters", ret);
  }
  for (const auto &inner_ret : rets) {
    if (inner_ret != LLM_SUCCESS) {
      return Failed("UnlinkLlmClusters of a cluster", inner_ret);
    }
  }
  ret = Link(llm_data_dist, clusters);
  if (ret != LLM_SUCCESS) {
    return Failed("LinkLlmClusters (again)", ret);
  }
  Say("VERIFIED");
  if (Expect("FORCE", "once the prompt printed UNLINKED") != "FORCE") {
    return -1;
  }
  ret = llm_data_dist.UnlinkLlmClusters(clusters, rets, 1000, true);
  if (ret != LLM_SUCCESS) {
    return Failed("UnlinkLlmClusters(force)", ret);
  }
  for (const auto &inner_ret : rets) {
    if (inner_ret != LLM_SUCCESS) {
      return Failed("UnlinkLlmClusters(force) of a cluster", inner_ret);
    }
  }
  Say("UNLINKED");
  llm_data_dist.Finalize();
  Say("DONE");
  return 0;
}
