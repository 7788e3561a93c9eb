// A C++ host that runs its own embedded Python interpreter and uses libllm_datadist: the
// library must use that interpreter (no second one), work from the thread holding the GIL and
// from other threads once the host releases it, and leave the host's interpreter usable.
#include <Python.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"

using namespace llm_datadist;
using namespace example;

int main() {
  Py_Initialize();
  if (PyRun_SimpleString("host_marker = 42") != 0) {
    return 1;
  }
  int failures = 0;
  LlmDataDist dd(PROMPT_CLUSTER_ID, LlmRole::kMix);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_BUF_POOL_CFG] = R"({"buf_pool_size": 16777216})";
  // called while this thread holds the GIL
  if (dd.Initialize(options) != LLM_SUCCESS) {
    std::printf("[ERROR] Initialize: %s\n", llmdd::LastErrorMessage());
    return 1;
  }
  CacheDesc desc{};
  desc.num_tensors = NUM_TENSORS;
  desc.data_type = DT_INT32;
  desc.shape = {8, 16};
  Cache src, dst;
  if (dd.AllocateCache(desc, src) != LLM_SUCCESS || dd.AllocateCache(desc, dst) != LLM_SUCCESS) {
    std::printf("[ERROR] AllocateCache: %s\n", llmdd::LastErrorMessage());
    return 1;
  }
  Fill(src, 5);
  Fill(dst, 6);
  PyThreadState *saved = PyEval_SaveThread();  // the host releases the GIL; other threads call in
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i]() {
      for (int round = 0; round < 50; ++round) {
        if (dd.CopyKvBlocks(src, dst, {static_cast<uint64_t>(i)}, {{static_cast<uint64_t>(7 - i)}}) != LLM_SUCCESS) {
          ++bad;
        }
      }
    });
  }
  for (auto &t : threads) {
    t.join();
  }
  if (bad.load() != 0) {
    std::printf("[ERROR] %d copies failed\n", bad.load());
    ++failures;
  }
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    for (uint64_t i = 0; i < 4; ++i) {
      if (!Same(dst, t, (7 - i) * kBlockBytes, 5, i * kBlockBytes, kBlockBytes) ||
          !Same(dst, t, i * kBlockBytes, 6, i * kBlockBytes, kBlockBytes)) {
        std::printf("[ERROR] copied bytes differ\n");
        ++failures;
      }
    }
  }
  dd.Finalize();
  PyEval_RestoreThread(saved);
  // one interpreter: the host's globals are intact and llmdd was loaded into it
  if (PyRun_SimpleString("import sys\n"
                         "assert host_marker == 42\n"
                         "assert 'llmdd' in sys.modules and 'llmdd_cpp_bridge' in sys.modules\n") != 0) {
    std::printf("[ERROR] the host interpreter does not hold llmdd\n");
    ++failures;
  }
  if (Py_FinalizeEx() != 0) {
    std::printf("[ERROR] Py_FinalizeEx failed\n");
    ++failures;
  }
  Say(failures == 0 ? "DONE" : "FAILED");
  return failures == 0 ? 0 : 1;
}
