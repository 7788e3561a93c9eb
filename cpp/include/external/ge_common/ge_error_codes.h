// Visibility macro of the graph-engine headers, as llmdd's headers need it.
#ifndef LLMDD_EXTERNAL_GE_COMMON_GE_ERROR_CODES_H_
#define LLMDD_EXTERNAL_GE_COMMON_GE_ERROR_CODES_H_

#if defined(__GNUC__)
#ifndef GE_FUNC_VISIBILITY
#define GE_FUNC_VISIBILITY __attribute__((visibility("default")))
#endif
#else
#ifndef GE_FUNC_VISIBILITY
#define GE_FUNC_VISIBILITY
#endif
#endif

#endif  // LLMDD_EXTERNAL_GE_COMMON_GE_ERROR_CODES_H_
