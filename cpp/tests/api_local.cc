// One-process tests of libllm_datadist: every method's success path and its error statuses that
// need no peer (not initialized, bad arguments, bad indices, cache not exist, not linked, after
// Finalize), malformed OPTION_BUF_POOL_CFG leaving nothing behind, Initialize again after Finalize.
//   api_local              all of the above
//   api_local bad_python   (with LLMDD_PYTHON pointing nowhere) Initialize fails with a message
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "llm_datadist/llm_datadist.h"
#include "llm_datadist/llmdd_ext.h"

using namespace llm_datadist;
using namespace example;

namespace {
int g_failures = 0;

#define CHECK(cond)                                                                                       \
  do {                                                                                                    \
    if (!(cond)) {                                                                                        \
      std::printf("[ERROR] %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond,                      \
                  llmdd::LastErrorMessage());                                                             \
      std::fflush(stdout);                                                                                \
      ++g_failures;                                                                                       \
    }                                                                                                     \
  } while (0)
#define CHECK_EQ(got, want)                                                                               \
  do {                                                                                                    \
    const auto _g = (got);                                                                                \
    const auto _w = (want);                                                                               \
    if (_g != _w) {                                                                                       \
      std::printf("[ERROR] %s:%d: %s = 0x%X, want 0x%X (last error: %s)\n", __FILE__, __LINE__, #got,     \
                  static_cast<unsigned>(_g), static_cast<unsigned>(_w), llmdd::LastErrorMessage());       \
      std::fflush(stdout);                                                                                \
      ++g_failures;                                                                                       \
    }                                                                                                     \
  } while (0)

int SegmentsOfThisProcess() {
  const std::string prefix = "llmdd_" + std::to_string(getpid()) + "_";
  int n = 0;
  DIR *dir = opendir("/dev/shm");
  if (dir == nullptr) {
    return 0;
  }
  while (dirent *e = readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) {
      ++n;
    }
  }
  closedir(dir);
  return n;
}

bool PortFree(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr *>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::map<AscendString, AscendString> Options(uint16_t port, const char *pool) {
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  options[OPTION_LISTEN_IP_INFO] = ("127.0.0.1:" + std::to_string(port)).c_str();
  options[OPTION_BUF_POOL_CFG] = pool;
  options[OPTION_ENABLE_SET_ROLE] = "1";
  return options;
}

CacheDesc Desc(int64_t rows = 8, CachePlacement placement = CachePlacement::kDevice) {
  CacheDesc desc{};
  desc.placement = placement;
  desc.num_tensors = NUM_TENSORS;
  desc.data_type = DT_INT32;
  desc.shape = {rows, 16};
  return desc;
}

int BadPython() {
  LlmDataDist dd(PROMPT_CLUSTER_ID, LlmRole::kPrompt);
  std::map<AscendString, AscendString> options;
  options[OPTION_DEVICE_ID] = "0";
  CHECK_EQ(dd.Initialize(options), LLM_FAILED);
  const std::string msg = llmdd::LastErrorMessage();
  std::printf("message: %s\n", msg.c_str());
  CHECK(msg.find("cannot import llmdd") != std::string::npos);
  CHECK(msg.find("LLMDD_PYTHON") != std::string::npos);
  CHECK_EQ(dd.Initialize(options), LLM_FAILED);  // a retry fails the same way, no crash
  Cache cache;
  CHECK_EQ(dd.AllocateCache(Desc(), cache), LLM_FAILED);
  dd.Finalize();
  return g_failures;
}
}  // namespace

int main(int argc, char **argv) {
  if (argc > 1 && std::string(argv[1]) == "bad_python") {
    const int failures = BadPython();
    Say(failures == 0 ? "DONE" : "FAILED");
    return failures == 0 ? 0 : 1;
  }
  const uint16_t port = FreePort();
  const char *pool = R"({"buf_cfg":[{"total_size":2097152,"blk_size":256,"max_buf_size":8192}],
                         "buf_pool_size": 16777216})";
  LlmDataDist dd(PROMPT_CLUSTER_ID, LlmRole::kMix);  // a mix engine may pull and push

  // ---- before Initialize
  Cache early;
  CHECK_EQ(dd.AllocateCache(Desc(), early), LLM_FAILED);
  CHECK(std::string(llmdd::LastErrorMessage()).find("not initialized") != std::string::npos);
  std::vector<Status> rets;
  CHECK_EQ(dd.LinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.0.1", port)}, rets), LLM_FAILED);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{DECODER_CLUSTER_ID, 1, 0}, early, {0}, {0}), LLM_FAILED);

  // ---- Initialize refusals leave nothing behind
  {
    auto options = Options(port, pool);
    options.erase(OPTION_DEVICE_ID);
    CHECK_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
  }
  for (const char *bad_device : {"", "a", "-1", "4294967295", "0;1"}) {
    auto options = Options(port, pool);
    options[OPTION_DEVICE_ID] = bad_device;
    CHECK_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
  }
  for (const char *bad_listen : {"", "127.0.0.1", "127.0.1:26000", "256.0.0.1:26000", "a.a.a.a:26000",
                                 "127.0.0.1:-1", "127.0.0.1:", "127.0.0.1:a", "127.0.0.1:65536"}) {
    auto options = Options(port, pool);
    options[OPTION_LISTEN_IP_INFO] = bad_listen;
    CHECK_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
  }
  CHECK(PortFree(port));
  const char *bad_pools[] = {
      "",                                                    // empty
      "{}",                                                  // names nothing
      R"({"buf_pool_size": 111111111111111111111111111111111111})",  // not 64-bit
      "{",                                                   // not JSON
      "[1, 2]",                                              // not an object
      R"({"buf_pool_size": -1})",                            // not positive
      R"({"buf_pool_size": "2147483648"})",                  // not an integer
      R"({"buf_pool_size": 1048576, "pool": 1})",            // unknown key
      R"({"buf_cfg":[{"total_size":2097152}], "buf_pool_size": 1048576})",  // incomplete entry
      R"({"buf_cfg":[{"total_size":64,"blk_size":256,"max_buf_size":8192}]})",  // sizes out of order
      R"({"buf_cfg": 5})",                                   // not a list
  };
  for (const char *bad : bad_pools) {
    CHECK_EQ(dd.Initialize(Options(port, bad)), LLM_PARAM_INVALID);
    CHECK(std::string(llmdd::LastErrorMessage()).find("llm.BufPoolCfg") != std::string::npos);
    CHECK_EQ(SegmentsOfThisProcess(), 0);
    CHECK(PortFree(port));
  }
  {
    auto options = Options(port, pool);
    options[OPTION_SYNC_CACHE_WAIT_TIME] = "soon";  // refused by the engine itself
    CHECK_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
    options = Options(port, pool);
    options[OPTION_LISTEN_IP_INFO] = "127.0.0.1";
    CHECK_EQ(dd.Initialize(options), LLM_PARAM_INVALID);
    CHECK_EQ(SegmentsOfThisProcess(), 0);
    CHECK(PortFree(port));
  }

  // ---- Initialize
  CHECK_EQ(dd.Initialize(Options(port, pool)), LLM_SUCCESS);
  CHECK(!PortFree(port));                                   // listening
  CHECK_EQ(dd.Initialize(Options(port, pool)), LLM_SUCCESS);  // already initialized
  {
    LlmDataDist second(3U, LlmRole::kDecoder);  // one engine per process
    std::map<AscendString, AscendString> options;
    options[OPTION_DEVICE_ID] = "0";
    CHECK_EQ(second.Initialize(options), LLM_FAILED);
    CHECK(std::strlen(llmdd::LastErrorMessage()) > 0);
  }

  // ---- AllocateCache
  Cache src, dst, host;
  CHECK_EQ(dd.AllocateCache(Desc(), src), LLM_SUCCESS);
  CHECK_EQ(dd.AllocateCache(Desc(), dst), LLM_SUCCESS);
  CHECK_EQ(src.cache_id, 1);
  CHECK_EQ(dst.cache_id, 2);
  CHECK_EQ(src.tensor_addrs.size(), static_cast<size_t>(NUM_TENSORS));
  CHECK(src.cache_desc.shape == Desc().shape);
  CHECK_EQ(dd.AllocateCache(Desc(8, CachePlacement::kHost), host), LLM_SUCCESS);
  Fill(src, 1);
  Fill(dst, 2);
  Fill(host, 3);
  CHECK_EQ(SegmentsOfThisProcess(), 2);  // the device pool and the host pool
  {
    Cache bad;
    CacheDesc d = Desc();
    d.num_tensors = 0;
    CHECK_EQ(dd.AllocateCache(d, bad), LLM_PARAM_INVALID);
    d = Desc();
    d.data_type = DT_UNDEFINED;
    CHECK_EQ(dd.AllocateCache(d, bad), LLM_PARAM_INVALID);
    d = Desc();
    d.shape = {};
    CHECK_EQ(dd.AllocateCache(d, bad), LLM_PARAM_INVALID);
    d = Desc(int64_t(1) << 22);  // 256 MiB per tensor: more than the pool
    const Status oom = dd.AllocateCache(d, bad);
    CHECK(oom == LLM_DEVICE_OUT_OF_MEMORY || oom == LLM_OUT_OF_MEMORY);
    CHECK_EQ(bad.cache_id, -1);
  }

  // ---- CopyKvCache: slot 1 of src into slot 2 of dst; then 32 bytes at offset 16 of slot 3 -> 4
  CHECK_EQ(dd.CopyKvCache(src, dst, 1, 2), LLM_SUCCESS);
  CHECK_EQ(dd.CopyKvCache(src, dst, 3, 4, 16, 32), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Same(dst, t, 2 * kBlockBytes, 1, 1 * kBlockBytes, kBlockBytes));
    CHECK(Same(dst, t, 4 * kBlockBytes + 16, 1, 3 * kBlockBytes + 16, 32));
    CHECK(Same(dst, t, 4 * kBlockBytes, 2, 4 * kBlockBytes, 16));
    CHECK(Same(dst, t, 4 * kBlockBytes + 48, 2, 4 * kBlockBytes + 48, 16));
    CHECK(Same(dst, t, 0, 2, 0, 2 * kBlockBytes));
  }
  CHECK_EQ(dd.CopyKvCache(src, host, 0, 0), LLM_SUCCESS);  // device -> host
  CHECK(Same(host, 0, 0, 1, 0, kBlockBytes));
  CHECK_EQ(dd.CopyKvCache(src, dst, 8, 0), LLM_PARAM_INVALID);     // batch index out of range
  CHECK_EQ(dd.CopyKvCache(src, dst, 0, 8), LLM_PARAM_INVALID);
  CHECK_EQ(dd.CopyKvCache(src, dst, 0, 0, 64), LLM_PARAM_INVALID);  // offset past the slot
  CHECK_EQ(dd.CopyKvCache(src, dst, 0, 0, 0, 0), LLM_PARAM_INVALID);
  CHECK_EQ(dd.CopyKvCache(src, dst, 0, 0, 32, 64), LLM_PARAM_INVALID);
  {
    Cache missing = src;
    missing.cache_id = 99;
    CHECK_EQ(dd.CopyKvCache(missing, dst), LLM_KV_CACHE_NOT_EXIST);
  }

  // ---- CopyKvBlocks: blocks {0,1} of src to {5,6} and to {7,4} of dst
  Fill(dst, 2);
  CHECK_EQ(dd.CopyKvBlocks(src, dst, {0, 1}, {{5, 6}, {7, 4}}), LLM_SUCCESS);
  for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
    CHECK(Same(dst, t, 5 * kBlockBytes, 1, 0, kBlockBytes));
    CHECK(Same(dst, t, 6 * kBlockBytes, 1, kBlockBytes, kBlockBytes));
    CHECK(Same(dst, t, 7 * kBlockBytes, 1, 0, kBlockBytes));
    CHECK(Same(dst, t, 4 * kBlockBytes, 1, kBlockBytes, kBlockBytes));
    CHECK(Same(dst, t, 0, 2, 0, 4 * kBlockBytes));
  }
  Fill(dst, 2);
  CHECK_EQ(dd.CopyKvBlocks(src, dst, {1, 2}, {{1, 2}, {8, 3}}), LLM_PARAM_INVALID);  // block 8 of 8
  CHECK(Same(dst, 0, 0, 2, 0, kTensorBytes));  // nothing moved: every list is checked first
  CHECK_EQ(dd.CopyKvBlocks(src, dst, {1, 2}, {{1}}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.CopyKvBlocks(src, dst, {}, {{}}), LLM_PARAM_INVALID);
  {
    Cache wide;
    CacheDesc wide_desc = Desc(4);
    wide_desc.shape = {4, 32};  // 4 blocks of 128 bytes
    CHECK_EQ(dd.AllocateCache(wide_desc, wide), LLM_SUCCESS);
    CHECK_EQ(dd.CopyKvBlocks(src, wide, {0}, {{0}}), LLM_PARAM_INVALID);
    CHECK_EQ(dd.DeallocateCache(wide.cache_id), LLM_SUCCESS);
  }

  // ---- RegisterKvCache / UnregisterKvCache
  std::vector<std::vector<uint8_t>> mine(NUM_TENSORS, std::vector<uint8_t>(kTensorBytes));
  std::vector<uint64_t> addrs;
  for (auto &m : mine) {
    addrs.push_back(reinterpret_cast<uint64_t>(m.data()));
  }
  int64_t reg_id = -1;
  CHECK_EQ(dd.RegisterKvCache(Desc(), addrs, RegisterCfg{}, reg_id), LLM_SUCCESS);
  CHECK(reg_id > 0);
  {
    Cache reg;
    reg.cache_id = reg_id;
    CHECK_EQ(dd.CopyKvBlocks(src, reg, {3}, {{0}}), LLM_SUCCESS);
    for (uint32_t t = 0; t < NUM_TENSORS; ++t) {
      const auto want = Pattern(1, t, kTensorBytes);
      CHECK(std::memcmp(mine[t].data(), want.data() + 3 * kBlockBytes, kBlockBytes) == 0);
    }
    int64_t other = -1;
    CHECK_EQ(dd.RegisterKvCache(Desc(), {}, RegisterCfg{}, other), LLM_PARAM_INVALID);
    CHECK_EQ(dd.RegisterKvCache(Desc(), {addrs[0]}, RegisterCfg{}, other), LLM_PARAM_INVALID);
    CHECK_EQ(dd.RegisterKvCache(Desc(), {addrs[0], 0, addrs[2], addrs[3]}, RegisterCfg{}, other), LLM_PARAM_INVALID);
    CHECK_EQ(other, -1);
    CHECK_EQ(dd.DeallocateCache(reg_id), LLM_PARAM_INVALID);  // registered, not allocated
    CHECK_EQ(dd.UnregisterKvCache(src.cache_id), LLM_PARAM_INVALID);
    CHECK_EQ(dd.UnregisterKvCache(reg_id), LLM_SUCCESS);
    CHECK_EQ(dd.CopyKvBlocks(src, reg, {3}, {{0}}), LLM_KV_CACHE_NOT_EXIST);
    CHECK_EQ(dd.UnregisterKvCache(reg_id), LLM_SUCCESS);  // unknown id
  }

  // ---- transfers without a link, and bad arguments (checked before the link)
  const CacheIndex remote{DECODER_CLUSTER_ID, 1, 0};
  CHECK_EQ(dd.PullKvCache(remote, dst), LLM_NOT_YET_LINK);
  CHECK_EQ(dd.PullKvBlocks(remote, dst, {0}, {0}), LLM_NOT_YET_LINK);
  CHECK_EQ(dd.PushKvCache(src, remote), LLM_NOT_YET_LINK);
  CHECK_EQ(dd.PushKvBlocks(src, remote, {0}, {0}), LLM_NOT_YET_LINK);
  CHECK_EQ(dd.PullKvBlocks(remote, Cache{}, {0}, {0}), LLM_KV_CACHE_NOT_EXIST);  // no such local cache
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{PROMPT_CLUSTER_ID, 1, 0}, dst, {0}, {0}), LLM_PARAM_INVALID);  // itself
  CHECK_EQ(dd.PullKvBlocks(remote, dst, {}, {}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvBlocks(remote, dst, {0, 1}, {0}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvBlocks(CacheIndex{DECODER_CLUSTER_ID, 1, 1}, dst, {0}, {0}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvBlocks(remote, dst, {0}, {1ULL << 63}), LLM_PARAM_INVALID);
  KvCacheExtParam bad_ext{};
  bad_ext.src_layer_range = {2, 1};
  CHECK_EQ(dd.PullKvCache(remote, dst, 0, -1, bad_ext), LLM_PARAM_INVALID);
  bad_ext = KvCacheExtParam{};
  bad_ext.dst_layer_range = {-2, 0};
  CHECK_EQ(dd.PullKvBlocks(remote, dst, {0}, {0}, bad_ext), LLM_PARAM_INVALID);
  bad_ext = KvCacheExtParam{};
  bad_ext.tensor_num_per_layer = 0;
  CHECK_EQ(dd.PullKvCache(remote, dst, 0, -1, bad_ext), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PullKvCache(remote, dst, 0, 0), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PushKvCache(src, remote, 0, 64), LLM_PARAM_INVALID);  // push size: only -1
  CHECK_EQ(dd.PushKvCache(host, remote), LLM_PARAM_INVALID);         // push from a host cache
  CHECK_EQ(dd.PushKvBlocks(src, CacheIndex{DECODER_CLUSTER_ID, 1, 1}, {0}, {0}), LLM_PARAM_INVALID);
  CHECK_EQ(dd.PushKvBlocks(src, remote, {}, {}), LLM_PARAM_INVALID);
  KvCacheExtParam uneven{};
  uneven.src_layer_range = {0, 0};
  uneven.dst_layer_range = {0, 1};
  CHECK_EQ(dd.PushKvBlocks(src, remote, {0}, {0}, uneven), LLM_PARAM_INVALID);

  // ---- links: bad arguments, nobody listening
  CHECK_EQ(dd.LinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.0.1", port)}, rets, 0), LLM_PARAM_INVALID);
  CHECK_EQ(dd.LinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "", port)}, rets), LLM_PARAM_INVALID);
  CHECK_EQ(dd.LinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.1", port)}, rets), LLM_PARAM_INVALID);
  {
    const uint16_t closed = FreePort();
    const Status s = dd.LinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.0.1", closed)}, rets, 500);
    CHECK(s != LLM_SUCCESS);
    CHECK_EQ(rets.size(), static_cast<size_t>(1));
    CHECK(!rets.empty() && rets[0] != LLM_SUCCESS);
    // the message names the failed cluster and why (the address it could not reach), not only its code
    const std::string why = llmdd::LastErrorMessage();
    CHECK(why.find("; cluster " + std::to_string(DECODER_CLUSTER_ID) + ": ") != std::string::npos);
    CHECK(why.find("127.0.0.1:" + std::to_string(closed)) != std::string::npos);
  }
  CHECK_EQ(dd.UnlinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.0.1", port)}, rets, 0), LLM_PARAM_INVALID);

  // ---- SetRole: decoder stops listening, prompt listens again
  CHECK_EQ(dd.SetRole(LlmRole::kDecoder), LLM_SUCCESS);
  CHECK(PortFree(port));
  std::map<AscendString, AscendString> listen;
  listen[OPTION_LISTEN_IP_INFO] = ("127.0.0.1:" + std::to_string(port)).c_str();
  CHECK_EQ(dd.SetRole(LlmRole::kPrompt, listen), LLM_SUCCESS);
  CHECK(!PortFree(port));
  CHECK_EQ(dd.SetRole(LlmRole::kEnd), LLM_PARAM_INVALID);

  // ---- DeallocateCache: released and unknown ids are successes
  CHECK_EQ(dd.DeallocateCache(dst.cache_id), LLM_SUCCESS);
  CHECK_EQ(dd.DeallocateCache(dst.cache_id), LLM_SUCCESS);
  CHECK_EQ(dd.DeallocateCache(12345), LLM_SUCCESS);
  CHECK_EQ(dd.CopyKvCache(src, dst), LLM_KV_CACHE_NOT_EXIST);

  // ---- after Finalize
  dd.Finalize();
  CHECK_EQ(SegmentsOfThisProcess(), 0);
  CHECK(PortFree(port));
  Cache after;
  int64_t after_id = -1;
  CHECK_EQ(dd.AllocateCache(Desc(), after), LLM_FAILED);
  CHECK_EQ(dd.DeallocateCache(src.cache_id), LLM_FAILED);
  CHECK_EQ(dd.PullKvCache(remote, src), LLM_FAILED);
  CHECK_EQ(dd.PullKvBlocks(remote, src, {0}, {0}), LLM_FAILED);
  CHECK_EQ(dd.PushKvCache(src, remote), LLM_FAILED);
  CHECK_EQ(dd.PushKvBlocks(src, remote, {0}, {0}), LLM_FAILED);
  CHECK_EQ(dd.CopyKvCache(src, src), LLM_FAILED);
  CHECK_EQ(dd.CopyKvBlocks(src, src, {0}, {{1}}), LLM_FAILED);
  CHECK_EQ(dd.RegisterKvCache(Desc(), addrs, RegisterCfg{}, after_id), LLM_FAILED);
  CHECK_EQ(dd.UnregisterKvCache(1), LLM_FAILED);
  CHECK_EQ(dd.LinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.0.1", port)}, rets), LLM_FAILED);
  CHECK_EQ(dd.UnlinkLlmClusters({Cluster(DECODER_CLUSTER_ID, "127.0.0.1", port)}, rets), LLM_FAILED);
  CHECK_EQ(dd.SetRole(LlmRole::kDecoder), LLM_FAILED);
  dd.Finalize();  // twice: harmless

  // ---- the same object initializes again
  CHECK_EQ(dd.Initialize(Options(port, pool)), LLM_SUCCESS);
  Cache again;
  CHECK_EQ(dd.AllocateCache(Desc(), again), LLM_SUCCESS);
  CHECK(again.cache_id > 0);
  dd.Finalize();
  CHECK_EQ(SegmentsOfThisProcess(), 0);

  // ---- role rules: a prompt listens and pushes, a decoder pulls, SetRole needs EnableSwitchRole
  {
    LlmDataDist prompt(PROMPT_CLUSTER_ID, LlmRole::kPrompt);
    auto options = Options(port, pool);
    options.erase(OPTION_LISTEN_IP_INFO);
    CHECK_EQ(prompt.Initialize(options), LLM_PARAM_INVALID);
    CHECK(std::string(llmdd::LastErrorMessage()).find("llm.ListenIpInfo") != std::string::npos);
    CHECK_EQ(prompt.Initialize(Options(port, pool)), LLM_SUCCESS);
    Cache c;
    CHECK_EQ(prompt.AllocateCache(Desc(), c), LLM_SUCCESS);
    CHECK_EQ(prompt.PullKvCache(remote, c), LLM_PARAM_INVALID);
    CHECK(std::string(llmdd::LastErrorMessage()).find("decoder") != std::string::npos);
    CHECK_EQ(prompt.PullKvBlocks(remote, c, {0}, {0}), LLM_PARAM_INVALID);
    CHECK_EQ(prompt.PushKvBlocks(c, remote, {0}, {0}), LLM_NOT_YET_LINK);  // allowed: no link yet
    CHECK_EQ(prompt.PushKvCache(c, remote), LLM_NOT_YET_LINK);
    CHECK_EQ(prompt.SetRole(LlmRole::kPrompt, {}), LLM_PARAM_INVALID);  // a prompt listens
    prompt.Finalize();
  }
  {
    LlmDataDist decoder(DECODER_CLUSTER_ID, LlmRole::kDecoder);
    std::map<AscendString, AscendString> options;
    options[OPTION_DEVICE_ID] = "0";
    options[OPTION_BUF_POOL_CFG] = pool;
    CHECK_EQ(decoder.Initialize(options), LLM_SUCCESS);
    Cache c;
    CHECK_EQ(decoder.AllocateCache(Desc(), c), LLM_SUCCESS);
    const CacheIndex prompt_index{PROMPT_CLUSTER_ID, 1, 0};
    CHECK_EQ(decoder.PushKvCache(c, prompt_index), LLM_PARAM_INVALID);
    CHECK(std::string(llmdd::LastErrorMessage()).find("prompt") != std::string::npos);
    CHECK_EQ(decoder.PushKvBlocks(c, prompt_index, {0}, {0}), LLM_PARAM_INVALID);
    CHECK_EQ(decoder.PullKvBlocks(prompt_index, c, {0}, {0}), LLM_NOT_YET_LINK);
    CHECK_EQ(decoder.PullKvCache(prompt_index, c), LLM_NOT_YET_LINK);
    CHECK_EQ(decoder.SetRole(LlmRole::kMix), LLM_FEATURE_NOT_ENABLED);  // not enabled at Initialize
    decoder.Finalize();
  }
  CHECK_EQ(SegmentsOfThisProcess(), 0);

  std::printf("%d failure(s)\n", g_failures);
  Say(g_failures == 0 ? "DONE" : "FAILED");
  return g_failures == 0 ? 0 : 1;
}
