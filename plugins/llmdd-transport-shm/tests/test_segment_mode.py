"""Shared-memory segments are private to their owner's user (issue 14, item 4): the modes read back
from /dev/shm, in a child process whose umask the test sets.

* umask 000 (grants everything the creation mode allows): llmdd's pool segments (host and emulated
  device backends) and the shm transport's control segment are exactly 0600, owned by our user.
  The control: a file the same child creates there with mode 0666 reads back 0666, so a 0600 is
  the creation mode's doing, not the test's.
* umask 277 (takes the owner's write bit away): the pool segments and the shm transport's own
  segments are still exactly 0600 (fchmod after creation; 0400 would lock same-user peers out).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

_CHILD = r"""
import json, os, stat, sys
os.umask(int(sys.argv[1], 8))
from llmdd._memory.backend import EmulatedDeviceBackend, HostBackend
from llmdd_shm import ShmTransport
from llmdd_shm import _seg
from llmdd.lowlevel import segment_name

def mode(name):
    st = os.stat("/dev/shm/" + name)
    return {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid}

out = {}
segs = [HostBackend().allocate_segment(1 << 16), EmulatedDeviceBackend().allocate_segment(1 << 16)]
out["pool_host"], out["pool_device"] = mode(segs[0].name), mode(segs[1].name)
ep = ShmTransport({}).open_endpoint()
out["shm_control"] = mode(ep._ctl_name)
name = segment_name("modetest")
m = _seg.create(name, 4096)
out["shm_create"] = mode(name)
m.close()
_seg.unlink(name)
ctl = "/dev/shm/" + segment_name("modectl")
os.close(os.open(ctl, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666))
out["control_0666"] = mode(os.path.basename(ctl))
os.unlink(ctl)
ep.close()
for s in segs:
    s.close()
    s.unlink()
print(json.dumps(out))
"""


def _modes(umask: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, umask], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_segments_are_0600_under_a_permissive_umask():
    got = _modes("000")
    assert got.pop("control_0666")["mode"] == 0o666, "the umask did not apply: the check would prove nothing"
    for what, st in got.items():
        assert st["mode"] == 0o600, (what, oct(st["mode"]))
        assert st["uid"] == os.geteuid(), (what, st)


def test_shm_transport_segments_stay_0600_under_a_restrictive_umask():
    got = _modes("277")
    assert got["control_0666"]["mode"] == 0o400          # the umask took the write bit (the control)
    for what in ("shm_control", "shm_create", "pool_host", "pool_device"):
        assert got[what]["mode"] == 0o600, (what, oct(got[what]["mode"]))
