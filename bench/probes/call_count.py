"""Python calls per one-block pull_blocks / push_blocks, counted (not timed), in one or two source trees.

The one-block latency of ``bench/probes/latency_path.py`` (one 64 KiB block of one tensor per call)
is mostly the engine's Python on the caller's thread; on a loaded machine its time moves by more
than the differences looked for, while the number of Python function calls it makes does not.
This probe counts them with :func:`sys.setprofile` on the calling thread (``call`` events: Python
functions and generators resumed; ``c_call`` events: builtins and C methods) over ``--n`` calls of
each, after a warm-up, and reports the calls per transfer and which functions they were.

The prompt side is a spawned bench worker (:mod:`llmdd._tools.bench.worker`); the decoder side is
a worker object in this process, so its calls are the ones counted.  Other threads (the I/O loop,
the owner's side) are not counted: the one-block pull and push run on the caller's thread.

One tree (the one whose interpreter runs it):

    .venv/bin/python bench/probes/call_count.py --transport shm --n 200 --json OUT.json

Two trees, A and B, each with its own ``.venv`` (each runs this file as its child), and their diff:

    .venv/bin/python bench/probes/call_count.py --tree A=/work/wt/prepare-base --tree B=. --transport shm
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile

BB = 64 * 1024
PROMPT, DECODER = 1, 2
NUM_TENSORS = 4


def _where(code_file: str) -> str:
    for mark in ("/llmdd/", "/src/", "/lib/python"):
        i = code_file.rfind(mark)
        if i >= 0:
            return code_file[i + 1:]
    return os.path.basename(code_file)


def count_one_tree(transport: str, n: int, warmup: int) -> dict:
    """This interpreter's tree: the calls per one-block pull and push over ``transport``."""
    import llmdd
    from llmdd._tools.bench.runner import close_all, start_peers
    from llmdd._tools.bench.worker import Worker

    spawn = mp.get_context("spawn")
    (prompt,) = start_peers(spawn, [f"{transport}-prompt"], 300)
    dec = Worker()
    out: dict = {"transport": transport, "n": n, "llmdd": os.path.dirname(llmdd.__file__)}
    try:
        nb = 64
        pinfo = prompt.call("init", role="PROMPT", cluster_id=PROMPT, transport=transport, listen=True)
        dec.cmd_init(role="DECODER", cluster_id=DECODER, transport=transport)
        prompt.call("alloc", nbytes=NUM_TENSORS * nb * BB)
        prompt.call("register_blocks", model_id=10, num_tensors=NUM_TENSORS, num_blocks=nb, block_bytes=BB)
        dec.cmd_alloc(nbytes=NUM_TENSORS * nb * BB)
        dec.cmd_register_blocks(model_id=10, num_tensors=NUM_TENSORS, num_blocks=nb, block_bytes=BB)
        link = dec.cmd_link(remote=PROMPT, port=pinfo["port"])
        if link["status"] != "LLM_SUCCESS":
            raise RuntimeError(f"{transport}: link failed: {link}")
        cm = dec.engine.cache_manager
        cache = dec.caches[10]
        key = llmdd.BlocksCacheKey(PROMPT, 10)
        one = range(0, 1)
        for op in ("pull", "push"):
            move = cm.pull_blocks if op == "pull" else cm.push_blocks
            blocks = [((i * 7) % nb, (i * 13) % nb) for i in range(n + warmup)]
            for s, d in blocks[:warmup]:
                move(key, cache, [s], [d], src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=1)
            calls: collections.Counter = collections.Counter()
            c_calls: collections.Counter = collections.Counter()

            def prof(frame, event, arg, calls=calls, c_calls=c_calls):
                if event == "call":
                    co = frame.f_code
                    calls[f"{_where(co.co_filename)}:{co.co_name}"] += 1
                elif event == "c_call":
                    c_calls[getattr(arg, "__qualname__", repr(arg))] += 1

            todo = blocks[warmup:]
            sys.setprofile(prof)
            try:
                for s, d in todo:
                    move(key, cache, [s], [d], src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=1)
            finally:
                sys.setprofile(None)
            # bytecode instructions run by the engine's Python (sys.settrace with f_trace_opcodes),
            # over the same draws again: a second load-independent measure of the Python work
            opcodes: collections.Counter = collections.Counter()

            def trace(frame, event, arg, opcodes=opcodes):
                if event == "call":
                    frame.f_trace_opcodes = True
                elif event == "opcode":
                    opcodes[frame.f_code] += 1
                return trace

            sys.settrace(trace)
            try:
                for s, d in todo:
                    move(key, cache, [s], [d], src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=1)
            finally:
                sys.settrace(None)
            # the profiler's own setprofile(None) call is counted once; leave it out
            c_calls["setprofile"] -= 1
            if c_calls["setprofile"] <= 0:
                del c_calls["setprofile"]
            out[op] = {"python_calls_per_transfer": sum(calls.values()) / n,
                       "opcodes_per_transfer": sum(opcodes.values()) / n,
                       "c_calls_per_transfer": sum(c_calls.values()) / n,
                       "python": {k: v / n for k, v in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0]))},
                       "opcodes": {f"{_where(k.co_filename)}:{k.co_name}": v / n
                                   for k, v in sorted(opcodes.items(), key=lambda kv: -kv[1])},
                       "c": {k: v / n for k, v in sorted(c_calls.items(), key=lambda kv: (-kv[1], kv[0]))}}
    finally:
        if dec.dd is not None:
            dec.dd.finalize()
        close_all([prompt])
    return out


