"""The ``llmdd`` command line (issue 24): --version, global options on either side of the
subcommand, one meaning per option name, doctor's output as each part finishes (live on a
terminal, plain lines when piped, --json unchanged), bench's default results directory, and
every command saying what to do when no transport is available."""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import subprocess
import sys
import time
from importlib import metadata

import pytest

import llmdd
from llmdd._tools.cli import bench as bench_cli
from llmdd._tools.cli import main

pytestmark = pytest.mark.timeout(120)

LLMDD = [sys.executable, "-m", "llmdd"]
NO_TRANSPORTS = "shm,tcp,ucx,sim"   # every transport plugin of this tree (sim: plugins/llmdd-transport-sim)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMDD_")}
    env.update(extra)
    return env


def _run(*argv: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*LLMDD, *argv], env=env or _env(), cwd=cwd, capture_output=True, text=True)


# --------------------------------------------------------------------------- --version, global options


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"llmdd {metadata.version('llmdd')} (Python ")
    assert os.path.dirname(llmdd.__file__) in out


def test_version_is_accepted_after_the_subcommand_too(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("llmdd ")


@pytest.mark.parametrize("argv, level", [
    (["info", "--json"], None),
    (["-v", "info", "--json"], "INFO"),
    (["info", "-v", "--json"], "INFO"),
    (["info", "--json", "--verbose"], "INFO"),
    (["-v", "info", "-v", "--json"], "DEBUG"),
    (["info", "-vv", "--json"], "DEBUG"),
])
def test_verbose_before_or_after_the_subcommand(argv, level):
    # a fresh process each: logging.basicConfig configures a process once
    code = ("import logging, sys; from llmdd._tools.cli import main; rc = main(sys.argv[1:]); "
            "root = logging.getLogger(); "
            "print('LEVEL', logging.getLevelName(root.level) if root.handlers else None, file=sys.stderr); "
            "raise SystemExit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=_env(LLMDD_DISABLED_PLUGINS="ucx"),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"LEVEL {level}" in proc.stderr.splitlines()[-1]
    json.loads(proc.stdout)   # --json output stays a JSON document


def test_verbose_counts_add_up_and_default_is_quiet():
    from llmdd._tools.cli import _add_global_options

    parser = argparse.ArgumentParser()
    _add_global_options(parser, "llmdd test", sub=False)
    sub = parser.add_subparsers(dest="command")
    _add_global_options(sub.add_parser("info"), "llmdd test", sub=True)
    for argv, count in ((["info"], 0), (["-v", "info"], 1), (["info", "-v"], 1), (["-vv", "info", "-v"], 3)):
        args = parser.parse_args(argv)
        assert args.verbose + getattr(args, "verbose_sub", 0) == count, argv


# --------------------------------------------------------------------------- one meaning per option


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmdd bench")
    bench_cli.add_arguments(parser)
    return parser


def test_bench_cprofile_is_the_cprofile_switch():
    assert _bench_parser().parse_args(["--cprofile"]).cprofile is True
    assert _bench_parser().parse_args([]).cprofile is False


@pytest.mark.parametrize("argv", [["--profile"], ["--profile", "generic"], ["--profile=atlas_a2"]])
def test_bench_refuses_profile_and_names_the_new_spelling(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _bench_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--profile is the chip-family profile of `llmdd info` / `llmdd doctor`" in err
    assert "--cprofile" in err


def test_profile_means_the_chip_profile_in_info_and_doctor(capsys):
    assert main(["info", "--profile", "atlas_a2", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["profile"]["name"] == "atlas_a2"
    with pytest.raises(SystemExit):
        main(["doctor", "--profile", "no-such-chip"])
    assert "invalid choice: 'no-such-chip'" in capsys.readouterr().err


# --------------------------------------------------------------------------- bench's default directory


def test_bench_default_results_directory_is_named_and_printed(tmp_path, monkeypatch, capsys):
    from llmdd._tools.bench import report, runner

    seen = {}

    def fake_run_bench(opts, progress_enabled=True):
        seen["opts"] = opts
        return {"meta": {}, "errors": []}

    def fake_finish(results, out):
        seen["out"] = out
        return dict(results, plots={"skipped": "no plots in this test"}, ratios={}, targets={})

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "available_transports", lambda: ["tcp"])
    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    monkeypatch.setattr(report, "finish", fake_finish)
    monkeypatch.setattr(report, "all_verified", lambda results: True)
    monkeypatch.setattr(bench_cli, "_emit", lambda results, args, table: None)
    assert main(["bench", "--quick", "--cprofile"]) == 0
    out = seen["out"]
    assert os.path.dirname(out) == bench_cli.DEFAULT_OUT == "llmdd-bench-results"
    assert len(os.path.basename(out)) == len("20261201T120000Z") and os.path.basename(out).endswith("Z")
    assert seen["opts"].profile is True
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"llmdd bench: transports tcp; results in {tmp_path / out}"


def test_bench_option_reaches_every_engine_and_the_results(monkeypatch, tmp_path, capsys):
    from llmdd._tools.bench import report, runner

    seen = {}

    def fake_run_bench(opts, progress_enabled=True):
        seen["opts"] = opts
        run = runner.Run(opts, runner.Progress(1, enabled=False))
        seen["engine"] = run._engine("tcp")
        return {"meta": {"options": dict(opts.options)}, "errors": []}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "available_transports", lambda: ["tcp"])
    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    monkeypatch.setattr(report, "finish", lambda results, out: dict(results, plots={"skipped": "-"}))
    monkeypatch.setattr(report, "all_verified", lambda results: True)
    monkeypatch.setattr(bench_cli, "_emit", lambda results, args, table: seen.setdefault("results", results))
    argv = ["bench", "--quick", "--option", "llmdd.tcp.spin_us=0", "--option", "llm.x=a=b"]
    assert main(argv) == 0
    want = {"llmdd.tcp.spin_us": "0", "llm.x": "a=b"}   # split at the first '='
    assert seen["opts"].options == want
    assert seen["engine"] == {"transport": "tcp", "options": want}
    lines = report.table({"meta": seen["results"]["meta"], "transports": {}}, [], [])
    assert "engine options: llm.x=a=b, llmdd.tcp.spin_us=0" in lines
    capsys.readouterr()
    for bad in ("novalue", "=0"):
        assert main(["bench", "--quick", "--option", bad]) == 2
        assert f"--option takes KEY=VALUE, not {bad!r}" in capsys.readouterr().err


# --------------------------------------------------------------------------- doctor's output as it runs


def _read_with_times(fd: int, proc: subprocess.Popen, deadline: float) -> list[tuple[float, bytes]]:
    chunks = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:   # the pty's other side closed
                break
            if not data:
                break
            chunks.append((time.monotonic(), data))
        elif proc.poll() is not None:
            break
    return chunks


def _arrival(chunks: list[tuple[float, bytes]], needle: bytes) -> float:
    seen = b""
    for at, data in chunks:
        seen += data
        if needle in seen:
            return at
    raise AssertionError(f"{needle!r} never arrived in {seen[-2000:]!r}")


SECONDS = 0.6


def _doctor_env() -> dict:
    return _env(LLMDD_DISABLED_PLUGINS="ucx")   # shm and tcp: two self-tests of SECONDS each


def test_doctor_on_a_terminal_shows_each_part_as_it_runs():
    master, slave = pty.openpty()
    proc = subprocess.Popen([*LLMDD, "doctor", "--seconds", str(SECONDS)], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=dict(_doctor_env(), TERM="xterm"))
    os.close(slave)
    try:
        chunks = _read_with_times(master, proc, time.monotonic() + 90)
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = b"".join(c for _, c in chunks).decode()
    # the live status line of each running self-test, erased by its result
    for name in ("shm", "tcp"):
        assert f"  ...   self-test {name}\r\x1b[K" in text, text
    assert _arrival(chunks, b"self-test (read a") <= _arrival(chunks, b"result: ") - 2 * SECONDS * 0.9
    assert _arrival(chunks, b"GB/s") < _arrival(chunks, b"result: ")


def test_doctor_piped_prints_plain_lines_as_they_are_known():
    proc = subprocess.Popen([*LLMDD, "doctor", "--seconds", str(SECONDS)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_doctor_env())
    try:
        chunks = _read_with_times(proc.stdout.fileno(), proc, time.monotonic() + 90)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    text = b"".join(c for _, c in chunks).decode()
    assert "\r" not in text and "\x1b" not in text and "  ...   " not in text
    # streamed: the info part arrived while the self-tests still had (two of) SECONDS to run
    assert _arrival(chunks, b"self-test (read a") <= _arrival(chunks, b"result: ") - 2 * SECONDS * 0.9
    lines = text.splitlines()
    order = [i for i, line in enumerate(lines) if line.startswith(("versions", "self-test (", "checks", "result:"))]
    assert [lines[i].split()[0] for i in order] == ["versions", "self-test", "checks", "result:"], lines


def test_doctor_streamed_text_equals_the_whole_report(capsys):
    """The parts printed as they come add up to what the report renders at once."""
    from llmdd._tools import doctor as d
    from llmdd._tools.cli.doctor import _print_report, _Report

    parts = []
    report = d.run_doctor(seconds=0, progress=lambda kind, item: parts.append((kind, item)))
    import io

    streamed, whole = io.StringIO(), io.StringIO()
    render = _Report(streamed, 0)
    for kind, item in parts:
        render(kind, item)
    render.finish(report)
    _print_report(report, 0, whole)
    assert streamed.getvalue() == whole.getvalue()
    assert [k for k, _ in parts if k != "start"][:1] == ["info"]
    assert [item for k, item in parts if k == "check"] == report.checks


def test_doctor_json_is_one_document_without_progress():
    proc = _run("doctor", "--seconds", "0", "--json", env=_doctor_env())
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data) >= {"info", "selftest", "checks"} and data["selftest"] == []
    assert "..." not in proc.stdout and "\r" not in proc.stdout


# --------------------------------------------------------------------------- no transport


FIX = "pip install llmdd brings the standard transports (llmdd-transport-shm, llmdd-transport-tcp)"


@pytest.mark.parametrize("argv", [["demo", "--quick"], ["bench", "--quick", "--no-anchors"]])
def test_commands_without_a_transport_say_so_and_how_to_fix_it(argv, tmp_path):
    proc = _run(*argv, env=_env(LLMDD_DISABLED_PLUGINS=NO_TRANSPORTS), cwd=tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"llmdd {argv[0]}: no transport is available here: no transport plugin is installed or loaded " \
           f"(LLMDD_DISABLED_PLUGINS={NO_TRANSPORTS}); no link can be made" in proc.stderr
    assert f"fix: {FIX}" in proc.stderr
    assert list(tmp_path.iterdir()) == []   # nothing measured, nothing written


def test_doctor_and_info_without_a_transport_say_so_and_how_to_fix_it():
    env = _env(LLMDD_DISABLED_PLUGINS=NO_TRANSPORTS)
    doctor = _run("doctor", "--seconds", "0", env=env)
    assert doctor.returncode == 1
    assert "FAIL  transports           no transport is available here" in doctor.stdout
    assert f"fix: {FIX}" in doctor.stdout
    info = _run("info", env=env)
    assert info.returncode == 0
    assert f"  no transport is available: {FIX}" in info.stdout


def test_control_with_transports_demo_and_info_do_not_complain():
    info = _run("info", env=_env(LLMDD_DISABLED_PLUGINS="ucx"))
    assert info.returncode == 0 and "no transport is available" not in info.stdout
    demo = _run("demo", "--quick", "--transport", "tcp", env=_env(LLMDD_DISABLED_PLUGINS="ucx"))
    assert demo.returncode == 0, demo.stderr
    assert "VERIFIED" in demo.stdout


def test_demo_forced_transport_that_is_not_there_says_which_are():
    proc = _run("demo", "--quick", "--transport", "shm", env=_env(LLMDD_DISABLED_PLUGINS="shm,ucx,sim"))
    assert proc.returncode == 1
    assert "llmdd demo: --transport shm: no such transport is installed or loaded (here: tcp)" in proc.stderr


# --------------------------------------------------------------------------- README commands


def _documented_commands() -> list[tuple[str, list[str]]]:
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    found = []
    for page in ("README.md", "docs/quickstart.md", "docs/doctor.md"):
        text = (root / page).read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip()
                if line.startswith((".venv/bin/llmdd", "llmdd ")):
                    found.append((page, shlex.split(line)[1:]))
    return found


def test_documented_commands_exist_and_parse_as_written():
    """Every `.venv/bin/llmdd ...` / `llmdd ...` line of the README, quick start and doctor pages is
    a command this CLI accepts (the venv's bin/llmdd exists: the set-up scripts put it there)."""
    from llmdd._tools.cli import build_parser

    commands = _documented_commands()
    pages = {page for page, _ in commands}
    assert {"README.md", "docs/quickstart.md"} <= pages, commands
    assert os.path.exists(os.path.join(os.path.dirname(sys.executable), "llmdd"))
    for page, argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:   # --version / --help exit 0 after printing
            assert exc.code == 0, (page, argv)
            continue
        assert callable(args._run), (page, argv)
