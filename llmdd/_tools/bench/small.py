"""Small-transfer rows (issue 21): ``pull_blocks`` / ``push_blocks`` of a few blocks, end to end,
and their bare-syscall anchors over the same iovecs, measured in the worker that owns the memory.

* ``small_latency``: p50 / p99 of ``n`` calls of ``pull_blocks`` or ``push_blocks`` of ``blocks``
  random block ids (distinct destinations) of the first ``tensors`` tensors (one layer of
  ``tensors`` tensors), after ``warmup`` calls; the block ids of every call are drawn up front.
* ``cma_small_latency``: p50 / p99 of one bare ``process_vm_readv`` (``write=False``) or
  ``process_vm_writev`` of the same shape: ``blocks * tensors`` iovecs of ``block_bytes``, random
  blocks of tensors ``tensor_bytes`` apart, the same block draws as ``small_latency``; the iovec
  arrays are built before timing, so only the system call is timed (a strict anchor).

:func:`install` adds them to the bench :class:`~llmdd._tools.bench.worker.Worker` as ``cmd_*`` methods.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from llmdd._tools.bench.common import lat_summary


def _libc(name: str):
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, name)
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def _draws(num_blocks: int, blocks: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.permutation(num_blocks)[:blocks].tolist() for _ in range(count)]


def cmd_small_latency(self, op: str, remote: int, model_id: int, remote_model_id: int, num_blocks: int,
                      blocks: int, tensors: int, n: int, warmup: int) -> dict:
    import llmdd

    from llmdd._tools.bench.worker import _until_known

    cm = self.dd.cache_manager
    cache = self.caches[model_id]
    key = llmdd.BlocksCacheKey(remote, remote_model_id)
    one = range(0, 1)
    srcs = _draws(num_blocks, blocks, n + warmup, 11)
    dsts = _draws(num_blocks, blocks, n + warmup, 12)
    if op == "pull":
        def call(s, d):
            cm.pull_blocks(key, cache, s, d, src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=tensors)
    elif op == "push":
        def call(s, d):
            cm.push_blocks(key, cache, s, d, src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=tensors)
    else:
        raise ValueError(f"op must be pull or push, got {op!r}")
    waited = _until_known(lambda: call(list(range(blocks)), list(range(blocks))))
    us = []
    pc = time.perf_counter
    for i in range(n + warmup):
        s, d = srcs[i], dsts[i]
        t0 = pc()
        call(s, d)
        dt = pc() - t0
        if i >= warmup:
            us.append(dt * 1e6)
    out = lat_summary(us)
    out["first_call_s"] = waited
    out["last"] = {"src": srcs[-1], "dst": dsts[-1]}
    return out


def cmd_cma_small_latency(self, pid: int, raddr: int, num_blocks: int, block_bytes: int, blocks: int, tensors: int,
                          tensor_bytes: int, n: int, warmup: int, write: bool = False, name: str = "main") -> dict:
    fn = _libc("process_vm_writev" if write else "process_vm_readv")
    laddr = int(self.bufs[name].ctypes.data)
    k = blocks * tensors
    srcs = _draws(num_blocks, blocks, n + warmup, 11)
    dsts = _draws(num_blocks, blocks, n + warmup, 12)
    tl = (np.arange(tensors, dtype=np.uint64) * np.uint64(tensor_bytes))[:, None]
    bb = np.uint64(block_bytes)
    iovs = []
    for i in range(n + warmup):  # built before timing: only the system call is timed
        s = np.asarray(srcs[i], np.uint64)
        d = np.asarray(dsts[i], np.uint64)
        liov = np.empty((k, 2), dtype=np.uint64)
        riov = np.empty((k, 2), dtype=np.uint64)
        liov[:, 0] = (np.uint64(laddr) + tl + d[None, :] * bb).reshape(-1)
        liov[:, 1] = bb
        riov[:, 0] = (np.uint64(raddr) + tl + s[None, :] * bb).reshape(-1)
        riov[:, 1] = bb
        iovs.append((liov, riov, liov.ctypes.data, riov.ctypes.data))
    want = k * block_bytes
    us = []
    pc = time.perf_counter
    for i in range(n + warmup):
        lp, rp = iovs[i][2], iovs[i][3]
        t0 = pc()
        got = fn(pid, lp, k, rp, k, 0)
        dt = pc() - t0
        if got != want:
            raise RuntimeError(f"process_vm_{'writev' if write else 'readv'} returned {got}, wanted {want}")
        if i >= warmup:
            us.append(dt * 1e6)
    return lat_summary(us)


def cmd_buf_info(self, name: str = "main") -> dict:
    import os

    return {"pid": os.getpid(), "addr": int(self.bufs[name].ctypes.data), "nbytes": int(self.bufs[name].nbytes)}


#: issue 21's targets: llmdd p50 / bare system call p50 of the same iovecs
TARGETS = {"pull_1x64k": 2.5, "push_1x64k": 2.5, "pull_8x2x16k": 3.0}


def rows(prompt, decoder, layouts: dict, n: int, warmup: int, *, salt_prompt: int, salt_decoder: int,
         prompt_id: int, step=None) -> dict:
    """The small-transfer rows and their anchors between a linked prompt and decoder whose 64 KiB
    and 16 KiB layouts (``layouts[block_bytes] = (model_id, num_blocks, buffer name)``) are registered.

    Anchors and llmdd rows are interleaved in one run (anchor, llmdd, anchor, llmdd, ...) so that
    their ratios see the same load. Leaves the prompt's buffers filled with ``salt_prompt`` again."""
    from llmdd._tools.bench.common import KiB

    out: dict = {}
    shapes = {"pull_1x64k": (64 * KiB, 1, 1, False), "push_1x64k": (64 * KiB, 1, 1, True),
              "pull_8x2x16k": (16 * KiB, 8, 2, False)}
    for row, (bb, blocks, tensors, write) in shapes.items():
        if bb not in layouts:
            out[row] = {"skipped": f"no {bb // KiB} KiB layout in this run"}
            continue
        mid, nb, name = layouts[bb]
        pinfo = prompt.call("buf_info", name=name)
        dinfo = decoder.call("buf_info", name=name)
        if write:
            decoder.call("fill", salt=salt_decoder, name=name)
        # a push anchor writes from the decoder into the prompt: process_vm_writev from the decoder
        anchor = decoder.call("cma_small_latency", pid=pinfo["pid"], raddr=pinfo["addr"], num_blocks=nb,
                              block_bytes=bb, blocks=blocks, tensors=tensors, tensor_bytes=nb * bb, n=n,
                              warmup=warmup, write=write, name=name)
        r = decoder.call("small_latency", op="push" if write else "pull", remote=prompt_id, model_id=mid,
                         remote_model_id=mid, num_blocks=nb, blocks=blocks, tensors=tensors, n=n, warmup=warmup)
        last = r.pop("last")
        checker, salt = (prompt, salt_decoder) if write else (decoder, salt_prompt)
        r.update(checker.call("check_blocks", num_tensors=tensors, tensor_bytes=nb * bb, block_bytes=bb,
                              dst_blocks=last["dst"], src_blocks=last["src"], salt=salt, name=name))
        if write:
            prompt.call("fill", salt=salt_prompt, name=name)
        ratio = r["p50"] / anchor["p50"] if anchor["p50"] else None
        out[row] = {"llmdd": r, "anchor": anchor, "ratio_p50": ratio, "target": TARGETS[row],
                    "met": ratio is not None and ratio <= TARGETS[row], "iovecs": blocks * tensors,
                    "bytes": blocks * tensors * bb, "anchor_call": "process_vm_writev" if write else "process_vm_readv",
                    "pid_check": dinfo["pid"] != pinfo["pid"]}
        if step is not None:
            step(f"small {row}: p50 {r['p50']:.1f} us vs bare {out[row]['anchor_call']} {anchor['p50']:.1f} us "
                 f"= {ratio:.2f}x (target <= {TARGETS[row]}x), verified={r['verified']}")
    return out