def _fmt(v: float) -> str:
    return f"{v:g}"


def report(results: dict) -> str:
    """The per-transfer totals of every tree, and per function where the trees differ."""
    names = list(results)
    lines = []
    t = next(iter(results.values()))["transport"]
    for op in ("pull", "push"):
        lines.append(f"## {t} one-block {op}_blocks: calls per transfer")
        lines.append("")
        lines.append("| tree | Python calls | C calls | bytecode instructions |")
        lines.append("| --- | --- | --- | --- |")
        for name in names:
            r = results[name][op]
            lines.append(f"| {name} | {_fmt(r['python_calls_per_transfer'])} | {_fmt(r['c_calls_per_transfer'])} | "
                         f"{_fmt(r['opcodes_per_transfer'])} |")
        lines.append("")
        for kind in ("python", "c", "opcodes"):
            funcs: list = []
            for name in names:
                for f in results[name][op][kind]:
                    if f not in funcs:
                        funcs.append(f)
            lines.append(f"{kind} per transfer, by function" + (" (trees side by side)" if len(names) > 1 else ""))
            lines.append("")
            lines.append("| function | " + " | ".join(names) + " |")
            lines.append("| --- |" + " --- |" * len(names))
            for f in funcs:
                vals = [results[name][op][kind].get(f, 0) for name in names]
                lines.append(f"| `{f}` | " + " | ".join(_fmt(v) for v in vals) + " |")
            lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH of a tree with its .venv (repeatable)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true", help="print nothing (the --json file only)")
    ap.add_argument("--md", default=None, help="write the report (markdown) here too")
    a = ap.parse_args()
    if not a.tree:
        results = {"this": count_one_tree(a.transport, a.n, a.warmup)}
    else:
        results = {}
        here = os.path.abspath(__file__)
        for spec in a.tree:
            name, _, path = spec.partition("=")
            path = os.path.abspath(path)
            with tempfile.TemporaryDirectory() as tmp:
                j = os.path.join(tmp, "out.json")
                subprocess.run([os.path.join(path, ".venv/bin/python"), here, "--transport", a.transport,
                                "--n", str(a.n), "--warmup", str(a.warmup), "--json", j, "--quiet"], cwd=path, check=True)
                with open(j) as f:
                    results[name] = json.load(f)["this"]
    text = report(results)
    if not a.quiet:
        print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
