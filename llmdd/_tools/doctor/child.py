"""The doctor's helper processes: a fresh ``python -c`` interpreter talking JSON lines over its
stdin/stdout (never fork, since the parent may run threads; not ``multiprocessing`` spawn, which
re-imports the parent's ``__main__``).  :mod:`.helper` is what runs inside one."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Optional

import attrs

from llmdd._seam.abc import EndpointDescriptor, RegionDescriptor



def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, (EndpointDescriptor, RegionDescriptor)):   # a transport's descriptor, field by field
        return {"__descriptor__": type(value).__name__,
                **{k: _encode(v) for k, v in attrs.asdict(value, recurse=False).items()}}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return bytes.fromhex(value["__bytes__"])
        if "__descriptor__" in value:
            fields = {k: _decode(v) for k, v in value.items() if k != "__descriptor__"}
            kind = EndpointDescriptor if value["__descriptor__"] == "EndpointDescriptor" else RegionDescriptor
            return kind(**fields)
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


class _Child:
    """A helper process running :func:`_child_main`: a fresh interpreter, JSON lines both ways.

    A fresh ``python -c`` rather than ``multiprocessing``: spawn re-imports the parent's
    ``__main__`` (which fails for a REPL or stdin parent, and re-runs scripts without a main
    guard), and fork is unsafe in a process that runs threads.
    """

    def __init__(self, request: Mapping[str, Any]) -> None:
        import llmdd

        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(llmdd.__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._stderr = tempfile.TemporaryFile()
        self._buf = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from llmdd._tools.doctor.helper import main; main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env, bufsize=0,
            close_fds=True)
        self.send(request)

    def send(self, obj: object) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(_encode(obj)) + "\n").encode())
        except (BrokenPipeError, OSError):
            pass

    def recv(self, timeout: float) -> Optional[dict]:
        """The next message, or None at EOF or when ``timeout`` seconds pass."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return _decode(json.loads(line))

    def failure(self) -> str:
        """Why the child gave no answer: its exit status and the last line of its stderr."""
        code = self.proc.poll()
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().decode(errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else ""
        status = "is still running" if code is None else f"exited with status {code}"
        return f"the helper process {status}" + (f": {last}" if last else "")

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def _describe_error(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"
