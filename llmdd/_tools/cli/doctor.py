"""``llmdd info`` and ``llmdd doctor``: print what :mod:`llmdd._tools.doctor` finds.

``info`` shows versions, plugins, transports, the chip-family profile and the memory
backends.  ``doctor`` adds a loopback self-test per available transport and the
misconfiguration checks its options ask for; it exits 0 when every check passed, 1 otherwise.
``--json`` prints the same results as one JSON document.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Optional, TextIO

from llmdd._tools import doctor as d
from llmdd._base.profiles import PROFILES

__all__ = ["add_info_arguments", "run_info", "add_doctor_arguments", "run_doctor"]

_MARK = {d.OK: "ok", d.WARN: "warn", d.FAIL: "FAIL", d.SKIP: "skip"}


# --------------------------------------------------------------------------- arguments


def _size(text: str) -> int:
    try:
        value = d.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= 600:
        raise argparse.ArgumentTypeError(f"must be between 0 and 600 seconds, got {text!r}")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), default="generic",
                        help="chip-family profile whose limits to show and check (default: generic)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--seconds", type=_seconds, default=3.0, metavar="S",
                        help="length of each transport's loopback self-test (default 3; 0 skips it)")
    parser.add_argument("--reclaim-shm", action="store_true",
                        help="remove the /dev/shm segments of dead llmdd processes (listed by default)")
    parser.add_argument("--two-process", action="store_true",
                        help="run every self-test with the region owned by a second process")
    parser.add_argument("--listen", metavar="IP:PORT",
                        help="the llm.listenIpInfo a server engine will use: is it local, is the port free")
    parser.add_argument("--peer", metavar="IP:PORT", help="link to the server engine listening there")
    parser.add_argument("--secret", metavar="SECRET",
                        help="llmdd.auth_secret to link to --peer with (default: LLMDD_AUTH_SECRET, if set)")
    parser.add_argument("--peer-timeout", type=_seconds, default=5.0, metavar="S",
                        help="link timeout for --peer in seconds (default 5)")
    parser.add_argument("--mem-pool-cfg", metavar="JSON",
                        help='the mem_pool_cfg to check, e.g. \'{"memory_size": 1073741824, "page_shift": 16}\'')
    parser.add_argument("--host-mem-pool-cfg", metavar="JSON", help="the host_mem_pool_cfg to check")
    parser.add_argument("--register-bytes", type=_size, metavar="N",
                        help="bytes of caches to allocate from each configured pool (e.g. 8G, 512MiB)")


# --------------------------------------------------------------------------- rendering


def _fmt_limit(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and value >= 1 << 20:
        return f"{value} ({d.format_bytes(value)})"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _print_info(info: dict, out: TextIO) -> None:
    w = out.write
    w("versions\n")
    for name, version in info["versions"].items():
        w(f"  {name:<12} {version or 'not installed'}\n")
    w(f"  {'platform':<12} {info['platform']}\n")

    plugins = info["plugins"]
    w("plugins (entry-point group 'llmdd')\n")
    if not plugins["entry_points"]:
        w("  none installed\n")
    for ep in plugins["entry_points"]:
        state = "blocked" if ep.get("blocked") else "loaded" if ep.get("loaded") else "not loaded"
        w(f"  {ep['name']:<10} {ep['distribution'] or '?'} {ep['version'] or '?'}  ({ep['value']})  {state}\n")
    builtin = [p for p in plugins["loaded"] if p.startswith("llmdd.")]
    if builtin:
        w(f"  built-in: {', '.join(builtin)}\n")
    entry_names = {ep["name"] for ep in plugins["entry_points"]}
    others = [p for p in plugins["loaded"] if p not in entry_names and not p.startswith("llmdd.")]
    if others:
        w(f"  registered by plugins: {', '.join(others)}\n")
    if plugins["error"]:
        w(f"  error: {plugins['error']}\n")
    for key, label in (("autoload_disabled", "LLMDD_DISABLE_PLUGIN_AUTOLOAD"),
                       ("disabled", "LLMDD_DISABLED_PLUGINS")):
        if plugins.get(key):
            w(f"  {label}={plugins[key]}\n")

    w("transports (most preferred first)\n")
    if not info["transports"]:
        w("  none registered\n")
    if not any(t["available"] for t in info["transports"]) and not plugins["error"]:
        w(f"  no transport is available: {d.NO_TRANSPORT_FIX}\n")
    for t in info["transports"]:
        scope = "same host only" if t["same_host_only"] else "any host"
        state = "available" if t["available"] else "unavailable"
        line = f"  {t['name']:<8} {state:<12} priority {t['priority']}, {scope}"
        if t["reason"]:
            line += f"; {t['reason']}"
        if t.get("data_path"):
            line += f"; data path: {t['data_path']}"
        w(line + "\n")
        if not t["available"] and t["details"].get("fix"):
            w(f"           fix: {t['details']['fix']}\n")

    profile = info["profile"]
    w(f"profile {profile['name']}: {profile['description']}\n")
    for key, value in profile.items():
        if key not in ("name", "description"):
            w(f"  {key:<22} {_fmt_limit(value)}\n")

    w("memory backends\n")
    for b in info["memory_backends"]:
        w(f"  {b['kind']:<16} Placement.{b['placement']:<7} {b['summary']}\n")
    shm = info["dev_shm"]
    if "error" in shm:
        w(f"  {shm['path']:<16} not usable: {shm['error']}\n")
    else:
        w(f"  {shm['path']:<16} {d.format_bytes(shm['free'])} free of {d.format_bytes(shm['size'])}\n")


class _Report:
    """Renders the doctor's report part by part, as :func:`llmdd._tools.doctor.run_doctor` finds each part.

    ``live`` (a terminal): while a slow part runs, a status line says what is running; it is
    erased by the part's result.  Otherwise (piped) only the report's plain lines, each flushed
    as soon as it is known."""

    def __init__(self, out: TextIO, seconds: float, live: bool = False) -> None:
        self.out, self.seconds, self.live = out, seconds, live
        self._status = False
        self._selftests = 0
        self._checks = False

    def __call__(self, kind: str, item: object) -> None:
        if kind == "start":
            if self.live:
                self._clear()
                self.out.write(f"  ...   {item}")
                self._status = True
                self.out.flush()
            return
        self._clear()
        w = self.out.write
        if kind == "info":
            assert isinstance(item, Mapping), item
            _print_info(dict(item), self.out)
            if self.seconds <= 0:
                w("self-test: skipped (--seconds 0)\n")
            else:
                w(f"self-test (read a {d.format_bytes(d.SELF_TEST_BYTES)} region with "
                  f"{d.format_bytes(d.SELF_TEST_OP_BYTES)} ops for {self.seconds:g} s, bytes verified)\n")
        elif kind == "selftest":
            self._selftests += 1
            assert isinstance(item, d.SelfTestResult), item
            _print_selftest(item, self.out)
        elif kind == "check":
            if not self._checks:
                if self.seconds > 0 and not self._selftests:
                    w("  no transport to test\n")
                w("checks\n")
                self._checks = True
            assert isinstance(item, d.Check), item
            _print_check(item, self.out)
        self.out.flush()

    def finish(self, report: d.DoctorReport) -> None:
        self._clear()
        n = report.problems
        self.out.write("result: all checks passed\n" if n == 0 else f"result: {n} problem{'s' if n != 1 else ''} found\n")
        self.out.flush()

    def _clear(self) -> None:
        if self._status:
            self.out.write("\r\033[K")
            self._status = False


def _print_selftest(t: d.SelfTestResult, out: TextIO) -> None:
    w = out.write
    procs = "1 process" if t.processes == 1 else f"{t.processes} processes"
    if t.ok:
        w(f"  {'ok':<5} {t.transport:<8} {t.gbps:6.2f} GB/s  ({t.batches} reads, "
          f"{d.format_bytes(t.bytes_read)}, {procs})\n")
    else:
        w(f"  {'FAIL':<5} {t.transport:<8} {t.error}\n")
    if t.note:
        w(f"        note: {t.note}\n")


def _print_check(c: d.Check, out: TextIO) -> None:
    out.write(f"  {_MARK.get(c.status, c.status):<5} {c.name:<20} {c.message}\n")
    if c.fix and c.status in (d.FAIL, d.WARN):
        out.write(f"        fix: {c.fix}\n")


def _print_report(report: d.DoctorReport, seconds: float, out: TextIO) -> None:
    """The whole report at once (what the streamed output adds up to)."""
    render = _Report(out, seconds)
    render("info", report.info)
    for t in report.selftests:
        render("selftest", t)
    for c in report.checks:
        render("check", c)
    render.finish(report)


# --------------------------------------------------------------------------- commands


def run_info(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    info = d.collect_info(args.profile)
    if args.json:
        out.write(d.report_json(info) + "\n")
    else:
        _print_info(info, out)
    return 1 if info["plugins"]["error"] else 0


def run_doctor(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    out = out or sys.stdout
    render = None if args.json else _Report(out, args.seconds, live=_is_terminal(out))
    report = d.run_doctor(profile=args.profile, seconds=args.seconds, listen=args.listen, secret=args.secret,
                          peer=args.peer, mem_pool_cfg=args.mem_pool_cfg, host_mem_pool_cfg=args.host_mem_pool_cfg,
                          register_bytes=args.register_bytes, peer_timeout=args.peer_timeout,
                          processes="two" if args.two_process else "auto",
                          reclaim_shm=getattr(args, "reclaim_shm", False), progress=render)
    if render is None:
        out.write(d.report_json(report) + "\n")
    else:
        render.finish(report)
    return 0 if report.ok else 1


def _is_terminal(out: TextIO) -> bool:
    try:
        return bool(out.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
