"""``llm_datadist.utils.utils``: the argument checks."""

from ..._validation import (check_dict, check_int32, check_int64, check_isinstance, check_list_int32,  # noqa: F401
                            check_list_int64, check_list_uint64, check_positive_or_set_default, check_uint8,
                            check_uint16, check_uint32, check_uint64)
