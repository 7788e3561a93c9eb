"""``llmdd demo``: a real disaggregated inference on this machine, checked bit for bit.

A prompt process prefills a small numpy transformer into a paged KV cache registered
with ``register_blocks_cache``; decoder processes link to it, pull the blocks with
``pull_blocks`` (or receive them pushed layer by layer with ``transfer_cache_async``),
decode greedily, and compare their KV and tokens with a single-process reference.
Exit status 0 only when every decoder matches the reference.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from llmdd._tools.demo.runner import DEFAULTS, QUICK

    parser.add_argument("--prompt-len", type=int, default=None,
                        help=f"prompt tokens (default {DEFAULTS[0]}, i.e. 64 MiB of KV; --quick: {QUICK[0]})")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens to generate (default {DEFAULTS[1]}; --quick: {QUICK[1]})")
    parser.add_argument("--decoders", type=int, default=1, help="decoder processes pulling from one prompt")
    parser.add_argument("--transport", choices=("auto", "tcp", "shm", "ucx"), default="auto",
                        help="force a transport (engine option llmdd.transport; each one `llmdd info` lists); "
                             "auto lets llmdd choose")
    parser.add_argument("--mode", choices=("pull", "push"), default="pull",
                        help="pull: decoders call pull_blocks; push: the prompt pushes each layer with "
                             "transfer_cache_async while it computes the next")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompt and block tables")
    parser.add_argument("--faults", choices=("none", "kill", "stall"), default="none",
                        help="kill (SIGKILL) or stall (SIGSTOP) the prompt in the middle of the pull, show the "
                             "error, then recover (pull mode)")
    parser.add_argument("--quick", action="store_true", help="a small run for CI")
    parser.add_argument("--sync-kv-timeout", type=int, default=None, metavar="MS",
                        help="sync_kv_timeout of the engines (default 10000 ms, 2000 ms with --faults)")
    parser.add_argument("--corrupt-kv", action="store_true",
                        help="self-test: flip one byte of the first decoder's pulled KV before the check "
                             "(also LLMDD_DEMO_CORRUPT_KV=1); the run must then fail")


def run(args: argparse.Namespace) -> int:
    from llmdd._tools.demo.report import format_report
    from llmdd._tools.demo.runner import DEFAULTS, QUICK, DemoError, DemoOptions, run_demo

    sizes = QUICK if args.quick else DEFAULTS
    opts = DemoOptions(
        prompt_len=args.prompt_len if args.prompt_len is not None else sizes[0],
        tokens=args.tokens if args.tokens is not None else sizes[1],
        decoders=args.decoders, transport=args.transport, mode=args.mode, seed=args.seed,
        faults=args.faults, corrupt_kv=args.corrupt_kv, sync_kv_timeout_ms=args.sync_kv_timeout)
    try:
        opts.check()
    except ValueError as exc:
        print(f"llmdd demo: {exc}", file=sys.stderr)
        return 2
    problem = _transport_problem(opts.transport)
    if problem:
        print(problem, file=sys.stderr)
        return 1

    began = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - began:6.2f} s] {line}", flush=True)

    previous = signal.signal(signal.SIGINT, _interrupt_once)
    try:
        result = run_demo(opts, progress)
    except DemoError as exc:
        print(f"llmdd demo: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:   # a Ctrl-C goes on to main (one line, exit 130) once run_demo's cleanup stopped the children
        signal.signal(signal.SIGINT, previous)
    print()
    for line in format_report(result):
        print(line)
    sys.stdout.flush()
    return 0 if result.ok else 1


def _interrupt_once(signum: int, frame: object) -> None:
    """Ctrl-C: stop the run; a second one does not cut its cleanup short (no process or segment left)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _transport_problem(forced: str) -> str:
    """Why the demo cannot link here (no transport, or the forced one unavailable), with the fix; "" when it can."""
    from llmdd._tools import doctor as d
    from llmdd._tools.cli import no_transport_error

    info = d.collect_info()
    if info["plugins"]["error"]:
        return f"llmdd demo: the plugins could not be loaded: {info['plugins']['error']} (see `llmdd doctor`)"
    transports = info["transports"]
    if not any(t["available"] for t in transports):
        return no_transport_error("demo", transports)
    if forced != "auto":
        chosen = [t for t in transports if t["name"] == forced]
        if not chosen:
            return (f"llmdd demo: --transport {forced}: no such transport is installed or loaded "
                    f"(here: {', '.join(t['name'] for t in transports)})\n"
                    f"  fix: pip install llmdd-transport-{forced}, or --transport auto")
        if not chosen[0]["available"]:
            return (f"llmdd demo: --transport {forced} is not available here: {chosen[0]['reason']}\n"
                    f"  fix: --transport auto, or see `llmdd doctor`")
    return ""
