"""Ctrl-C during ``llmdd demo``: one line on stderr, exit 130, and nothing left behind.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the demo and its prompt and
decoder processes.  The test starts ``python -m llmdd demo`` in a session of its own and sends SIGINT to
that group, as a terminal would, once the demo reports its decoders linked (read from its output, with a
deadline): the role processes then hold engines, links and shared-memory segments.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

TIMEOUT_S = 120
pytestmark = pytest.mark.timeout(TIMEOUT_S * 2)


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


def _shm_mapped_by(pid: int) -> set[str]:
    """The /dev/shm files process ``pid`` maps: the segments it owns or reads."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                    for line in f if "/dev/shm/" in line}
    except OSError:
        return set()


def _read_until(proc: subprocess.Popen, marker: bytes, deadline: float) -> bytes:
    out = b""
    fd = proc.stdout.fileno()
    while marker not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"the demo did not print {marker!r} in time; it printed:\n{out.decode()}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"the demo exited ({proc.wait()}) before {marker!r}:\n{out.decode()}"
            out += chunk
    return out


def test_ctrl_c_prints_one_line_exits_130_and_leaves_no_process_or_segment():
    env = dict(os.environ)
    env.pop("LLMDD_DEMO_CORRUPT_KV", None)
    proc = subprocess.Popen([sys.executable, "-m", "llmdd", "demo", "--quick"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        out = _read_until(proc, b"linked 1 decoder(s)", time.monotonic() + TIMEOUT_S)
        members = _group(proc.pid)
        segments = set().union(*(_shm_mapped_by(pid) for pid in members))
        # the demo, its prompt and its decoder (and multiprocessing's resource tracker) are running
        assert len(members) >= 3, members
        assert any(os.path.basename(s).startswith("llmdd_") for s in segments) or "transport tcp" in out.decode(), \
            segments
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, err.decode())
    assert err.decode() == "llmdd demo: interrupted\n"
    assert b"Traceback" not in out + rest
    # every process of the group is gone: the children were stopped (joined) before the demo exited;
    # multiprocessing's resource tracker leaves when the demo's exit closes its pipe: waited for (pidfd)
    deadline = time.monotonic() + TIMEOUT_S
    for pid in _group(proc.pid):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    assert _group(proc.pid) == []
    assert [s for s in segments if os.path.exists(s)] == []

