"""The ``llmdd`` command line: ``demo``, ``doctor``, ``info``, ``bench``, ``sim``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and
``run(args) -> int``.  The global options (``-v``, ``--version``) are accepted before or after
the subcommand.  The CLI (never the library) configures logging.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import sys

__all__ = ["main", "no_transport_error"]

SUBCOMMANDS = {
    "demo": ("llmdd._tools.cli.demo", "a disaggregated prefill/decode run on this machine"),
    "doctor": ("llmdd._tools.cli.doctor", "check this machine: transports, limits, misconfiguration"),
    "info": ("llmdd._tools.cli.doctor", "versions, transports and the chip-family profile"),
    "bench": ("llmdd._tools.cli.bench", "measure transfers against this machine's limits"),
    "sim": ("llmdd._tools.cli.sim", "run the deterministic cluster simulator: many engines, faults, invariants"),
}


def _available() -> dict:
    found = {}
    for name, (module, helptext) in SUBCOMMANDS.items():
        try:
            found[name] = (importlib.import_module(module), helptext)
        except ImportError as exc:
            if exc.name != module:
                raise
    return found


def no_transport_error(command: str, transports: list | None = None) -> str:
    """What a command prints when no transport is available here: why, and how to fix it.

    ``transports``: :func:`llmdd._tools.doctor.collect_info`'s list (collected here when not given)."""
    from llmdd._tools import doctor as d

    if transports is None:
        transports = d.collect_info()["transports"]
    return (f"llmdd {command}: {d.no_transport_message(transports)}; no link can be made\n"
            f"  fix: {d.NO_TRANSPORT_FIX}\n"
            f"  (`llmdd doctor` lists what is installed and why each transport is unavailable)")


def _version() -> str:
    from importlib import metadata

    import llmdd

    try:
        version = metadata.version("llmdd")
    except metadata.PackageNotFoundError:   # a source tree on sys.path, not installed
        version = llmdd.__version__
    return f"llmdd {version} (Python {platform.python_version()}, {os.path.dirname(llmdd.__file__)})"


def _add_global_options(parser: argparse.ArgumentParser, version: str, *, sub: bool) -> None:
    """The options every subcommand takes too: ``llmdd -v doctor`` and ``llmdd doctor -v`` mean the
    same (counts add up: ``llmdd -v doctor -v`` is ``-vv``)."""
    parser.add_argument("-v", "--verbose", action="count", dest="verbose_sub" if sub else "verbose",
                        default=argparse.SUPPRESS if sub else 0, help="log llmdd events (-vv: debug)")
    parser.add_argument("--version", action=_VersionAction, version=version, help="print llmdd's version and exit")


class _VersionAction(argparse.Action):
    """``--version``: the line as it is (argparse's own action wraps it at the terminal's width, splitting the
    path that a user copies)."""

    def __init__(self, option_strings: list, version: str, dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)
        self.version = version

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(self.version)
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.verbose += getattr(args, "verbose_sub", 0)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:   # Ctrl-C: one line, not a traceback; 130 as a shell reports SIGINT
        print(f"llmdd {args.command}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The ``llmdd`` argument parser, every available subcommand included."""
    parser = argparse.ArgumentParser(prog="llmdd", description="llmdd: KV-cache transfer engine for "
                                     "disaggregated LLM inference")
    version = _version()
    _add_global_options(parser, version, sub=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, helptext) in _available().items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        add = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
        add(p)
        _add_global_options(p, version, sub=True)
        p.set_defaults(_run=getattr(module, f"run_{name}", None) or module.run)
    return parser
