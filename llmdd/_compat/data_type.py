"""Re-export of :mod:`llmdd.data_type` (``llm_datadist.data_type``); the numpy tables stay lazy."""

from llmdd import data_type as _target
from llmdd.data_type import *  # noqa: F401,F403
from llmdd.data_type import __all__  # noqa: F401


def __getattr__(name: str):
    return getattr(_target, name)