def cmd_shm_data_path(self) -> dict:
    """The shm plugin's active data path in this worker (``llmdd_shm.data_path()``), or why none."""
    try:
        import llmdd_shm
    except ImportError as exc:
        return {"native": False, "path": None, "reason": f"llmdd_shm not importable: {exc}"}
    return llmdd_shm.data_path()


#: the engine's stages timed by :func:`cmd_small_profile` (inclusive wall time per call):
#: (stage, object path from the worker's transfer engine ("transfers", or one of its parts:
#: "transfers.prepared"), attributes)
_STAGES = (
    ("transport (TransferEngine._move: channel read/write + wait)", "transfers", "_move"),
    ("prepared transfer (the channel's Channel.prepare result: checks, lock, copy, unlock in C)", "plans",
     "prepared"),
    ("planning (plan_blocks, PreparedPlan.ops)", "_planner_mod", "plan_blocks+ops"),
    ("plan lookup and layouts (PreparedPlans.lookup, local_layout, remote_layout)", "transfers.prepared", "lookup"),
    ("plan lookup and layouts (PreparedPlans.lookup, local_layout, remote_layout)", "transfers.layouts",
     "local_layout+remote_layout"),
    ("link lookup + turn (link_for + BusyTable.turn, its entry in rest)", "transfers", "link_for"),
    ("link lookup + turn (link_for + BusyTable.turn, its entry in rest)", "transfers._busy", "turn"),
    ("task lifecycle (tasks.create + every fire)", "tasks", "create"),
    ("owner notices (queue for the flusher)", "transfers._notices", "queue"),
)


