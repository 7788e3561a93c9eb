"""Status codes and exceptions of the llm_datadist contract.

``LLMStatusCode`` carries the raw native status values of upstream; like upstream's
(an ``IntEnum`` since its v1/v2 split) members also compare equal to those ints, and
``str()`` gives ``LLMStatusCode.<NAME>``.  ``LLMException`` is the one
exception type clients catch; llmdd adds subclasses grouped by blame (the
caller's fault versus the peer's or the fabric's) so that code inside llmdd can
be precise while clients keep comparing ``e.status_code``.
"""

from __future__ import annotations

import enum
from typing import Any

from llmdd._base.log import get_logger

__all__ = [
    "LLMStatusCode",
    "LLMException",
    "Status",
    "InvalidStateError",
    "LocalUsageError",
    "RemoteError",
    "TransportError",
    "code_2_status",
    "handle_llm_status",
    "raise_if_false",
    "raise_if_true",
]

_log = get_logger("llmdd.status")

_BASE = 0x5010B000


class LLMStatusCode(enum.IntEnum):
    """Status values, identical to upstream's native ``ge::Status`` numbers."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _BASE + 0x01
    LLM_KV_CACHE_NOT_EXIST = _BASE + 0x02
    LLM_REPEAT_REQUEST = _BASE + 0x03
    LLM_REQUEST_ALREADY_COMPLETED = _BASE + 0x04
    LLM_PARAM_INVALID = _BASE + 0x05
    LLM_ENGINE_FINALIZED = _BASE + 0x06
    LLM_NOT_YET_LINK = _BASE + 0x07
    LLM_ALREADY_LINK = _BASE + 0x08
    LLM_LINK_FAILED = _BASE + 0x09
    LLM_UNLINK_FAILED = _BASE + 0x0A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _BASE + 0x0B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _BASE + 0x0C
    LLM_PROCESSING_LINK = _BASE + 0x0D
    LLM_DEVICE_OUT_OF_MEMORY = _BASE + 0x0E
    LLM_PREFIX_ALREADY_EXIST = _BASE + 0x0F
    LLM_PREFIX_NOT_EXIST = _BASE + 0x10
    LLM_SEQ_LENOVERLIMIT = _BASE + 0x11
    LLM_NO_FREE_BLOCK = _BASE + 0x12
    LLM_BLOCKS_OUT_OF_MEMORY = _BASE + 0x13
    LLM_EXIST_LINK = _BASE + 0x18
    LLM_FEATURE_NOT_ENABLED = _BASE + 0x19
    LLM_TIMEOUT = _BASE + 0x1A
    LLM_LINK_BUSY = _BASE + 0x1B
    LLM_OUT_OF_MEMORY = _BASE + 0x1C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"


_CODE_TO_STATUS = {m.value: m for m in LLMStatusCode if m is not LLMStatusCode.LLM_UNKNOWN_ERROR}


def code_2_status(code: int) -> LLMStatusCode:
    """Map a raw status int to its member; unknown values give ``LLM_FAILED`` (as upstream)."""
    return _CODE_TO_STATUS.get(code, LLMStatusCode.LLM_FAILED)


class LLMException(RuntimeError):
    """The contract's exception: a message and a ``status_code``."""

    def __init__(self, *args: Any, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code

    def __reduce__(self):  # keep status_code across pickling (multiprocessing test harnesses)
        return (_rebuild_exception, (type(self), self.args, self._status_code))


def _rebuild_exception(cls, args, status_code):
    return cls(*args, status_code=status_code)


class InvalidStateError(LLMException):
    """A command that is illegal in the current lifecycle state (caller's fault)."""


class LocalUsageError(LLMException):
    """Bad arguments or a misuse of the API detected locally (caller's fault)."""


class RemoteError(LLMException):
    """The peer refused or failed the request (peer's fault)."""


class TransportError(LLMException):
    """The transport failed: timeout, peer gone, refused, corrupt (fabric's fault)."""


class Status:
    """Upstream's status wrapper; exported but returned by no v2 API."""

    def __init__(self, status: LLMStatusCode) -> None:
        self._status = status

    def is_ok(self) -> bool:
        return self._status == LLMStatusCode.LLM_SUCCESS

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status

    def __repr__(self) -> str:
        return f"Status({self._status})"


def handle_llm_status(status: int, func_name: str, other_info: str) -> None:
    """Raise ``LLMException`` for a non-zero raw status, formatted as upstream does."""
    if status != 0:
        code = code_2_status(status)
        raise LLMException(f"{func_name} failed, error code is {code}, {other_info}.", status_code=code)


def raise_if_false(pred: bool, fmt: str, *args: Any,
                   status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID, **kwargs: Any) -> None:
    if not pred:
        msg = fmt.format(*args, **kwargs)
        _log.debug("llmdd.param.invalid", message=msg)
        raise LLMException(msg, status_code=status_code)


def raise_if_true(pred: bool, fmt: str, *args: Any,
                  status_code: LLMStatusCode = LLMStatusCode.LLM_PARAM_INVALID, **kwargs: Any) -> None:
    raise_if_false(not pred, fmt, *args, status_code=status_code, **kwargs)
