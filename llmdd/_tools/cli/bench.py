"""``llmdd bench``: llmdd's transfers against this machine's limits, in one run.

For every available transport: ``pull_blocks`` / ``push_blocks`` of paged KV (64 tensors,
64 KiB and 16 KiB blocks, random block tables), ``pull_cache`` of a contiguous cache, the
latency of one 64 KiB block, ``transfer_cache_async`` with a layer synchronizer, N
decoders pulling from one prompt, link setup time and server memory per link, idle engine
memory.  In the same run: single-thread memcpy and gather, ``process_vm_readv``, raw
Python sockets (1 and 2 streams, request/reply).  Every llmdd figure is also reported as a
ratio to its anchor, and the targets of ``llmdd/_tools/bench/targets.toml`` as met / not met.

``--report results.json [--peers DIR]`` re-renders a finished run, merging the NIXL and
Mooncake results that ``bench/run_peers.sh`` wrote into DIR.  ``--report R1 R2 ... [--markdown]
[--plots DIR]`` reports several committed runs: every run's figures, their medians and the
targets' verdicts on the medians, rewriting none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["add_arguments", "run", "DEFAULT_OUT"]

DEFAULT_OUT = "llmdd-bench-results"


class _ProfileRenamed(argparse.Action):
    """``--profile`` names a chip-family profile everywhere else (info, doctor); bench's cProfile
    switch is ``--cprofile``, and ``--profile`` here is refused saying so."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--profile is the chip-family profile of `llmdd info` / `llmdd doctor`; bench's "
                     "cProfile listings are --cprofile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, fewer repetitions, up to 2 decoders and 8 links (CI; under a minute)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"results directory (default ./{DEFAULT_OUT}/<UTC stamp>/ under the current "
                             "directory, printed when the run starts)")
    parser.add_argument("--transport", action="append", default=None, metavar="NAME",
                        help="measure only this transport (repeatable; default: every available one); also "
                             "tcp+tls, the tcp transport with TLS on control and data connections (on request only)")
    parser.add_argument("--cprofile", action="store_true",
                        help="also write cProfile listings of the decoder's pulls (profile_*.txt)")
    parser.add_argument("--profile", nargs="?", action=_ProfileRenamed, help=argparse.SUPPRESS)
    parser.add_argument("--no-anchors", action="store_true", help="skip the machine's anchors (no ratios)")
    parser.add_argument("--seed", type=int, default=0, help="block tables")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine option for every engine of the run (repeatable), e.g. "
                             "llmdd.tcp.spin_us=0; recorded in the results (meta.options)")
    parser.add_argument("--json", action="store_true", help="print the results JSON on stdout instead of the table")
    parser.add_argument("--report", default=None, nargs="+", metavar="RESULTS_JSON",
                        help="do not measure: re-render one results.json (with --peers merged) and rewrite it; "
                             "several: report their medians and every run, rewriting none")
    parser.add_argument("--markdown", action="store_true",
                        help="with --report: print the report as markdown (the tables docs/benchmarks.md embeds)")
    parser.add_argument("--plots", default=None, metavar="DIR",
                        help="with several --report files or --markdown: write the plots of their medians into DIR")
    parser.add_argument("--peers", default=None, metavar="DIR",
                        help="with --report: NIXL / Mooncake anchor JSON lines from bench/run_peers.sh")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    from llmdd._tools.bench.report import all_verified, finish, table

    if args.report and (len(args.report) > 1 or args.markdown):
        return _report_many(args)
    if args.report:
        with open(args.report[0]) as f:
            results = json.load(f)
        if args.peers:
            from llmdd._tools.bench.peers import load_peers

            results["peers"] = load_peers(args.peers)
            if not results["peers"]["values"]:
                print(f"llmdd bench: no peer measurements found under {args.peers}", file=sys.stderr)
        results = finish(results, os.path.dirname(os.path.abspath(args.report[0])))
        _emit(results, args, table)
        return 0

    from llmdd._tools.bench.runner import Options, Sizes, available_transports, run_bench, variants

    transports = available_transports()
    if not transports:
        from llmdd._tools.cli import no_transport_error

        print(no_transport_error("bench"), file=sys.stderr)
        return 1
    if args.transport:
        unknown = [t for t in args.transport if t not in transports + variants(transports)]
        if unknown:
            print(f"llmdd bench: transport(s) not available here: {', '.join(unknown)} "
                  f"(available: {', '.join(transports)})", file=sys.stderr)
            return 2
        transports = list(args.transport)
    options = {}
    for kv in args.option:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            print(f"llmdd bench: --option takes KEY=VALUE, not {kv!r}", file=sys.stderr)
            return 2
        options[key] = value
    out = args.out or os.path.join(DEFAULT_OUT, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    opts = Options(sizes=Sizes.quick() if args.quick else Sizes(), transports=transports, profile=args.cprofile,
                   seed=args.seed, skip={"anchors"} if args.no_anchors else set(), options=options)
    if not args.quiet:
        print(f"llmdd bench: transports {', '.join(transports)}; results in {os.path.abspath(out)}", file=sys.stderr)
    results = run_bench(opts, progress_enabled=not args.quiet)
    results["meta"]["command"] = " ".join(["llmdd", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] \
        else "llmdd bench"
    results["meta"]["quick"] = bool(args.quick)
    if not args.quiet:
        print("llmdd bench: computing ratios and targets, writing results.json and the plots ...", file=sys.stderr)
    results = finish(results, out)
    _emit(results, args, table)
    if not args.quiet:
        print(f"llmdd bench: wrote {os.path.join(out, 'results.json')}", file=sys.stderr)
        skipped = results.get("plots", {}).get("skipped")
        print(f"llmdd bench: {skipped}" if skipped else f"llmdd bench: plots {results['plots'].get('files')}",
              file=sys.stderr)
    if results.get("errors"):
        return 1
    return 0 if all_verified(results) else 1


def _report_many(args: argparse.Namespace) -> int:
    """The report over several committed runs; rewrites none of them."""
    from llmdd._tools.bench.report import markdown, plots, text

    if args.peers:
        print("llmdd bench: --peers merges into one results.json; run it per run first", file=sys.stderr)
        return 2
    runs = []
    for path in args.report:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"llmdd bench: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    lines = markdown(runs, args.report) if args.markdown else text(runs, args.report)
    print("\n".join(lines))
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        made = plots(runs, args.plots)
        print(f"llmdd bench: {made.get('skipped') or 'plots ' + ', '.join(made['files'])}", file=sys.stderr)
    return 0


def _emit(results: dict, args: argparse.Namespace, table) -> None:
    if args.json:
        json.dump(results, sys.stdout, indent=1, default=str)
        print()
    else:
        for line in table(results, results["ratios"], results["targets"]):
            print(line)
    sys.stdout.flush()