def cmd_small_profile(self, op: str, remote: int, model_id: int, remote_model_id: int, num_blocks: int,
                      blocks: int, tensors: int, n: int, top: int = 30) -> dict:
    """Where one small ``pull_blocks`` / ``push_blocks`` spends its time, two ways:

    * ``stages``: a per-stage timer: the engine methods of :data:`_STAGES` wrapped (in this worker
      only, for this measurement only) with a ``perf_counter`` pair; median microseconds per call of
      each stage and of the whole call, over ``n`` calls (the wrappers' own cost included);
    * ``cprofile``: cProfile of ``n`` further calls (unwrapped), top ``top`` by cumulative and by
      internal time.
    """
    import cProfile
    import io
    import pstats
    import statistics
    import types

    import llmdd
    from llmdd._data import engine as _transfer, planner as _planner, prepared as _prepared

    cm = self.dd.cache_manager
    cache = self.caches[model_id]
    key = llmdd.BlocksCacheKey(remote, remote_model_id)
    one = range(0, 1)
    srcs = _draws(num_blocks, blocks, 2 * n, 21)
    dsts = _draws(num_blocks, blocks, 2 * n, 22)
    fn = cm.pull_blocks if op == "pull" else cm.push_blocks

    def call(i):
        fn(key, cache, srcs[i], dsts[i], src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=tensors)

    for i in range(min(100, n)):
        call(i)
    engine = cm._transfers
    # the engine's collaborators (the composition root hands them to it)
    core = types.SimpleNamespace(hooks=engine._hooks, tasks=engine._tasks)
    acc: dict = {}
    pc = time.perf_counter

    def wrap(obj, attr, stage):
        orig = getattr(obj, attr)

        def timed(*a, **k):
            t0 = pc()
            try:
                return orig(*a, **k)
            finally:
                acc[stage][-1] += pc() - t0
        setattr(obj, attr, timed)
        return obj, attr, orig

    restore = []
    for stage, where, attrs in _STAGES:
        acc.setdefault(stage, [])
        for attr in attrs.split("+"):
            if where == "_planner_mod":
                for mod in (_planner, _transfer, _prepared, _prepared.PreparedPlan):
                    if attr in vars(mod):
                        restore.append(wrap(mod, attr, stage))
            elif where == "hooks":
                restore.append(wrap(core.hooks, attr, stage))
            elif where == "tasks":
                restore.append(wrap(core.tasks, attr, stage))
            elif where == "plans":   # the kept plans' one-call paths (made by the warm-up calls)
                for plan in list(engine.prepared._plans.values()):
                    if getattr(plan, attr, None) is not None:
                        restore.append(wrap(plan, attr, stage))
            else:   # "transfers" or one of its parts ("transfers.prepared")
                target = engine
                for part in where.split(".")[1:]:
                    target = getattr(target, part)
                if hasattr(target, attr):
                    restore.append(wrap(target, attr, stage))
    # every task transition (fire) of the tasks this call creates counts as lifecycle
    fire_stage = "task lifecycle (tasks.create + every fire)"
    machine_cls = None
    orig_create = core.tasks.create

    def create(*a, **k):
        nonlocal machine_cls
        t = orig_create(*a, **k)
        if machine_cls is None:
            machine_cls = type(t)
            orig_fire = machine_cls.fire

            def fire(self_, *fa, **fk):
                t0 = pc()
                try:
                    return orig_fire(self_, *fa, **fk)
                finally:
                    acc[fire_stage][-1] += pc() - t0
            machine_cls.fire = fire
            restore.append((machine_cls, "fire", orig_fire))
        return t
    core.tasks.create = create
    total = []
    try:
        for i in range(n):
            for v in acc.values():
                v.append(0.0)
            t0 = pc()
            call(i)
            total.append(pc() - t0)
    finally:
        core.tasks.__dict__.pop("create", None)
        for obj, attr, orig in reversed(restore):
            if isinstance(obj, type):
                setattr(obj, attr, orig)
            elif obj is _planner or obj is _transfer or obj is _prepared or isinstance(obj, _prepared.PreparedPlan):
                setattr(obj, attr, orig)
            else:
                obj.__dict__.pop(attr, None)
    stages = {s: round(statistics.median(v) * 1e6, 2) for s, v in acc.items()}
    whole = statistics.median(total) * 1e6
    stages["rest (argument checks, facade, glue)"] = round(whole - sum(stages.values()), 2)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n, 2 * n):
        call(i)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return {"op": op, "blocks": blocks, "tensors": tensors, "n": n, "whole_p50_us": round(whole, 2),
            "stages_p50_us": stages, "cprofile": text.getvalue()}


