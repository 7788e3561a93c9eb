// Helpers shared by the example programs (and llmdd's C++ tests): seeded test data and a
// line protocol on stdin/stdout through which a driver paces the prompt and decoder processes.
#ifndef LLMDD_EXAMPLES_CPP_COMMON_H_
#define LLMDD_EXAMPLES_CPP_COMMON_H_

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <iostream>
#include <string>
#include <vector>

#include "llm_datadist/llm_datadist.h"

namespace example {
constexpr uint64_t PROMPT_CLUSTER_ID = 1U;
constexpr uint64_t DECODER_CLUSTER_ID = 2U;
constexpr uint32_t NUM_TENSORS = 4U;  // 2 layers of K and V
// shape {8, 16} of DT_INT32: 8 batch slots (or blocks) of 64 bytes per tensor
constexpr size_t kTensorBytes = 8U * 16U * 4U;
constexpr size_t kBlockBytes = kTensorBytes / 8U;

// splitmix64: the byte stream of tensor t of a cache filled with seed s (same in the Python peers)
inline std::vector<uint8_t> Pattern(uint64_t seed, uint32_t tensor, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  uint64_t state = seed * 1000003ULL + tensor;
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    for (size_t b = 0; b < 8 && i + b < bytes; ++b) {
      out[i + b] = static_cast<uint8_t>(z >> (8 * b));
    }
  }
  return out;
}

inline void Fill(const llm_datadist::Cache &cache, uint64_t seed, size_t bytes = kTensorBytes) {
  for (uint32_t t = 0; t < cache.tensor_addrs.size(); ++t) {
    const auto data = Pattern(seed, t, bytes);
    std::memcpy(reinterpret_cast<void *>(cache.tensor_addrs[t]), data.data(), bytes);
  }
}

// bytes [offset, offset+len) of tensor t equal the pattern (seed, t) at src_offset
inline bool Same(const llm_datadist::Cache &cache, uint32_t t, size_t offset, uint64_t seed, size_t src_offset,
                 size_t len, size_t pattern_bytes = kTensorBytes) {
  if (src_offset + len > pattern_bytes) {
    return false;
  }
  const auto data = Pattern(seed, t, pattern_bytes);
  return std::memcmp(reinterpret_cast<const uint8_t *>(cache.tensor_addrs[t]) + offset, data.data() + src_offset,
                     len) == 0;
}

// How the two programs are paced (docs/cpp.md, "Running the examples"): each waits for one-word commands on
// stdin at the points where the other side must have done something first.
constexpr const char *kPacing =
    "these examples are paced by one-word commands on stdin: run both with\n"
    "  python cpp/tests/run_case.py --bin <dir of example_prompt and example_decoder> cpp_cpp\n"
    "or by hand in two terminals, typing each command when the program asks for it (docs/cpp.md)";

// the driver's next command (one word a line), to be sent `when`; "" at end of input or on another word,
// after saying why. On a terminal it first says what to type and when.
inline std::string Expect(const char *want, const char *when) {
  if (isatty(STDIN_FILENO)) {
    std::printf("(type %s and Enter %s)\n", want, when);
    std::fflush(stdout);
  }
  std::string line;
  if (!std::getline(std::cin, line)) {
    std::printf("[ERROR] stdin ended before the command %s (sent %s): %s\n", want, when, kPacing);
    std::fflush(stdout);
    return "";
  }
  if (line != want) {
    std::printf("[ERROR] expected the command %s (sent %s), got \"%s\": %s\n", want, when, line.c_str(), kPacing);
    std::fflush(stdout);
    return "";
  }
  return line;
}

inline void Say(const std::string &word) {
  std::printf("%s\n", word.c_str());
  std::fflush(stdout);
}

inline llm_datadist::ClusterInfo Cluster(uint64_t remote_id, const std::string &remote_ip, uint16_t remote_port) {
  llm_datadist::ClusterInfo cluster_info;
  cluster_info.remote_cluster_id = remote_id;
  llm_datadist::IpInfo local_ip_info;
  local_ip_info.ip = "127.0.0.1";
  llm_datadist::IpInfo remote_ip_info;
  remote_ip_info.ip = remote_ip.c_str();
  remote_ip_info.port = remote_port;
  cluster_info.local_ip_infos.emplace_back(std::move(local_ip_info));
  cluster_info.remote_ip_infos.emplace_back(std::move(remote_ip_info));
  return cluster_info;
}
}  // namespace example

#endif  // LLMDD_EXAMPLES_CPP_COMMON_H_
