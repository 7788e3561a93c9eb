"""``llm_datadist.utils.log``: upstream's logger (``LLM_DATADIST``) and its helpers.

``get_logger()`` returns the ``logging.getLogger("LLM_DATADIST")`` logger; ``info``, ``warn``
and ``error`` log on it.  Unlike upstream, the logger is not configured here (no stdout
handler, no level from ``ASCEND_GLOBAL_LOG_LEVEL``): a library leaves that to the
application (docs/deviations.md).  ``LOG_FORMAT`` is upstream's line format, for an
application that wants the same output; ``llmdd._base.log.enable_upstream_logging()`` installs it.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LOG_FORMAT", "get_logger", "info", "warn", "error"]

LOG_FORMAT = ("[%(levelname)s] %(name)s(%(process)d,%(processName)s):%(asctime)s.%(msecs)03d "
              "[%(filename)s:%(lineno)d]%(thread)d %(funcName)s: %(message)s")

#: upstream's logger, kept as a module attribute for callers that read it directly
logger = logging.getLogger("LLM_DATADIST")


def get_logger() -> logging.Logger:
    """The ``LLM_DATADIST`` logger (the same object on every call)."""
    return logger


def info(msg: Any, *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("stacklevel", 2)
    logger.info(msg, *args, **kwargs)


def warn(msg: Any, *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("stacklevel", 2)
    logger.warning(msg, *args, **kwargs)


def error(msg: Any, *args: Any, **kwargs: Any) -> None:
    kwargs.setdefault("stacklevel", 2)
    logger.error(msg, *args, **kwargs)
