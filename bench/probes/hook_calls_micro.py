"""The hook calls on the per-transfer path, in two source trees, same run, interleaved (issue 37).

Per tree, in a fresh interpreter with that tree first on ``PYTHONPATH``, with the default plugins (the
log observer and the default ``llmdd_run_transfer``) and the ``llmdd.task`` logger off, as in an
application that configures no logging:

* ``task``: a task lifecycle created, started and succeeded (three transitions, each asking the
  engine's ``wants``; no event is built), ns per task;
* ``quiet``: ``Lifecycle.quiet()``, the small-transfer path's one question, ns per call;
* ``wants``: the ``wants(None)`` of the task machine alone, ns per call;
* ``emit1``: one link event to one subscriber (the contained call loop), ns per event;
* ``direct``: ``Hooks.runs_transfers_directly()``, ns per call.

Each figure is the best of 9 repeats; the trees alternate for ``--rounds`` rounds and the table gives
every round and the median of the rounds (on a shared machine compare the two trees within a round).

    python bench/probes/hook_calls_micro.py OLD_TREE NEW_TREE [--rounds 5]   # e.g. a `git archive` of main, .
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r'''
import json, timeit
from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine
from llmdd.plugin import hookimpl

pm = make_plugin_manager(autoload=False)
hooks = Hooks(pm)
emit, wants = hooks.live_emitter(Machine.TASK)
lc = Lifecycle(Machine.TASK, emit, wants=wants)
ids = iter(range(10**9))

def task():
    t = lc.create(next(ids), kind="pull", peer=2)
    t.fire("start")
    t.fire("transfer_succeeded")

class Sub:
    n = 0
    @hookimpl
    def llmdd_link_transition(self, event):
        Sub.n += 1

pm2 = make_plugin_manager(autoload=False, blocked=["llmdd._extension.builtin.log_events"])
pm2.register(Sub())
emit1 = Hooks(pm2).emitter(Machine.LINK)
event = object()

def best(fn, n):
    return min(timeit.repeat(fn, number=n, repeat=9)) / n * 1e9

out = {"task": best(task, 20000), "quiet": best(lc.quiet, 100000), "wants": best(lambda: wants(None), 100000),
       "emit1": best(lambda: emit1(event), 50000), "direct": best(hooks.runs_transfers_directly, 100000)}
assert Sub.n > 0 and not wants(None)
print(json.dumps(out))
'''

FIGURES = ("task", "quiet", "wants", "emit1", "direct")


def _run(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.abspath(tree))
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(args.rounds):
        runs["old"].append(_run(args.old))
        runs["new"].append(_run(args.new))
    print(f"load before -> after: see the caller; trees: old={args.old} new={args.new}; ns, best of 9 per round")
    print("| figure | old: median (rounds) | new: median (rounds) | new / old (medians) |")
    print("|---|---:|---:|---:|")
    for fig in FIGURES:
        old = [r[fig] for r in runs["old"]]
        new = [r[fig] for r in runs["new"]]
        mo, mn = statistics.median(old), statistics.median(new)
        print(f"| {fig} | {mo:.0f} ({', '.join(f'{x:.0f}' for x in old)}) | "
              f"{mn:.0f} ({', '.join(f'{x:.0f}' for x in new)}) | {mn / mo:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
