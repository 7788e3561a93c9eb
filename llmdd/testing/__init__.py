"""Public test support for llmdd users and plugin authors.

* a conformance suite every transport plugin runs against itself (``check_transport``);
* hook and log recorders (``HookRecorder``, ``capture_log_output``);
* the pytest plugin (``llmdd.testing.pytest_plugin``, loaded through ``pytest11``).
"""

from ._conformance import CONFORMANCE_CHECKS as CONFORMANCE_CHECKS
from ._conformance import check_transport as check_transport
from ._recorder import HookCall as HookCall
from ._recorder import HookRecorder as HookRecorder
from ._recorder import LogOutput as LogOutput
from ._recorder import capture_log_output as capture_log_output

__all__ = ["CONFORMANCE_CHECKS", "check_transport", "HookCall", "HookRecorder", "LogOutput",
           "capture_log_output"]
