"""``llm_datadist.utils.utils``: the argument checks, with upstream's return values, refusals and
messages (``TypeError`` for a type, ``ValueError`` for a range)."""

from llmdd._base.validation import (check_dict, check_inner, check_int32, check_int64, check_isinstance, check_list_int32,
                           check_list_int64, check_list_uint64, check_positive_or_set_default, check_uint8,
                           check_uint16, check_uint32, check_uint64)

__all__ = ["check_inner", "check_dict", "check_isinstance", "check_uint64", "check_int64",
           "check_positive_or_set_default", "check_int32", "check_uint32", "check_list_int32", "check_list_int64",
           "check_list_uint64", "check_uint16", "check_uint8"]
