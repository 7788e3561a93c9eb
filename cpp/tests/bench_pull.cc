// The C++ side of `llmdd bench`'s C++ row (llmdd/_tools/bench/cpp.py): a decoder that links to the
// bench's Python prompt and times PullKvBlocks, then prints one JSON line.
//   bench_pull <port> <latency_n> <latency_warmup> <tensors> <blocks> <bw_reps>
// The prompt's cache 1 is 1 tensor of 16 blocks of 64 KiB (one-block latency), cache 2 is
// <tensors> x <blocks> blocks of 64 KiB (bandwidth, all blocks, reversed). Word i of tensor t of
// cache 2 holds salt + (t * tensor_bytes) / 8 + i (llmdd/_tools/bench/common.py's pattern), checked here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"

using namespace llm_datadist;
using Clock = std::chrono::steady_clock;

namespace {
constexpr uint64_t kSalt = 0x5EED0000ULL;
constexpr int64_t kBlockInts = 16384;  // 64 KiB of DT_INT32

long RssBytes() {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == "VmRSS:") {
      long kib = 0;
      f >> kib;
      return kib * 1024;
    }
  }
  return -1;
}

int Fail(const char *what, Status s) {
  std::printf("{\"error\": \"%s failed: 0x%X %s\"}\n", what, s, llmdd::LastErrorMessage());
  return 1;
}
}  // namespace

int main(int argc, char **argv) {
  if (argc < 7) {
    return 2;
  }
  const uint16_t port = static_cast<uint16_t>(std::atoi(argv[1]));
  const int lat_n = std::atoi(argv[2]);
  const int lat_warmup = std::atoi(argv[3]);
  const uint32_t tensors = static_cast<uint32_t>(std::atoi(argv[4]));
  const int64_t blocks = std::atoll(argv[5]);
  const int reps = std::atoi(argv[6]);
  const size_t block_bytes = kBlockInts * 4;

  LlmDataDist dd(example::DECODER_CLUSTER_ID, LlmRole::kDecoder);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  const size_t pool = (16 + static_cast<size_t>(tensors) * blocks) * block_bytes + (16 << 20);
  options[OPTION_BUF_POOL_CFG] = ("{\"buf_pool_size\": " + std::to_string(pool) + "}").c_str();
  options[OPTION_SYNC_CACHE_WAIT_TIME] = "30000";
  Status s = dd.Initialize(options);
  if (s != LLM_SUCCESS) {
    return Fail("Initialize", s);
  }
  std::vector<Status> rets;
  s = dd.LinkLlmClusters({example::Cluster(example::PROMPT_CLUSTER_ID, "127.0.0.1", port)}, rets, 5000);
  if (s != LLM_SUCCESS) {
    return Fail("LinkLlmClusters", s);
  }
  CacheDesc one{};
  one.num_tensors = 1;
  one.data_type = DT_INT32;
  one.shape = {16, kBlockInts};
  CacheDesc many{};
  many.num_tensors = tensors;
  many.data_type = DT_INT32;
  many.shape = {blocks, kBlockInts};
  Cache lat_cache, bw_cache;
  if ((s = dd.AllocateCache(one, lat_cache)) != LLM_SUCCESS || (s = dd.AllocateCache(many, bw_cache)) != LLM_SUCCESS) {
    return Fail("AllocateCache", s);
  }
  for (auto addr : bw_cache.tensor_addrs) {  // pre-fault
    std::memset(reinterpret_cast<void *>(addr), 0, static_cast<size_t>(blocks) * block_bytes);
  }
  std::memset(reinterpret_cast<void *>(lat_cache.tensor_addrs[0]), 0, 16 * block_bytes);

  // the cost of one call into the engine that moves nothing (an unknown id unregistered: success)
  std::vector<double> call_us;
  for (int i = 0; i < lat_warmup + lat_n; ++i) {
    const auto t0 = Clock::now();
    s = dd.UnregisterKvCache(999999);
    const auto t1 = Clock::now();
    if (s != LLM_SUCCESS) {
      return Fail("UnregisterKvCache", s);
    }
    if (i >= lat_warmup) {
      call_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  std::sort(call_us.begin(), call_us.end());

  // one 64 KiB block, p50
  std::vector<double> us;
  const CacheIndex lat_src{example::PROMPT_CLUSTER_ID, 1, 0};
  for (int i = 0; i < lat_warmup + lat_n; ++i) {
    const uint64_t b = static_cast<uint64_t>(i % 16);
    const auto t0 = Clock::now();
    s = dd.PullKvBlocks(lat_src, lat_cache, {b}, {b});
    const auto t1 = Clock::now();
    if (s != LLM_SUCCESS) {
      return Fail("PullKvBlocks (latency)", s);
    }
    if (i >= lat_warmup) {
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  std::sort(us.begin(), us.end());
  const double p50 = us[us.size() / 2];
  const double p99 = us[std::min(us.size() - 1, static_cast<size_t>(us.size() * 0.99))];

  // all blocks of every tensor, reversed (no two consecutive blocks coalesce)
  std::vector<uint64_t> src(static_cast<size_t>(blocks)), dst(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    src[b] = static_cast<uint64_t>(b);
    dst[b] = static_cast<uint64_t>(blocks - 1 - b);
  }
  const CacheIndex bw_src{example::PROMPT_CLUSTER_ID, 2, 0};
  std::vector<double> gbps;
  const double nbytes = static_cast<double>(tensors) * blocks * block_bytes;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    s = dd.PullKvBlocks(bw_src, bw_cache, src, dst);
    const auto t1 = Clock::now();
    if (s != LLM_SUCCESS) {
      return Fail("PullKvBlocks (bandwidth)", s);
    }
    if (r > 0) {  // the first is the warm-up
      gbps.push_back(nbytes / std::chrono::duration<double>(t1 - t0).count() / 1e9);
    }
  }
  std::sort(gbps.begin(), gbps.end());
  bool verified = true;
  const size_t words_per_block = block_bytes / 8;
  const uint64_t tensor_words = static_cast<uint64_t>(blocks) * words_per_block;
  for (uint32_t t = 0; t < tensors && verified; ++t) {
    const auto *w = reinterpret_cast<const uint64_t *>(bw_cache.tensor_addrs[t]);
    for (int64_t b = 0; b < blocks && verified; ++b) {
      const uint64_t base = kSalt + t * tensor_words + src[b] * words_per_block;
      const uint64_t *blk = w + dst[b] * words_per_block;
      for (size_t i = 0; i < words_per_block; i += 509) {  // a sample of every block
        if (blk[i] != base + i) {
          verified = false;
          break;
        }
      }
      if (blk[words_per_block - 1] != base + words_per_block - 1) {
        verified = false;
      }
    }
  }
  const long rss = RssBytes();
  std::vector<Status> unlink_rets;
  (void)dd.UnlinkLlmClusters({example::Cluster(example::PROMPT_CLUSTER_ID, "127.0.0.1", port)}, unlink_rets);
  dd.Finalize();
  std::printf("{\"p50_us\": %.3f, \"p99_us\": %.3f, \"n\": %zu, \"call_p50_us\": %.3f, \"gbps\": %.4f, "
              "\"gbps_all\": [", p50, p99, us.size(), call_us[call_us.size() / 2], gbps[gbps.size() / 2]);
  for (size_t i = 0; i < gbps.size(); ++i) {
    std::printf("%s%.4f", i ? ", " : "", gbps[i]);
  }
  std::printf("], \"bytes\": %.0f, \"verified\": %s, \"rss_bytes\": %ld}\n", nbytes, verified ? "true" : "false", rss);
  return verified ? 0 : 1;
}