def cmd_transports(self) -> dict:
    """The engine's transports: registered plugins, endpoints opened so far, and each link's transport."""
    lm = self.dd._core.link_manager
    return {"registered": sorted(lm.registry.names()), "endpoints_open": sorted(lm.endpoints.open),
            "links": {str(k): v.get("transport") for k, v in self.dd.statistics()["links"].items()}}


_COMMANDS = (cmd_transports, cmd_small_profile, cmd_shm_data_path, cmd_small_latency, cmd_cma_small_latency,
             cmd_buf_info)


def install(worker_cls: type) -> None:
    """Add the commands above to ``worker_cls``, each under its own name (``cmd_<name>``)."""
    for command in _COMMANDS:
        setattr(worker_cls, command.__name__, command)


__all__ = ["install", "rows", "TARGETS", "cmd_small_latency", "cmd_cma_small_latency"]


#: how the rows read in the report table
_ROW_TITLES = {"pull_1x64k": "`pull_blocks` 1 x 64 KiB", "push_1x64k": "`push_blocks` 1 x 64 KiB",
               "pull_8x2x16k": "`pull_blocks` 8 x 2 x 16 KiB"}


def markdown(results: list, names: list) -> list:
    """The lines of a markdown table of ``bench/small_transfers.py`` runs (its ``results.json`` each,
    ``names`` the paths they were read from): per run and row, the median ratio to the bare system
    call of each data path with every run's ratio and llmdd p50, the target and the verdict on the
    median (what the script computed: ``met``)."""
    out = ["| run (load before -> after) | row | pure Python: ratio (runs) | C path: ratio (runs) | "
           "C path llmdd p50 us (runs) | bare call p50 us (runs) | target | met (C path) |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for res, name in zip(results, names):
        load = f"{res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}"
        summary = res["summary"]
        for row, title in _ROW_TITLES.items():
            py, nat = summary.get("python", {}).get(row), summary.get("native", {}).get(row)

            def cell(v: dict | None) -> str:
                if v is None:
                    return "-"
                return f"{v['ratio_p50_median']:.2f}x ({', '.join(f'{x:.2f}' for x in v['ratios'])})"

            us = (", ".join(f"{x:.1f}" for x in nat["llmdd_p50_us"]) if nat else "-")
            bare = (", ".join(f"{x:.1f}" for x in nat["anchor_p50_us"]) if nat else "-")
            met = "-" if nat is None else ("**yes**" if nat["met"] and nat["verified"] else "**no**")
            target = (nat or py or {}).get("target", TARGETS[row])
            out.append(f"| `{name}` ({load}) | {title} | {cell(py)} | {cell(nat)} | {us} | {bare} | "
                       f"{target}x | {met} |")
    return out
