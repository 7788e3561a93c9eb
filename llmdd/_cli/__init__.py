"""The ``llmdd`` command line: ``demo``, ``doctor``, ``info``, ``bench``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and
``run(args) -> int``.  The CLI (never the library) configures logging.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

__all__ = ["main"]

SUBCOMMANDS = {
    "demo": ("llmdd._cli.demo", "a disaggregated prefill/decode run on this machine"),
    "doctor": ("llmdd._cli.doctor", "check this machine: transports, limits, misconfiguration"),
    "info": ("llmdd._cli.doctor", "versions, transports and the chip-family profile"),
    "bench": ("llmdd._cli.bench", "measure transfers against this machine's limits"),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmdd", description="llmdd: KV-cache transfer engine for "
                                     "disaggregated LLM inference")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log llmdd events (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, helptext) in _available().items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        add = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
        add(p)
        p.set_defaults(_run=getattr(module, f"run_{name}", None) or module.run)
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    return int(args._run(args) or 0)
