"""Orchestration of ``llmdd demo``: the reference run, the prompt and decoder processes, the faults.

:func:`run_demo` returns a :class:`DemoResult`; it never prints.  Progress notes go to the
optional ``progress`` callback (the CLI prints them).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from llmdd._tools.demo._corrupt import corrupt_requested, default_spot
from llmdd._tools.demo._verify import ReferenceKV
from llmdd._tools.demo.model import Model, ModelConfig, PagedKVCache, make_prompt, shuffled_table
from llmdd._tools.demo.roles import DEFAULT_SYNC_KV_TIMEOUT_MS, decoder_main, prompt_main

__all__ = ["DemoOptions", "DemoResult", "DemoError", "run_demo", "QUICK", "DEFAULTS"]

PROMPT_CLUSTER = 1
FIRST_DECODER_CLUSTER = 101
FAULT_SYNC_KV_TIMEOUT_MS = 2000

#: (prompt tokens, generated tokens) of a default and of a ``--quick`` run
DEFAULTS = (1024, 32)
QUICK = (256, 8)


class DemoError(RuntimeError):
    """The demo could not run (a child failed to start, answered with an error, or timed out)."""


@dataclass
class DemoOptions:
    prompt_len: int = DEFAULTS[0]
    tokens: int = DEFAULTS[1]
    decoders: int = 1
    transport: str = "auto"
    mode: str = "pull"
    seed: int = 0
    faults: str = "none"
    corrupt_kv: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    sync_kv_timeout_ms: Optional[int] = None
    step_timeout_s: float = 90.0

    def check(self) -> None:
        if self.prompt_len < 2:
            raise ValueError("--prompt-len must be at least 2")
        if self.tokens < 1:
            raise ValueError("--tokens must be at least 1")
        if not 1 <= self.decoders <= 8:
            raise ValueError("--decoders must be in 1..8")
        if self.transport not in ("auto", "tcp", "shm", "ucx"):
            raise ValueError("--transport must be auto, tcp, shm or ucx")
        if self.mode not in ("pull", "push"):
            raise ValueError("--mode must be pull or push")
        if self.faults not in ("none", "kill", "stall"):
            raise ValueError("--faults must be none, kill or stall")
        if self.faults != "none" and self.mode != "pull":
            raise ValueError("--faults interrupts a pull_blocks: use it with --mode pull")
        if self.faults != "none" and self.model.n_layers < 2:
            raise ValueError("--faults needs at least 2 layers (the fault lands between two layer ranges)")

    @property
    def timeout_ms(self) -> int:
        if self.sync_kv_timeout_ms is not None:
            return self.sync_kv_timeout_ms
        return FAULT_SYNC_KV_TIMEOUT_MS if self.faults != "none" else DEFAULT_SYNC_KV_TIMEOUT_MS


@dataclass
class DemoResult:
    options: dict
    model: dict
    prompt_len: int
    kv_bytes: int
    prompt_blocks: int
    num_blocks: int
    reference: dict
    prompts: list = field(default_factory=list)      # every prompt process started, in order
    decoders: list = field(default_factory=list)     # per decoder: pid, cluster, table, link, pull, decode
    prefill: dict = field(default_factory=dict)      # the prefill whose KV was finally decoded from
    fault: Optional[dict] = None
    recovery: Optional[dict] = None
    transport: dict = field(default_factory=dict)
    events: dict = field(default_factory=dict)       # process label -> list of event records
    corrupted: Optional[dict] = None
    wall_s: float = 0.0

    @property
    def verified(self) -> list[dict]:
        out = []
        ref = self.reference["tokens"]
        for d in self.decoders:
            decode = d.get("decode") or {}
            kv = decode.get("kv_check") or {"equal": False}
            tokens = decode.get("tokens")
            same = tokens == ref
            first_diff = None
            if tokens is not None and not same:
                first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                  min(len(tokens), len(ref)))
            out.append({"decoder": d["label"], "kv_equal": bool(kv.get("equal")), "kv": kv,
                        "tokens_equal": same, "first_token_diff": first_diff})
        return out

    @property
    def ok(self) -> bool:
        checks = self.verified
        good = bool(checks) and all(c["kv_equal"] and c["tokens_equal"] for c in checks)
        if self.fault is not None:
            good = good and self.recovery is not None and self.recovery.get("recovered", False)
        return good


# --------------------------------------------------------------------------- children


class _Child:
    """One spawned role process and its pipe."""

    def __init__(self, ctx, label: str, target, spec: dict, timeout_s: float, started: list) -> None:
        self.label = label
        self.timeout_s = timeout_s
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, spec), name=f"llmdd-demo-{label}")
        self.ready: Optional[dict] = None
        self.gone = False
        # started with SIGINT blocked (the child ignores it once it runs, roles._main): Ctrl-C reaches the
        # whole process group, and only this process answers it, by stopping the children (close)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.proc.start()
            child_conn.close()
            self.pid = self.proc.pid
            started.append(self)   # before a Ctrl-C held back meanwhile is delivered: its cleanup closes this one
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def send(self, command: str, **args: Any) -> None:
        self.conn.send((command, args))

    def recv(self, timeout_s: Optional[float] = None, expect: tuple = ("ok",)) -> Any:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                waited = timeout_s or self.timeout_s
                raise DemoError(f"{self.label} (pid {self.pid}) did not answer within {waited:.0f} s")
            try:
                if self.conn.poll(min(left, 0.2)):
                    tag, payload = self.conn.recv()
                    break
            except (EOFError, OSError):
                raise DemoError(f"{self.label} (pid {self.pid}) exited (code {self.proc.exitcode})") from None
            if not self.proc.is_alive() and not self.conn.poll(0):
                self.proc.join(0.1)
                raise DemoError(f"{self.label} (pid {self.pid}) exited (code {self.proc.exitcode})")
        if tag == "error":
            raise DemoError(f"{self.label} failed: {payload['type']}: {payload['message']}"
                            + (f" [{payload['status_code']}]" if payload.get("status_code") else "")
                            + f"\n{payload.get('traceback', '')}")
        if tag not in expect:
            raise DemoError(f"{self.label} answered {tag!r}, expected one of {expect}")
        return payload

    def call(self, command: str, timeout_s: Optional[float] = None, **args: Any) -> Any:
        self.send(command, **args)
        return self.recv(timeout_s)

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def close(self) -> None:
        if self.gone:
            return
        self.gone = True
        if self.proc.is_alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.conn.send(("exit", {}))
                # the answer of a command still running (an interrupted run) may come first: wait for the
                # exit's own ("bye": the engine is finalized, its shared memory released)
                deadline = time.monotonic() + self.timeout_s
                while (left := deadline - time.monotonic()) > 0 and self.conn.poll(left):
                    if self.conn.recv()[0] == "bye":
                        break
            except (EOFError, OSError, ProcessLookupError):
                pass
            self.proc.join(5.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5.0)
                _remove_shm_of(self.pid)
        self.conn.close()


def _gather(children: list[_Child], timeout_s: float, expect: tuple = ("ok",)) -> list:
    return [c.recv(timeout_s, expect) for c in children]


# --------------------------------------------------------------------------- the run


def _reference(model: Model, prompt: list[int], n_tokens: int, num_blocks: int, seed: int) -> tuple[dict, np.ndarray]:
    """Everything in one process: prefill into a paged cache, then greedy decode from it."""
    cfg = model.config
    cache = PagedKVCache(cfg, num_blocks)
    table = shuffled_table(num_blocks, cfg.blocks_for(len(prompt) + n_tokens), [seed, 3])
    start = time.monotonic()
    model.prefill(prompt, cache, table)
    prefill_s = time.monotonic() - start
    kv = cache.gather_all(table, len(prompt))
    marks: list[float] = []
    start = time.monotonic()
    tokens = model.generate(prompt, cache, table, n_tokens, on_token=lambda s, t: marks.append(time.monotonic()))
    return {"tokens": tokens, "prefill_s": prefill_s, "first_step_s": marks[0] - start,
            "decode_s": marks[-1] - start, "table": table[:cfg.blocks_for(len(prompt))]}, kv


def run_demo(opts: DemoOptions, progress: Callable[[str], None] = lambda line: None) -> DemoResult:
    opts.check()
    began = time.monotonic()
    cfg = opts.model.with_seed(opts.seed)
    T, N = opts.prompt_len, opts.tokens
    prompt_blocks = cfg.blocks_for(T)
    needed = cfg.blocks_for(T + N)
    num_blocks = needed + needed // 2 + 4
    prompt = make_prompt(cfg, T, opts.seed)
    transport = opts.transport
    transport_note = None
    if opts.faults == "stall" and transport == "auto":
        # a SIGSTOPped process's memory stays readable through shm (process_vm_readv needs no help
        # from the peer, as an RDMA read needs none): the stall shows on a transport served by the peer
        transport = "tcp"
        transport_note = ("--faults stall with --transport auto uses tcp: shm reads a stopped process's "
                          "memory directly (process_vm_readv), so a stall would not show there")
    ctx = multiprocessing.get_context("spawn")
    step = opts.step_timeout_s
    base_spec = {"model": asdict(cfg), "num_blocks": num_blocks, "transport": transport,
                 "sync_kv_timeout_ms": opts.timeout_ms}
    corrupt = default_spot(T) if corrupt_requested(opts.corrupt_kv) else None

    result = DemoResult(options={**asdict(opts), "model": None, "sync_kv_timeout_ms": opts.timeout_ms,
                                 "corrupt_kv": corrupt is not None, "transport_used": transport,
                                 "transport_note": transport_note},
                        model=asdict(cfg), prompt_len=T, kv_bytes=T * cfg.kv_bytes_per_token,
                        prompt_blocks=prompt_blocks, num_blocks=num_blocks, reference={})
    children: list[_Child] = []
    ref_kv: Optional[ReferenceKV] = None

    def start_prompt(attempt: int) -> _Child:
        spec = dict(base_spec, cluster_id=PROMPT_CLUSTER, listen="127.0.0.1:0")
        return _Child(ctx, "prompt" if attempt == 0 else f"prompt#{attempt + 1}", prompt_main, spec, step, children)

    try:
        prompt_proc = start_prompt(0)
        decoders = []
        for i in range(opts.decoders):
            table = shuffled_table(num_blocks, needed, [opts.seed, 2, i])
            spec = dict(base_spec, cluster_id=FIRST_DECODER_CLUSTER + i, table=table)
            child = _Child(ctx, f"decoder {i + 1}", decoder_main, spec, step, children)
            decoders.append(child)
            result.decoders.append({"label": child.label, "pid": child.pid, "cluster_id": FIRST_DECODER_CLUSTER + i,
                                    "table": table[:prompt_blocks]})

        prompt_proc.ready = prompt_proc.recv(step)
        for d in decoders:
            d.ready = d.recv(step)
        # the role processes wait idle now: the reference's timings are not disturbed by them
        progress(f"reference: prefill + {N} tokens in this process (pid {os.getpid()})")
        model = Model(cfg)
        reference, kv = _reference(model, prompt, N, num_blocks, opts.seed)
        result.reference = reference
        ref_kv = ReferenceKV(kv)
        del kv, model
        result.prompts.append({"label": prompt_proc.label, "pid": prompt_proc.pid,
                               "listen": prompt_proc.ready["listen"]})

        def link_all(target: _Child) -> None:
            ready = target.ready
            if ready is None:   # every child reported ready above, before any link
                raise RuntimeError(f"{target.label} has not reported ready")
            ip, port = ready["listen"]
            for d in decoders:
                d.send("link", ip=ip, port=port, prompt_cluster=PROMPT_CLUSTER)
            for d, rec in zip(decoders, _gather(decoders, step)):
                entry = next(x for x in result.decoders if x["label"] == d.label)
                entry.setdefault("links", []).append(rec)
                if rec["status"] != "LLM_SUCCESS":
                    raise DemoError(f"{d.label}: link_clusters to {ip}:{port} returned {rec['status']}")

        link_all(prompt_proc)
        progress(f"linked {len(decoders)} decoder(s) to the prompt at {prompt_proc.ready['listen'][0]}:"
                 f"{prompt_proc.ready['listen'][1]}")

        def prefill(target: _Child, push: bool, attempt: int = 0) -> dict:
            table = shuffled_table(num_blocks, prompt_blocks, [opts.seed, 1, attempt])
            args: dict[str, Any] = {"prompt": prompt, "table": table}
            if push:
                args["push"] = [(FIRST_DECODER_CLUSTER + i, result.decoders[i]["table"]) for i in range(len(decoders))]
            out = target.call("prefill", step, **args)
            out["prompt"] = target.label
            return out

        if opts.mode == "push":
            progress("prefill on the prompt, pushing each layer with transfer_cache_async as soon as it is written")
            result.prefill = prefill(prompt_proc, push=True)
            for entry, push in zip(result.decoders, result.prefill["push"]):
                entry["push"] = push
                if push["status"] != "LLM_SUCCESS":
                    raise DemoError(f"push to {entry['label']} failed: {push['status']} {push['results']}")
        else:
            progress("prefill on the prompt into a shuffled block table")
            result.prefill = prefill(prompt_proc, push=False)
            src = result.prefill["src_blocks"]
            if opts.faults == "none":
                for d in decoders:
                    d.send("pull", src_blocks=src, prompt_len=T)
                for entry, rec in zip(result.decoders, _gather(decoders, step)):
                    entry["pull"] = rec
            else:
                prompt_proc = _fault_and_recover(opts, result, prompt_proc, decoders, src, progress, step,
                                                 start_prompt, link_all, prefill)

        progress(f"decoding {N} tokens on {len(decoders)} decoder(s) and checking against the reference")
        for i, d in enumerate(decoders):
            d.send("decode", prompt=prompt, n_tokens=N, reference=ref_kv.handle,
                   corrupt=corrupt if i == 0 else None)
        for entry, rec in zip(result.decoders, _gather(decoders, step)):
            entry["decode"] = rec
            if rec.get("corrupted"):
                result.corrupted = dict(rec["corrupted"], decoder=entry["label"])

        progress("collecting statistics and hook events")
        live = [c for c in children if not c.gone and c.proc.is_alive()]
        for c in live:
            stats = c.call("stats", step)
            result.events[c.label] = stats["events"]
            if c in decoders:
                link = stats["links"].get(PROMPT_CLUSTER)
                entry = next(x for x in result.decoders if x["label"] == c.label)
                entry["link_stats"] = link
                if link is not None and not result.transport:
                    result.transport = {"name": link["transport"], "reason": link["transport_reason"]}
        progress("stopping the role processes")
    finally:
        for c in children:
            try:
                c.close()
            except Exception:  # best effort: every child is reaped below regardless
                pass
        for c in children:
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join(5.0)
                _remove_shm_of(c.pid)
        if ref_kv is not None:
            ref_kv.close()
    result.wall_s = time.monotonic() - began
    return result


def _remove_shm_of(pid: int) -> list[str]:
    """Remove the shared-memory segments the shm transport of the killed prompt ``pid`` left behind.

    A SIGKILLed engine never closes its endpoint; its segments are named ``llmdd_<pid>_...``.
    Only the process this demo started and killed is concerned.
    """
    removed: list[str] = []
    root = "/dev/shm"
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if name.startswith(f"llmdd_{pid}_"):
            try:
                os.unlink(os.path.join(root, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _fault_and_recover(opts: DemoOptions, result: DemoResult, prompt_proc: _Child, decoders: list[_Child],
                       src: list, progress, step: float, start_prompt, link_all, prefill) -> _Child:
    """Pull in two layer ranges, kill or stall the prompt between them, show the error, recover."""
    T = opts.prompt_len
    split = opts.model.n_layers // 2
    for d in decoders:
        d.send("pull", src_blocks=src, prompt_len=T, split_layer=split)
    halves = _gather(decoders, step, expect=("half",))
    fault: dict[str, Any] = {"kind": opts.faults, "after_layers": split, "layers": opts.model.n_layers,
                             "prompt_pid": prompt_proc.pid, "sync_kv_timeout_ms": opts.timeout_ms}
    if opts.faults == "kill":
        prompt_proc.signal(signal.SIGKILL)
        prompt_proc.proc.join(10.0)
        prompt_proc.gone = True
        fault["cleaned"] = _remove_shm_of(prompt_proc.pid)
        fault["action"] = f"SIGKILL to the prompt (pid {prompt_proc.pid}) after layers 0..{split - 1} were pulled"
    else:
        prompt_proc.signal(signal.SIGSTOP)
        fault["action"] = f"SIGSTOP to the prompt (pid {prompt_proc.pid}) after layers 0..{split - 1} were pulled"
    fault["at"] = time.monotonic()
    progress(fault["action"] + f"; the decoders now pull layers {split}..{opts.model.n_layers - 1}")
    for d in decoders:
        d.send("continue")
    outcomes = _gather(decoders, step + opts.timeout_ms / 1000.0)
    fault["decoders"] = [dict(o, label=d.label, half=h) for d, o, h in zip(decoders, outcomes, halves)]
    fault["surfaced"] = all(o["failed"] for o in outcomes)
    result.fault = fault

    recovery: dict[str, Any] = {"steps": []}
    if opts.faults == "kill":
        new = start_prompt(1)
        new.ready = new.recv(step)
        result.prompts.append({"label": new.label, "pid": new.pid, "listen": new.ready["listen"]})
        recovery["steps"].append(f"started a new prompt process (pid {new.pid}, cluster {PROMPT_CLUSTER}) "
                                 f"listening on {new.ready['listen'][0]}:{new.ready['listen'][1]}")
        target = new
    else:
        prompt_proc.signal(signal.SIGCONT)
        recovery["steps"].append(f"SIGCONT to the prompt (pid {prompt_proc.pid})")
        target = prompt_proc
    progress(recovery["steps"][-1])
    for d in decoders:
        d.send("unlink", prompt_cluster=PROMPT_CLUSTER, force=True)
    unlinks = _gather(decoders, step)
    recovery["unlink"] = unlinks
    recovery["steps"].append("unlink_clusters(force=True) on every decoder: "
                             + ", ".join(u["status"] for u in unlinks))
    progress(recovery["steps"][-1])
    link_all(target)
    recovery["steps"].append("link_clusters again: " + ", ".join(
        e["links"][-1]["status"] for e in result.decoders))
    if opts.faults == "kill":
        result.prefill = prefill(target, push=False, attempt=1)
        src = result.prefill["src_blocks"]
        recovery["steps"].append(f"prefill again on the new prompt ({result.prefill['prefill_s']:.2f} s)")
    for d in decoders:
        d.send("pull", src_blocks=src, prompt_len=T)
    pulls = _gather(decoders, step)
    for entry, rec in zip(result.decoders, pulls):
        entry["pull"] = rec
    recovery["steps"].append("pull_blocks retried: " + ", ".join(
        "ok" if not p["failed"] else "FAILED" for p in pulls))
    recovery["recovered"] = all(not p["failed"] for p in pulls)
    result.recovery = recovery
    return target
