"""Public test support for llmdd users and plugin authors.

* a conformance suite every transport plugin runs against itself (``check_transport``);
* hook and log recorders (``HookRecorder``, ``capture_log_output``);
* a multi-process harness (``peers``, ``spawn_peer``, checkpoints, kill/stall), a loopback
  proxy that partitions links (``LoopbackProxy``) and leak snapshots (``ResourceSnapshot``);
* the pytest plugin (``llmdd.testing.pytest_plugin``, opt-in: ``-p llmdd.testing.pytest_plugin``).
"""

from llmdd.testing._conformance import CONFORMANCE_CHECKS as CONFORMANCE_CHECKS
from llmdd.testing._conformance import check_transport as check_transport
from llmdd.testing._harness import Cluster as Cluster
from llmdd.testing._harness import PeerCallError as PeerCallError
from llmdd.testing._harness import PeerExitedError as PeerExitedError
from llmdd.testing._harness import PeerHandle as PeerHandle
from llmdd.testing._harness import checkpoint as checkpoint
from llmdd.testing._harness import free_port as free_port
from llmdd.testing._harness import peers as peers
from llmdd.testing._harness import spawn_peer as spawn_peer
from llmdd.testing._leaks import ResourceLeakError as ResourceLeakError
from llmdd.testing._leaks import ResourceSnapshot as ResourceSnapshot
from llmdd.testing._leaks import peer_snapshot as peer_snapshot
from llmdd.testing._proxy import LoopbackProxy as LoopbackProxy
from llmdd.testing._recorder import HookCall as HookCall
from llmdd.testing._recorder import HookRecorder as HookRecorder
from llmdd.testing._recorder import LogOutput as LogOutput
from llmdd.testing._recorder import capture_log_output as capture_log_output

__all__ = ["CONFORMANCE_CHECKS", "check_transport", "HookCall", "HookRecorder", "LogOutput",
           "capture_log_output", "Cluster", "PeerCallError", "PeerExitedError", "PeerHandle", "checkpoint",
           "free_port", "peers", "spawn_peer", "ResourceLeakError", "ResourceSnapshot", "peer_snapshot",
           "LoopbackProxy"]
