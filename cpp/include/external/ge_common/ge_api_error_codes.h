// The graph-engine header llm_datadist.h includes: ge::Status, ge::AscendString, ge::DataType,
// the general codes SUCCESS / FAILED / END_OF_SEQUENCE, and the standard headers the API
// header relies on (<memory> for std::unique_ptr, <utility> for std::pair).
#ifndef LLMDD_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_
#define LLMDD_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "ge_error_codes.h"
#include "ge_api_types.h"
#include "../graph/ascend_string.h"

namespace ge {
// A code packs runtime(2) | type(2) | level(3) | sysid(8) | modid(5) | value(12) bits.
constexpr Status MakeStatus(uint32_t runtime, uint32_t type, uint32_t level, uint32_t sysid, uint32_t modid,
                            uint32_t value) {
  return ((runtime & 0xFFU) << 30U) | ((type & 0xFFU) << 28U) | ((level & 0xFFU) << 25U) |
         ((sysid & 0xFFU) << 17U) | ((modid & 0xFFU) << 12U) | (value & 0x0FFFU);
}

constexpr Status SUCCESS = MakeStatus(0U, 0U, 0U, 0U, 0U, 0U);
constexpr Status FAILED = MakeStatus(0x3U, 0x3U, 0x7U, 0xFFU, 0x1FU, 0xFFFU);
constexpr Status END_OF_SEQUENCE = MakeStatus(0x1U, 0x1U, 0x0U, 8U, 0U, 7U);
}  // namespace ge

#endif  // LLMDD_EXTERNAL_GE_COMMON_GE_API_ERROR_CODES_H_
