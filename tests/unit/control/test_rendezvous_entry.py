"""Same-host rendezvous entries name their writer's incarnation (``llmdd/_control/comm_group.py``):
an entry counts only while the very process that wrote it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from llmdd._control.comm_group import _entry_alive, _own_start_time, _parse_entry, _start_time

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not os.path.isdir("/proc"), reason="start times are read from /proc")]


def test_this_process_is_alive_under_its_own_start_time_only():
    start = _own_start_time()
    assert start > 0
    assert _entry_alive(os.getpid(), start)
    assert not _entry_alive(os.getpid(), start + 1)   # the same pid, another incarnation (pid reused)


def test_a_killed_process_is_gone_as_a_zombie_and_once_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        found = _start_time(child.pid)
        assert found is not None
        start = found[1]
        assert _entry_alive(child.pid, start)
        os.kill(child.pid, signal.SIGKILL)
        # not yet reaped: a zombie (os.waitid with WNOWAIT waits for the exit without reaping it)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert _start_time(child.pid)[0] == "Z"
        assert not _entry_alive(child.pid, start)
    finally:
        child.kill()
        child.wait(10)
    assert not _entry_alive(child.pid, start)


@pytest.mark.parametrize("text", ["", "127.0.0.1:5000\n", "127.0.0.1:5000 12 34\n", "127.0.0.1:0 12 34 ab\n",
                                  "127.0.0.1:70000 12 34 ab\n", "127.0.0.1:5000 0 34 ab\n", "127.0.0.1:5000 x 34 ab\n",
                                  "127.0.0.1 12 34 ab\n", "127.0.0.1:5000 12 -1 ab\n"])
def test_malformed_entries_are_refused(text):
    with pytest.raises(ValueError):
        _parse_entry(text)


def test_an_entry_parses_to_its_address_and_incarnation():
    assert _parse_entry("127.0.0.1:41234 4321 98765 0f1e2d3c4b5a6978\n") == ("127.0.0.1", 41234, 4321, 98765)
