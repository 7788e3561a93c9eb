// llmdd extensions of the C++ API (not part of upstream's header).
#ifndef LLMDD_LLM_DATADIST_LLMDD_EXT_H_
#define LLMDD_LLM_DATADIST_LLMDD_EXT_H_

namespace llm_datadist {
namespace llmdd {
// The message of the last call on this thread that did not return LLM_SUCCESS ("" after a
// success). The library never prints or logs; callers read the reason here.
__attribute__((visibility("default"))) const char *LastErrorMessage();
}  // namespace llmdd
}  // namespace llm_datadist

#endif  // LLMDD_LLM_DATADIST_LLMDD_EXT_H_
