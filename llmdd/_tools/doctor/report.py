"""Results of ``llmdd doctor``: checks, self-test results, the report, and their JSON form."""

from __future__ import annotations

import json

from typing import Any, Mapping, Sequence, Union

import attrs

from llmdd._tools.doctor.util import FAIL, SELF_TEST_BYTES, SELF_TEST_OP_BYTES


@attrs.frozen(kw_only=True)
class Check:
    """The outcome of one check: ``status`` is ``ok``, ``warn``, ``fail`` or ``skip``."""

    name: str
    status: str
    message: str
    fix: str = ""
    details: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "message": self.message, "fix": self.fix,
                "details": _jsonable(dict(self.details))}


@attrs.frozen(kw_only=True)
class SelfTestResult:
    """A transport's loopback self-test.

    ``gbps`` is decimal GB/s over the timed reads (``batches`` of ``region_bytes`` each, after
    one untimed warm-up read; ``seconds`` is their summed duration).  The warm-up read and the
    last read are verified byte for byte (the destination is zeroed before the last).
    """

    transport: str
    ok: bool
    gbps: float = 0.0
    bytes_read: int = 0
    batches: int = 0
    seconds: float = 0.0
    region_bytes: int = SELF_TEST_BYTES
    op_bytes: int = SELF_TEST_OP_BYTES
    processes: int = 1
    verified: bool = False
    error: str = ""
    note: str = ""

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class DoctorReport:
    """What ``llmdd doctor`` found: the info, the self-tests and the checks."""

    info: Mapping[str, Any]
    selftests: Sequence[SelfTestResult]
    checks: Sequence[Check]

    @property
    def ok(self) -> bool:
        """No check failed and every self-test that ran passed."""
        return not any(c.failed for c in self.checks) and all(t.ok for t in self.selftests)

    @property
    def problems(self) -> int:
        return sum(c.failed for c in self.checks) + sum(not t.ok for t in self.selftests)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "info": _jsonable(dict(self.info)),
                "selftest": [t.as_dict() for t in self.selftests], "checks": [c.as_dict() for c in self.checks]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, bytes):
        return value.hex()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def report_json(report: Union[DoctorReport, Mapping[str, Any]]) -> str:
    """``DoctorReport`` or an info dict as indented JSON."""
    data = report.as_dict() if isinstance(report, DoctorReport) else _jsonable(report)
    return json.dumps(data, indent=2, sort_keys=False)
