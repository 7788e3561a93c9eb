// Links to a Python prompt, pulls, leaves a C++ thread pulling in a loop, and returns from main
// without Finalize (the LlmDataDist is never destroyed). run_case.py checks that the process
// exits promptly and leaves no shared-memory segment behind.
// Usage: exit_without_finalize <prompt_port>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"

using namespace llm_datadist;
using namespace example;

int main(int argc, char **argv) {
  if (argc < 2) {
    return 2;
  }
  auto *dd = new LlmDataDist(DECODER_CLUSTER_ID, LlmRole::kDecoder);  // deliberately never deleted
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_BUF_POOL_CFG] = R"({"buf_pool_size": 16777216})";
  options[OPTION_LISTEN_IP_INFO] = "127.0.0.1:0";
  std::vector<Status> rets;
  Cache cache;
  CacheDesc desc{};
  desc.num_tensors = NUM_TENSORS;
  desc.data_type = DT_INT32;
  desc.shape = {8, 16};
  // "thread": Initialize (which starts the interpreter) on a thread that ends before main returns
  Status init = LLM_FAILED;
  if (argc > 2 && std::string(argv[2]) == "thread") {
    std::thread([&]() { init = dd->Initialize(options); }).join();
  } else {
    init = dd->Initialize(options);
  }
  if (init != LLM_SUCCESS ||
      dd->LinkLlmClusters({Cluster(PROMPT_CLUSTER_ID, "127.0.0.1", static_cast<uint16_t>(std::atoi(argv[1])))},
                          rets, 3000) != LLM_SUCCESS ||
      dd->AllocateCache(desc, cache) != LLM_SUCCESS ||
      dd->PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, cache, {0, 1}, {1, 0}) != LLM_SUCCESS) {
    std::printf("[ERROR] setup failed: %s\n", llmdd::LastErrorMessage());
    return 1;
  }
  if (!Same(cache, 0, 0, 11, kBlockBytes, kBlockBytes)) {
    std::printf("[ERROR] pulled bytes differ\n");
    return 1;
  }
  if (argc > 2 && std::string(argv[2]) == "quiet") {
    Say("EXITING");
    return 0;
  }
  std::thread([dd, cache]() {
    for (;;) {
      (void)dd->PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 2, 0}, cache, {2}, {2});
    }
  }).detach();
  Say("EXITING");
  return 0;
}
