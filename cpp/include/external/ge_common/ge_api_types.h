// ge::Status and the option keys of the graph engine that llmdd's C++ API reads.
#ifndef LLMDD_EXTERNAL_GE_COMMON_GE_API_TYPES_H_
#define LLMDD_EXTERNAL_GE_COMMON_GE_API_TYPES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../graph/types.h"

namespace ge {
// a status is a plain 32-bit code; 0 is success
using Status = uint32_t;

// option keys shared with the graph engine (the C++ API maps OPTION_DEVICE_ID onto the first)
const char_t *const OPTION_EXEC_DEVICE_ID = "ge.exec.deviceId";
const char_t *const OPTION_SESSION_DEVICE_ID = "ge.session_device_id";
}  // namespace ge

#endif  // LLMDD_EXTERNAL_GE_COMMON_GE_API_TYPES_H_
