// A C++ decoder against a Python prompt (py_peer.py serve): pulls by cache and by blocks with
// layer ranges and sizes, pushes and reads back, the remote error statuses (cache not exist, bad
// indices, not linked, already linked), several C++ threads pulling at once, and the statuses after Finalize.
// Usage: remote_checks <prompt_port>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"

using namespace llm_datadist;
using namespace example;

namespace {
int g_failures = 0;
#define CHECK_EQ(got, want)                                                                            \
  do {                                                                                                 \
    const auto _g = (got);                                                                             \
    const auto _w = (want);                                                                            \
    if (_g != _w) {                                                                                    \
      std::printf("[ERROR] %s:%d: %s = 0x%X, want 0x%X (last error: %s)\n", __FILE__, __LINE__, #got,  \
                  static_cast<unsigned>(_g), static_cast<unsigned>(_w), llmdd::LastErrorMessage());    \
      std::fflush(stdout);                                                                             \
      ++g_failures;                                                                                    \
    }                                                                                                  \
  } while (0)
#define CHECK(cond) CHECK_EQ(static_cast<bool>(cond), true)

CacheDesc Desc(int64_t rows) {
  CacheDesc desc{};
  desc.num_tensors = NUM_TENSORS;
  desc.data_type = DT_INT32;
  desc.shape = {rows, 16};
  return desc;
}

bool Equal(const Cache &a, uint32_t t, size_t a_off, const Cache &b, size_t b_off, size_t len) {
  return std::memcmp(reinterpret_cast<const uint8_t *>(a.tensor_addrs[t]) + a_off,
                     reinterpret_cast<const uint8_t *>(b.tensor_addrs[t]) + b_off, len) == 0;
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    return 2;
  }
  const uint16_t port = static_cast<uint16_t>(std::atoi(argv[1]));
  LlmDataDist dd(DECODER_CLUSTER_ID, LlmRole::kDecoder);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_BUF_POOL_CFG] = R"({"buf_pool_size": 16777216})";
  options[OPTION_SYNC_CACHE_WAIT_TIME] = "5000";
  options[OPTION_ENABLE_SET_ROLE] = "1";
  CHECK_EQ(dd.Initialize(options), LLM_SUCCESS);
  std::vector<ClusterInfo> clusters{Cluster(PROMPT_CLUSTER_ID, "127.0.0.1", port)};
  std::vector<Status> rets;
  CHECK_EQ(dd.LinkLlmClusters(clusters, rets, 3000), LLM_SUCCESS);
  CHECK_EQ(rets.size(), static_cast<size_t>(1));

  Cache d1, d3, back;
  CHECK_EQ(dd.AllocateCache(Desc(8), d1), LLM_SUCCESS);
  CHECK_EQ(dd.AllocateCache(Desc(64), d3), LLM_SUCCESS);
  CHECK_EQ(dd.AllocateCache(Desc(8), back), LLM_SUCCESS);
  Fill(d1, 90);

  // the prompt's cache 1 (a Python non-blocks cache): slot 3 into slot 5
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 3}, d1, 5), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Same(d1, t, 5 * kBlockBytes, 10, 3 * kBlockBytes, kBlockBytes));
    CHECK(Same(d1, t, 0, 90, 0, 5 * kBlockBytes));
  }
  // layer 1 (tensors 2, 3) of slot 0 into layer 0 (tensors 0, 1) of slot 0
  Fill(d1, 90);
  KvCacheExtParam ext{};
  ext.src_layer_range = {1, 1};
  ext.dst_layer_range = {0, 0};
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 0}, d1, 0, -1, ext), LLM_SUCCESS);
  for (uint32_t t = 0; t < 2; ++t) {
    const auto want = Pattern(10, t + 2, kTensorBytes);
    CHECK(std::memcmp(reinterpret_cast<const uint8_t *>(d1.tensor_addrs[t]), want.data(), kBlockBytes) == 0);
    CHECK(Same(d1, t + 2, 0, 90, 0, kTensorBytes));
  }
  // 32 bytes only
  Fill(d1, 90);
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 0}, d1, 1, 32), LLM_SUCCESS);
  CHECK(Same(d1, 0, kBlockBytes, 10, 0, 32));
  CHECK(Same(d1, 0, kBlockBytes + 32, 90, kBlockBytes + 32, 32));
  // blocks of the prompt's blocks cache 2
  Fill(d1, 90);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, d1, {7, 0}, {0, 7}), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Same(d1, t, 0, 11, 7 * kBlockBytes, kBlockBytes));
    CHECK(Same(d1, t, 7 * kBlockBytes, 11, 0, kBlockBytes));
    CHECK(Same(d1, t, kBlockBytes, 90, kBlockBytes, 6 * kBlockBytes));
  }

  // remote errors; nothing lands
  Fill(d1, 90);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 77, 0}, d1, {0}, {0}), LLM_KV_CACHE_NOT_EXIST);
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 77, 0}, d1), LLM_KV_CACHE_NOT_EXIST);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, d1, {8}, {0}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, d1, {0}, {8}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 8}, d1), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 0}, d1, 8), LLM_PARAM_INVALID);
  ext.src_layer_range = {2, 2};
  ext.dst_layer_range = {0, 0};
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, d1, {0}, {0}, ext), LLM_PARAM_INVALID);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Same(d1, t, 0, 90, 0, kTensorBytes));
  }

  // a decoder does not push; as a mix engine (SetRole needs no link) it does
  CHECK_EQ(dd.PushKvBlocks(d1, CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, {1, 2}, {5, 6}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.SetRole(LlmRole::kMix), LLM_EXIST_LINK);
  CHECK_EQ(dd.UnlinkLlmClusters(clusters, rets), LLM_SUCCESS);
  CHECK_EQ(dd.SetRole(LlmRole::kMix), LLM_SUCCESS);
  CHECK_EQ(dd.LinkLlmClusters(clusters, rets, 3000), LLM_SUCCESS);
  CHECK_EQ(dd.PushKvBlocks(d1, CacheIndex{PROMPT_CLUSTER_ID, 77, 0}, {0}, {0}), LLM_KV_CACHE_NOT_EXIST);
  CHECK_EQ(dd.PushKvBlocks(d1, CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, {0}, {9}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PushKvCache(d1, CacheIndex{PROMPT_CLUSTER_ID, 77, 0}), LLM_KV_CACHE_NOT_EXIST);
  CHECK_EQ(dd.PushKvCache(d1, CacheIndex{PROMPT_CLUSTER_ID, 1, 8}), LLM_PARAM_INVALID);     // no slot 8 there
  CHECK_EQ(dd.PushKvCache(d1, CacheIndex{PROMPT_CLUSTER_ID, 1, 0}, 8), LLM_PARAM_INVALID);  // no slot 8 here
  CHECK_EQ(dd.PushKvCache(Cache{}, CacheIndex{PROMPT_CLUSTER_ID, 1, 0}), LLM_KV_CACHE_NOT_EXIST);
  // none of the refused pushes landed: the prompt's cache 1 still holds its seed
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 0}, back, 0), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Same(back, t, 0, 10, 0, kBlockBytes));
  }
  // linking a cluster already linked: LLM_ALREADY_LINK for it, the link stays usable
  CHECK_EQ(dd.LinkLlmClusters(clusters, rets, 3000), LLM_ALREADY_LINK);
  CHECK(rets.size() == 1U && rets[0] == LLM_ALREADY_LINK);

  // push, then read back what landed on the prompt
  CHECK_EQ(dd.PushKvBlocks(d1, CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, {1, 2}, {5, 6}), LLM_SUCCESS);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, back, {5, 6}, {0, 1}), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Equal(back, t, 0, d1, kBlockBytes, 2 * kBlockBytes));
  }
  CHECK_EQ(dd.PushKvCache(d1, CacheIndex{PROMPT_CLUSTER_ID, 1, 2}, 4), LLM_SUCCESS);
  CHECK_EQ(dd.PullKvCache(CacheIndex{PROMPT_CLUSTER_ID, 1, 2}, back, 3), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Equal(back, t, 3 * kBlockBytes, d1, 4 * kBlockBytes, kBlockBytes));
  }

  // several C++ threads pulling at once: thread i pulls blocks 8i..8i+7 of the prompt's cache 3
  // (64 blocks) reversed into the same 8 blocks of d3, 10 times
  Fill(d3, 95, 64 * kBlockBytes);
  constexpr int kThreads = 8;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i]() {
      std::vector<uint64_t> src, dst;
      for (uint64_t b = 0; b < 8; ++b) {
        src.push_back(8U * i + b);
        dst.push_back(8U * i + 7U - b);
      }
      for (int round = 0; round < 10; ++round) {
        if (dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 3, 0}, d3, src, dst) != LLM_SUCCESS) {
          ++bad;
        }
      }
    });
  }
  for (auto &th : threads) {
    th.join();
  }
  CHECK_EQ(bad.load(), 0);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    for (uint64_t b = 0; b < 64; ++b) {
      const uint64_t src_block = (b / 8) * 8 + 7 - (b % 8);
      CHECK(Same(d3, t, b * kBlockBytes, 12, src_block * kBlockBytes, kBlockBytes, 64 * kBlockBytes));
    }
  }

  // unlinked: not linked; finalized: failed
  CHECK_EQ(dd.UnlinkLlmClusters(clusters, rets), LLM_SUCCESS);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, d1, {0}, {0}), LLM_NOT_YET_LINK);
  CHECK_EQ(dd.PushKvCache(d1, CacheIndex{PROMPT_CLUSTER_ID, 1, 0}), LLM_NOT_YET_LINK);
  std::vector<ClusterInfo> force_clusters(1);
  force_clusters[0].remote_cluster_id = PROMPT_CLUSTER_ID;
  const Status force = dd.UnlinkLlmClusters(force_clusters, rets, 1000, true);
  std::printf("force unlink of a cluster no longer linked: 0x%X\n", force);
  dd.Finalize();
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, d1, {0}, {0}), LLM_FAILED);
  std::printf("%d failure(s)\n", g_failures);
  Say(g_failures == 0 ? "DONE" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}
