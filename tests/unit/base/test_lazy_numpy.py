"""numpy at its first use (llmdd._base.lazy, issue 22 target 5), in fresh interpreters.

* ``import llmdd`` (and llmdd.lowlevel / llmdd.abc) loads no numpy; the numpy-derived constants
  (``OP_DTYPE``, ``COPY_OP_DTYPE``) come with their first read and are the dtypes they always were;
* functions that get arrays made with a numpy the caller imported itself work before llmdd has
  touched numpy (the constants are defined then), and ops built by llmdd are identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_loads_no_numpy_and_constants_come_with_their_first_read():
    got = _run("""
        import json, sys
        import llmdd, llmdd.lowlevel, llmdd.abc, llmdd._memory, llmdd._seam.abc, llmdd._seam.ops, llmdd._data.planner
        before = "numpy" in sys.modules
        from llmdd.lowlevel import OP_DTYPE
        after = "numpy" in sys.modules
        import numpy as np
        from llmdd._memory import COPY_OP_DTYPE
        print(json.dumps({"before": before, "after": after, "op": OP_DTYPE.descr, "itemsize": OP_DTYPE.itemsize,
                          "copy": COPY_OP_DTYPE.descr, "same": OP_DTYPE is llmdd._seam.ops.OP_DTYPE,
                          "planner": llmdd._data.planner.OP_DTYPE is OP_DTYPE}))
    """)
    assert got["before"] is False and got["after"] is True
    assert [tuple(x) for x in got["op"]] == [("local_region", "<u4"), ("local_offset", "<u8"),
                                             ("remote_region", "<u4"), ("remote_offset", "<u8"),
                                             ("length", "<u8")]
    assert got["itemsize"] == 32 and got["same"] and got["planner"]
    assert [tuple(x) for x in got["copy"]] == [("src", "<u8"), ("dst", "<u8"), ("length", "<u8")]


def test_arrays_from_the_callers_numpy_work_before_llmdd_used_numpy():
    got = _run("""
        import json, sys
        import numpy as np                      # the caller's numpy, before llmdd touched its own proxy
        import llmdd
        from llmdd._seam.ops import coalesce_ops
        from llmdd._memory import copy as c
        rng = np.random.default_rng(7)
        dt = np.dtype([("local_region", "<u4"), ("local_offset", "<u8"), ("remote_region", "<u4"),
                       ("remote_offset", "<u8"), ("length", "<u8")])
        n = 64
        lens = rng.integers(1, 4096, n).astype(np.uint64)
        offs = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.uint64)
        ops = np.zeros(n, dt)
        ops["local_offset"], ops["remote_offset"], ops["length"] = offs, offs + 17, lens
        merged = coalesce_ops(ops, sort=False)   # reads the dtype's fields without touching np first
        bad = np.zeros(3, np.dtype([("a", "<u8")]))
        try:
            c.check_copy_ops(bad, c.Bounds.from_ranges([]), c.Bounds.from_ranges([]))
            refused = False
        except Exception as exc:
            refused = "COPY_OP_DTYPE" in str(exc)
        from llmdd.lowlevel import make_ops
        built = make_ops(0, offs, 0, offs + 17, lens)
        print(json.dumps({"merged": [int(merged["length"][0]), len(merged)], "total": int(lens.sum()),
                          "refused": refused, "built_equal": bool((built == ops).all()),
                          "built_dtype": built.dtype == dt}))
    """)
    assert got["merged"] == [got["total"], 1]
    assert got["refused"] and got["built_equal"] and got["built_dtype"]
