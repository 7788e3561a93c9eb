"""Plausible bugs planted in a copy of llmdd, and how to run the simulator against that copy.

Each :class:`Mutation` replaces one exact piece of llmdd's source (it must occur exactly once, so a
refactor that moves it makes ``test_every_mutation_applies`` fail instead of silently testing nothing)
and names the faults under which the simulator should see it.  :func:`hunt` copies ``llmdd/`` into a
temporary directory, applies the mutation there and runs ``python -m llmdd sim --runs N`` with that
copy first on ``PYTHONPATH`` (the installed tree is untouched); it returns the first failing seed and
the violations printed.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Optional

import attrs

ROOT = pathlib.Path(__file__).resolve().parents[2]


@attrs.frozen
class Mutation:
    name: str
    path: str               # relative to the repository root
    old: str
    new: str
    faults: str = "none"
    why: str = ""


MUTATIONS = [
    Mutation("deadline_not_armed", "llmdd/_data/engine.py",
             "deadline = self._clock() + self.timeout_s\n        channel = link.channel",
             "deadline = self._clock() + 1000 * self.timeout_s\n        channel = link.channel",
             "freeze,xlate", "a transfer step's deadline is not the sync_kv_timeout: a stalled owner holds the call"),
    Mutation("completion_error_ignored", "llmdd/_data/engine.py",
             "        completion.wait()\n        if completion.error is not None:\n            raise completion.error",
             "        completion.wait()\n        if False:\n            raise completion.error",
             "xfail,xpartial", "a failed batch is reported as a successful transfer"),
    Mutation("completion_not_awaited", "llmdd/_data/engine.py",
             "        completion.wait()\n        if completion.error is not None:",
             "        completion.done()\n        if completion.error is not None:",
             "none", "the call returns before its batch landed"),
    Mutation("busy_turn_released_twice", "llmdd/_data/busy.py",
             "                 tb: Optional[TracebackType]) -> None:\n        self._lock.release()",
             "                 tb: Optional[TracebackType]) -> None:\n        self._lock.release()\n"
             "        if exc_type is not None:\n            self._lock.release()",
             "xfail", "a failed transfer gives the link's transfer turn back twice"),
    Mutation("tag_delivered_twice", "llmdd/_data/owner.py",
             "        checked = self._check_transfer_done(link, entry, what)\n        if checked is not None:\n"
             "            self._cache_event(checked[0], \"peer_written\" if what == \"push_done\" else \"peer_read\", "
             "error=checked[1],\n                              **checked[2])",
             "        checked = self._check_transfer_done(link, entry, what)\n        if checked is not None:\n"
             "            for _twice in range(2):\n"
             "                self._cache_event(checked[0], \"peer_written\" if what == \"push_done\" else \"peer_read\", "
             "error=checked[1],\n                                  **checked[2])",
             "none", "the owner delivers a transfer's tag twice"),
    Mutation("queued_pull_not_withdrawn_at_finalize", "llmdd/_data/engine.py",
             "        for task in list(self._async):\n            task.cancel()",
             "        for task in list(self._async):\n            pass",
             "none", "finalize lets queued non-blocking pulls start instead of withdrawing them"),
    Mutation("async_callback_twice", "llmdd/_data/tasks.py",
             "            try:\n                callback(status)\n",
             "            try:\n                callback(status)\n                if status is not S.LLM_SUCCESS:\n"
             "                    callback(status)\n",
             "xfail", "a failed non-blocking pull ends twice"),
    Mutation("statistics_state_stale", "llmdd/_control/manager.py",
             "                \"state\": LINK_REPORTED[link.state], \"transport\": link.transport,",
             "                \"state\": \"linked\" if link.state.value == \"failed\" else LINK_REPORTED[link.state], "
             "\"transport\": link.transport,",
             "xfail", "statistics() reports a failed link as linked"),
    Mutation("failure_event_lost", "llmdd/_lifecycle/machines.py",
             "        if defer is not None:\n            defer(lambda: emit(event))\n        else:\n            emit(event)\n"
             "        return event",
             "        if trigger == \"peer_lost\":\n            return event\n"
             "        if defer is not None:\n            defer(lambda: emit(event))\n        else:\n            emit(event)\n"
             "        return event",
             "xfail", "a link's peer_lost transition emits no event (subscribers miss the failure)"),
    Mutation("layer_range_start_not_scaled", "llmdd/_data/planner.py",
             "    return range(layer_range.start * tnpl, layer_range.stop * tnpl)",
             "    return range(layer_range.start, layer_range.start + (layer_range.stop - layer_range.start) * tnpl)",
             "none", "a layer range's first tensor is not scaled by the tensors per layer (layer 1 reads tensors 1-2)"),
    Mutation("withdrawn_task_never_ends", "llmdd/_data/tasks.py",
             "        if self.task.offer(\"withdraw\", error=LLMException(why, status_code=status)):\n"
             "            self._finish(status)",
             "        if self.task.offer(\"withdraw\", error=LLMException(why, status_code=status)):\n"
             "            pass",
             "none", "a queued non-blocking pull withdrawn (unlink, link failure, finalize) never calls back"),
    Mutation("replaced_link_not_closed", "llmdd/_control/manager.py",
             "        if old is not None:\n            # the peer relinks",
             "        if False:\n            # the peer relinks",
             "crash", "a peer that restarted (a new incarnation) relinks; the old incarnation's link is not closed"),
]


def apply(m: Mutation, root: pathlib.Path) -> None:
    path = root / m.path
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise AssertionError(f"mutation {m.name}: {m.path} holds its original text {count} times, not once")
    path.write_text(text.replace(m.old, m.new))


def mutated_tree(m: Mutation, tmp: pathlib.Path) -> pathlib.Path:
    shutil.copytree(ROOT / "llmdd", tmp / "llmdd", ignore=shutil.ignore_patterns("__pycache__"))
    apply(m, tmp)
    return tmp


def sim_command(seed: int, runs: int, faults: str, *, engines: int, ops: int, backend: str) -> list[str]:
    return [sys.executable, "-m", "llmdd", "sim", "--seed", str(seed), "--runs", str(runs), "--engines",
            str(engines), "--ops", str(ops), "--faults", faults, "--backend", backend]


def hunt(tree: Optional[pathlib.Path], faults: str, *, seeds: int, engines: int = 4, ops: int = 150,
         backend: str = "sim", timeout: float = 600.0) -> tuple[Optional[int], list[str], str]:
    """Run seeds 0..seeds-1 on ``tree`` (None: the tree as installed); (first failing seed or None,
    the violation lines, the whole output)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(sim_command(0, seeds, faults, engines=engines, ops=ops, backend=backend), env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(tree or ROOT))
    out = proc.stdout + proc.stderr
    found = re.search(r"^failing seed: (\d+)$", out, re.M)
    violations = [line for line in out.splitlines() if line.startswith("violation ")]
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if found is None:
        assert proc.returncode == 0 and re.fullmatch(
            r"sim seed=\d+ engines=\d+ ops=\d+ faults=\S+ violations=0 trace=[0-9a-f]{64}", last), out[-3000:]
        return None, [], out
    assert proc.returncode == 1, out[-3000:]
    return int(found.group(1)), violations, out
