"""What runs inside a doctor's helper process: one JSON request on stdin, JSON lines out."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from llmdd._tools.doctor.child import _decode, _encode
from llmdd._tools.doctor.peer import _link_outcome
from llmdd._tools.doctor.selftest import _owner_child


def main() -> None:
    """Entry point of a helper process (``python -c``): one JSON request on stdin, JSON lines out.

    The protocol goes over a duplicate of the original stdout; ``sys.stdout`` and fd 1 are
    pointed at stderr so that nothing else can interleave with it.
    """
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: object) -> None:
        proto.write(json.dumps(_encode(obj)) + "\n")
        proto.flush()

    request = _decode(json.loads(sys.stdin.readline() or "{}"))
    op = request.get("op")
    if op == "own":
        _owner_child(request["transport"], int(request["size"]), send)
    elif op == "link":
        send(_link_outcome(request["host"], int(request["port"]), request.get("secret"),
                           int(request["timeout_ms"])))
    else:
        send({"kind": "error", "error": f"unknown request {op!r}"})
    proto.close()
