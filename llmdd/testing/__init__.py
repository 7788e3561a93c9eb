"""Public test support for llmdd users and plugin authors.

* a conformance suite every transport plugin runs against itself (``check_transport``);
* hook and log recorders (``HookRecorder``, ``capture_log_output``);
* a multi-process harness (``peers``, ``spawn_peer``, checkpoints, kill/stall), a loopback
  proxy that partitions links (``LoopbackProxy``) and leak snapshots (``ResourceSnapshot``);
* the pytest plugin (``llmdd.testing.pytest_plugin``, opt-in: ``-p llmdd.testing.pytest_plugin``).
"""

from ._conformance import CONFORMANCE_CHECKS as CONFORMANCE_CHECKS
from ._conformance import check_transport as check_transport
from ._conformance import run_check as run_check
from ._harness import Cluster as Cluster
from ._harness import PeerCallError as PeerCallError
from ._harness import PeerExitedError as PeerExitedError
from ._harness import PeerHandle as PeerHandle
from ._harness import checkpoint as checkpoint
from ._harness import free_port as free_port
from ._harness import peers as peers
from ._harness import spawn_peer as spawn_peer
from ._leaks import ResourceLeakError as ResourceLeakError
from ._leaks import ResourceSnapshot as ResourceSnapshot
from ._leaks import peer_snapshot as peer_snapshot
from ._proxy import LoopbackProxy as LoopbackProxy
from ._recorder import HookCall as HookCall
from ._recorder import HookRecorder as HookRecorder
from ._recorder import LogOutput as LogOutput
from ._recorder import capture_log_output as capture_log_output

__all__ = ["CONFORMANCE_CHECKS", "check_transport", "run_check", "HookCall", "HookRecorder", "LogOutput",
           "capture_log_output", "Cluster", "PeerCallError", "PeerExitedError", "PeerHandle", "checkpoint",
           "free_port", "peers", "spawn_peer", "ResourceLeakError", "ResourceSnapshot", "peer_snapshot",
           "LoopbackProxy"]
