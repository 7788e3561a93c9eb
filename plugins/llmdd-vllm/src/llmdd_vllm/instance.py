"""One vLLM instance in a process of its own, driven by JSON lines (tests, the example, benchmarks).

``python -m llmdd_vllm.instance --model DIR [--role kv_producer|kv_consumer] [--extra JSON]`` starts
an offline ``vllm.LLM`` (CPU, eager, no tokenizer) and answers one JSON line on stdout per
command line read on stdin.  Commands (``{"op": ...}``):

* ``generate``: ``prompts`` (token id lists), ``max_tokens`` (one or one per prompt), optional ``params`` (one
  ``kv_transfer_params`` dict or null per prompt) and ``hold`` (request indices added only after
  the first request produced a token); answers per request its tokens, ``kv_transfer_params``,
  first-token and finish times (seconds after the batch started) and the batch's wall time; with
  ``events`` true it also writes one ``{"event": "finished", "index", "s"}`` line per request as it
  finishes (:meth:`Instance.wait_event`); with ``abort`` (request indices) those requests are aborted
  (``LLMEngine.abort_request``) as soon as the workers report ``abort_after_pulls`` (default: as
  many as ``abort``) more pulls started (``pulls_started``: the batch's KV transfer is under way), and answer ``{"aborted": true, "aborted_at"}``
  (``time.monotonic()``, comparable across processes of the host);
* ``metrics``: vLLM's own counters (``llm.get_metrics()``): prompt tokens by source and others, and
  ``kv_cache_usage`` (the gauge as of the last step this process saw);
* ``counters``: the worker-side connector's counters (through ``LLM.collective_rpc``);
* ``quit``.

Before it answers ready, the instance warms up (unless ``--no-warmup``): two local batches of
different shapes (:func:`_warm_up`).  vLLM compiles some helpers with ``torch.compile`` at their first
call, whatever ``enforce_eager`` says (on CPU with tensor parallelism, ``get_masked_input_and_mask``
of the vocab-parallel embedding: inductor code generation and a C++ build); the compile holds the
worker process's GIL for seconds, tens of seconds on a loaded host, and llmdd's threads in that
process make no progress meanwhile (a link's handshake times out, a prefill's lease runs out
unrenewed: docs/vllm.md, "Warm up before serving").  A served instance must not meet that first
call with transfers under way; neither do these instances.

:class:`Instance` is the parent's handle: it starts the process and sends commands.
Protocol lines on stdout start with ``@@`` (vLLM logs there too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Optional

PREFIX = "@@"


def _metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        name = m.name
        labels = getattr(m, "labels", {}) or {}
        value = getattr(m, "value", None)
        if value is None:
            continue
        if name == "vllm:prompt_tokens_by_source":
            out.setdefault("prompt_tokens_by_source", {})[labels.get("source", "?")] = value
        elif name == "vllm:kv_cache_usage_perc":
            out["kv_cache_usage"] = value
        elif name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prompt_tokens_cached",
                      "vllm:request_success"):
            out[name.split(":", 1)[1]] = out.get(name.split(":", 1)[1], 0) + value
    return out


def _generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = cmd["prompts"]
    params = cmd.get("params") or [None] * len(prompts)
    hold = set(cmd.get("hold") or ())
    engine = llm.llm_engine
    base = f"b{time.monotonic_ns()}-"
    ids = []
    pending = []
    t0 = time.monotonic()

    max_tokens = cmd["max_tokens"]
    max_tokens = list(max_tokens) if isinstance(max_tokens, list) else [max_tokens] * len(prompts)

    def add(i: int) -> None:
        extra = {"kv_transfer_params": params[i]} if params[i] is not None else None
        sp = SamplingParams(max_tokens=int(max_tokens[i]), temperature=0.0, ignore_eos=True,
                            detokenize=False, extra_args=extra)
        engine.add_request(base + str(i), TokensPrompt(prompt_token_ids=list(prompts[i])), sp)

    for i in range(len(prompts)):
        ids.append(base + str(i))
        if i in hold:
            pending.append(i)
        else:
            add(i)
    res: dict = {}
    first: dict = {}
    abort = sorted(set(cmd.get("abort") or ()))
    started0 = _pulls_started(llm) if abort else 0
    after = int(cmd.get("abort_after_pulls", len(abort)))
    deadline = t0 + float(cmd.get("timeout_s", 300))
    while len(res) < len(prompts):
        if time.monotonic() > deadline:
            raise TimeoutError(f"generate: {len(res)} of {len(prompts)} requests done by the deadline")
        if abort and _pulls_started(llm) - started0 >= after:
            engine.abort_request([ids[i] for i in abort])
            at = time.monotonic()
            for i in abort:
                res.setdefault(i, {"aborted": True, "aborted_at": at, "tokens": []})
            abort = []
            continue
        for out in engine.step():
            now = time.monotonic() - t0
            if out.request_id.startswith(base):
                i = int(out.request_id[len(base):].split("-")[0])
            else:
                i = next((k for k, rid in enumerate(ids) if out.request_id.startswith(rid)), -1)
            if i < 0 or res.get(i, {}).get("aborted"):
                continue        # a request of an earlier batch, or one this batch aborted
            if out.outputs and out.outputs[0].token_ids and i not in first:
                first[i] = now
                if pending:
                    for k in pending:
                        add(k)
                    pending = []
            if out.finished and cmd.get("events") and i not in res:
                _say({"event": "finished", "index": i, "s": now})
            if out.finished:
                res[i] = {"tokens": list(out.outputs[0].token_ids), "kv_transfer_params": out.kv_transfer_params,
                          "first_token_s": first.get(i), "finished_s": now}
        if not engine.has_unfinished_requests() and pending:
            for k in pending:
                add(k)
            pending = []
    return {"results": [res[i] for i in range(len(prompts))], "wall_s": time.monotonic() - t0}


def _warm_up(llm) -> float:
    """Two local batches of different shapes (the first call of a ``torch.compile``'d helper compiles
    for its shape, the second for any shape: ``dynamic=True`` after one recompile); the seconds taken."""
    t0 = time.monotonic()
    for lengths, max_tokens in (((5, 9), 2), ((17, 3, 40), 3)):
        prompts = [[3 + (7 * i + j) % 61 for j in range(n)] for i, n in enumerate(lengths)]
        _generate(llm, {"prompts": prompts, "max_tokens": max_tokens})
    return time.monotonic() - t0


def _pulls_started(llm) -> int:
    from llmdd_vllm import worker_counters

    return sum(int(c.get("pulls_started", 0)) for c in llm.collective_rpc(worker_counters))


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--role", choices=["kv_producer", "kv_consumer", "kv_both"], default=None)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config as JSON")
    ap.add_argument("--connector", default="LlmddConnector",
                    help="the KV connector with --role: LlmddConnector (this package) or one of vLLM's own "
                         "(NixlConnector: scripts/bench_vllm_ttft.py --compare-nixl)")
    ap.add_argument("--kv-buffer-device", default=None, help="kv_buffer_device of the KV transfer config")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="num_gpu_blocks_override: this many KV blocks instead of what --kv-space-gib holds (memory)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-space-gib", default="1")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (> 1: one worker process per rank)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="answer ready without the two local warm-up batches (module docstring)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_space_gib)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")     # collective_rpc(worker_counters)
    # vLLM's CPU worker binds its OpenMP threads, one core each, by default ("auto"): every instance
    # on a host takes the same cores, its main thread the first one. Two or three instances here
    # (prefill, decode, a control) then run all their worker main threads, and the llmdd threads
    # they start, on one core, where an instance holding blocks for a transfer spins between
    # engine steps (issue 20). Several instances on one host need disjoint core lists
    # (VLLM_CPU_OMP_THREADS_BIND="0-3", "4-7", ...) or none; set one in the environment to override.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    kw: dict[str, Any] = dict(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                              block_size=args.block_size, max_model_len=args.max_model_len, seed=0,
                              enable_prefix_caching=False, disable_log_stats=False)
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    if args.tp > 1:
        kw.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    if args.role:
        from vllm.config import KVTransferConfig

        own = args.connector == "LlmddConnector"
        tkw: dict[str, Any] = dict(kv_connector=args.connector, kv_role=args.role, kv_load_failure_policy="recompute",
                                   kv_connector_extra_config=json.loads(args.extra))
        if own:
            tkw["kv_connector_module_path"] = "llmdd_vllm"
        if args.kv_buffer_device:
            tkw["kv_buffer_device"] = args.kv_buffer_device
        kw["kv_transfer_config"] = KVTransferConfig(**tkw)
        kw["disable_hybrid_kv_cache_manager"] = True
    t0 = time.monotonic()
    llm = LLM(**kw)
    warmup_s = None if args.no_warmup else _warm_up(llm)
    _say({"ready": True, "start_s": time.monotonic() - t0, "warmup_s": warmup_s, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["op"] == "generate":
                _say(_generate(llm, cmd))
            elif cmd["op"] == "metrics":
                _say(_metrics(llm))
            elif cmd["op"] == "counters":
                from llmdd_vllm import worker_counters

                _say({"workers": llm.collective_rpc(worker_counters)})
            elif cmd["op"] == "quit":
                _say({"bye": True})
                break
            else:
                _say({"error": f"unknown op {cmd['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - the parent gets the error as an answer
            _say({"error": f"{type(exc).__name__}: {exc}"})
    del llm
    return 0


def _say(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Instance:
    """Parent-side handle of one instance process (``with Instance(...) as inst: inst.call(...)``)."""

    def __init__(self, model: str, *, role: Optional[str] = None, extra: Optional[dict] = None,
                 env: Optional[dict] = None, log_path: Optional[str] = None, python: str = sys.executable,
                 start_timeout_s: float = 300, nice: int = 0, max_model_len: int = 1024,
                 kv_space_gib: str = "1", wait: bool = True, tp: int = 1, connector: str = "LlmddConnector",
                 kv_buffer_device: Optional[str] = None, num_blocks: Optional[int] = None,
                 warmup: bool = True) -> None:
        cmd = [python, "-m", "llmdd_vllm.instance", "--model", model, "--extra", json.dumps(extra or {}),
               "--max-model-len", str(max_model_len), "--kv-space-gib", kv_space_gib, "--tp", str(tp),
               "--connector", connector]
        if kv_buffer_device:
            cmd += ["--kv-buffer-device", kv_buffer_device]
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        if role:
            cmd += ["--role", role]
        if not warmup:
            cmd += ["--no-warmup"]
        if nice:
            cmd = ["nice", "-n", str(nice)] + cmd
        full_env = dict(os.environ)
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
        self._log_path = log_path
        self._log = open(log_path, "a") if log_path else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log or subprocess.DEVNULL, text=True, env=full_env,
                                     start_new_session=True)
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if stdin is None or stdout is None:   # both are pipes (stdin=PIPE, stdout=PIPE above)
            raise RuntimeError("vLLM instance process started without its pipes")
        self._stdin, self._stdout = stdin, stdout
        self._lines: list = []
        self._events: list = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._start_timeout_s = start_timeout_s
        self.ready: Optional[dict] = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict:
        """Block until the instance answered that vLLM started (``start_timeout_s``)."""
        if self.ready is None:
            out = self._next(self._start_timeout_s)
            if not out.get("ready"):
                raise RuntimeError(f"instance did not start: {out}")
            self.ready = out
        return self.ready

    def _read(self) -> None:
        for line in self._stdout:
            if line.startswith(PREFIX):
                obj = json.loads(line[len(PREFIX):])
                with self._cv:
                    (self._events if "event" in obj else self._lines).append(obj)
                    self._cv.notify_all()
            elif self._log is not None:
                self._log.write(line)
                self._log.flush()
        with self._cv:
            self._lines.append({"error": f"instance exited with {self.proc.wait()}"})
            self._cv.notify_all()

    def _next(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer from the instance within {timeout} s; its log ends:\n"
                                       + self.log_tail())
                self._cv.wait(left)
            return self._lines.pop(0)

    def wait_event(self, match, timeout: float) -> dict:
        """The first event line (of a command submitted with ``events``) for which ``match(event)``
        is true, waiting up to ``timeout`` s; an instance that exits or answers first raises."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for ev in self._events:
                    if match(ev):
                        return ev
                if self._lines:
                    raise RuntimeError(f"the instance answered before the event: {self._lines[0]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching event within {timeout} s; its log ends:\n" + self.log_tail())
                self._cv.wait(left)

    def call(self, timeout: float = 300, **cmd: Any) -> dict:
        """Send one command and wait (``timeout`` s) for its answer; an error answer raises."""
        self.submit(**cmd)
        return self.result(timeout)

    def submit(self, **cmd: Any) -> None:
        """Send one command without waiting; :meth:`result` collects the answer."""
        self.wait_ready()
        self._stdin.write(json.dumps(cmd) + "\n")
        self._stdin.flush()

    def result(self, timeout: float = 300) -> dict:
        out = self._next(timeout)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def log_tail(self, lines: int = 40) -> str:
        if not self._log_path:
            return "(no log)"
        try:
            with open(self._log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def kill(self) -> None:
        """SIGKILL the instance and every process it started (its session)."""
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def close(self, timeout: float = 60) -> None:
        if self.proc.poll() is None and self.ready is not None:
            try:
                self.call(op="quit", timeout=timeout)
                self._stdin.close()
                self.proc.wait(timeout)
            except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


if __name__ == "__main__":
    sys.exit(main())
