"""Extract the ```python blocks of Markdown pages and run them, each in its own interpreter.

The convention (written up for authors in docs/writing-docs.md):

* every fenced block whose info string starts with ``python`` (or ``py``) is a snippet; it runs
  as written, as its own process (``sys.executable``, the test's virtual environment), in an
  empty temporary directory, with a deadline;
* the line just before the fence may carry one marker:

  - ``<!-- snippet: skip (REASON) -->``: the block is not run; REASON is required and is
    listed (tests/docs/snippet_skips.txt holds the committed list of opt-outs);
  - ``<!-- snippet: pair NAME role=ROLE -->``: the block is one side of a two-process example.
    The two blocks of a pair (same NAME, same page, distinct ROLEs) run concurrently: the one
    written first starts first and must print a line on stdout once it is ready (for example
    ``input("serving; press Enter to stop\\n")``); then the second starts; once the second has
    exited, the first receives a newline on stdin (its "Enter") and stdin closes. Both must
    exit with status 0 before their deadline;
  - ``<!-- snippet: continues -->``: the block continues the previous python block of the
    page (prose between them explains the steps): the two run as one script, the previous
    block's code first, and the previous block is not run alone.

* any other ``<!-- snippet: ... -->`` comment, a marker that is not on the line just before a
  python fence, an empty reason or a pair with other than two members is an error.

Usable as a script as well::

    python tests/docs/_snippets.py docs/quickstart.md      # run one page's snippets
    python tests/docs/_snippets.py --list-skips             # print the opt-outs, committed format
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[2]
SKIPS_FILE = Path(__file__).resolve().parent / "snippet_skips.txt"

#: seconds one snippet process may run (a pair: each side, counted from its own start)
TIMEOUT_S = 120.0

#: the port the docs' examples listen on and connect to: fixed, so a reader can follow it.  Each run of a
#: unit gets a port that was free a moment before instead (every occurrence of the number in its code is
#: rewritten): two suites running at once on one machine clashed on the fixed one (issue 41)
DOC_PORT = 26000
_DOC_PORT = re.compile(rf"(?<![0-9]){DOC_PORT}(?![0-9])")

_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_MARKER = re.compile(r"^\s*<!--\s*snippet\s*:(?P<body>.*?)-->\s*$")
_ANY_MARKER = re.compile(r"<!--\s*snippet\s*:", re.I)
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*)\)$", re.S)
_CONTINUES = re.compile(r"^continues$")
_PAIR = re.compile(r"^pair\s+(?P<name>[A-Za-z0-9_.-]+)\s+role=(?P<role>[A-Za-z0-9_-]+)$")


@dataclasses.dataclass(frozen=True)
class Snippet:
    page: str             #: the page, relative to the repository root (or as given)
    line: int             #: 1-based line of the opening fence
    code: str
    skip: Optional[str] = None   #: the opt-out reason
    pair: Optional[str] = None   #: the pair's name
    role: Optional[str] = None   #: this block's role in its pair
    continues: bool = False      #: runs appended to the previous block of the page
    joined: tuple[int, ...] = ()  #: lines of the blocks appended to this one

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}" + "".join(f"+{n}" for n in self.joined)


@dataclasses.dataclass(frozen=True)
class Unit:
    """What one test runs: a single snippet, or the two snippets of a pair (first = started first)."""

    snippets: tuple[Snippet, ...]

    @property
    def id(self) -> str:
        first = self.snippets[0]
        if first.pair is not None:
            return f"{first.page}:pair={first.pair}"
        return first.where

    @property
    def skip(self) -> Optional[str]:
        reasons = [s.skip for s in self.snippets if s.skip is not None]
        return "; ".join(reasons) if reasons else None


@dataclasses.dataclass
class Outcome:
    ok: bool
    detail: str   #: what happened, with every process's status and output when not ok


def _display(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def extract(path: Path, text: Optional[str] = None) -> tuple[list[Snippet], list[str]]:
    """The python snippets of one page and the marker errors found on it."""
    if text is None:
        text = path.read_text(encoding="utf-8")
    page = _display(path)
    lines = text.splitlines()
    snippets: list[Snippet] = []
    errors: list[str] = []
    used_markers: set[int] = set()
    fenced: set[int] = set()   # lines inside a fence of any language (markers there are examples)
    i = 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info")
        start = i
        body: list[str] = []
        i += 1
        closed = False
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                closed = True
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        fenced.update(range(start, i + 1))
        i += 1
        lang = info.split()[0].lower() if info.split() else ""
        if lang not in ("python", "py", "python3"):
            continue
        if not closed:
            errors.append(f"{page}:{start + 1}: python block is never closed")
            continue
        skip = pair = role = None
        continues = False
        if start > 0 and _MARKER.match(lines[start - 1]):
            used_markers.add(start - 1)
            directive = _MARKER.match(lines[start - 1]).group("body").strip()
            sk, pm = _SKIP.match(directive), _PAIR.match(directive)
            if sk:
                skip = " ".join(sk.group("reason").split())
                if not skip:
                    errors.append(f"{page}:{start}: snippet skip marker without a reason")
                    continue
            elif pm:
                pair, role = pm.group("name"), pm.group("role")
            elif _CONTINUES.match(directive):
                continues = True
            else:
                errors.append(f"{page}:{start}: unknown snippet marker {directive!r} "
                              "(expected 'skip (reason)', 'pair NAME role=ROLE' or 'continues')")
                continue
        snippets.append(Snippet(page, start + 1, "\n".join(body) + "\n", skip, pair, role, continues))
    for n, line in enumerate(lines):
        if _ANY_MARKER.match(line.strip()) and n not in used_markers and n not in fenced:
            errors.append(f"{page}:{n + 1}: snippet marker not on the line just before a python fence")
    return snippets, errors


def units(snippets: Iterable[Snippet]) -> tuple[list[Unit], list[str]]:
    """Group the snippets of pairs (exactly two members with distinct roles) and join
    continuations to the block they continue."""
    out: list[Unit] = []
    errors: list[str] = []
    pairs: dict[tuple[str, str], list[Snippet]] = {}
    order: list[object] = []
    for s in snippets:
        if s.continues:
            prev = order[-1] if order else None
            if not isinstance(prev, Snippet) or prev.page != s.page or prev.skip is not None:
                errors.append(f"{s.where}: 'continues' needs a runnable single block before it on the page")
                continue
            order[-1] = dataclasses.replace(prev, code=prev.code + s.code, joined=prev.joined + (s.line,))
        elif s.pair is None:
            order.append(s)
        else:
            key = (s.page, s.pair)
            if key not in pairs:
                pairs[key] = []
                order.append(key)
            pairs[key].append(s)
    for item in order:
        if isinstance(item, Snippet):
            out.append(Unit((item,)))
            continue
        members = pairs[item]
        roles = [m.role for m in members]
        if len(members) != 2:
            errors.append(f"{item[0]}: pair {item[1]!r} has {len(members)} block(s), expected 2")
        elif len(set(roles)) != 2:
            errors.append(f"{item[0]}: pair {item[1]!r} repeats role {roles[0]!r}")
        else:
            out.append(Unit(tuple(members)))
    return out, errors


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").rglob("*.md"))


def collect(pages: Iterable[Path]) -> tuple[list[Unit], list[str]]:
    every: list[Snippet] = []
    errors: list[str] = []
    for page in pages:
        found, errs = extract(page)
        every += found
        errors += errs
    grouped, errs = units(every)
    return grouped, errors + errs


def skip_lines(found: Iterable[Unit]) -> list[str]:
    """The opt-outs as the committed list writes them: ``PAGE: REASON``, sorted."""
    return sorted(f"{s.page}: {s.skip}" for u in found for s in u.snippets if s.skip is not None)


def committed_skips() -> list[str]:
    if not SKIPS_FILE.exists():
        return []
    lines = SKIPS_FILE.read_text(encoding="utf-8").splitlines()
    return sorted(line for line in lines if line.strip() and not line.startswith("#"))


# -- running ----------------------------------------------------------------------------------

def _spawn(snippet: Snippet, workdir: Path, *, stdin) -> tuple[subprocess.Popen, Path, Path]:
    stem = f"snippet_{snippet.line}" + (f"_{snippet.role}" if snippet.role else "")
    script = workdir / f"{stem}.py"
    script.write_text(snippet.code, encoding="utf-8")
    err = workdir / f"{stem}.stderr"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=workdir, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=open(err, "wb"), env=env,
                            start_new_session=True)
    return proc, script, err


class _Reader(threading.Thread):
    """Collects a process's stdout lines; ``first`` receives the first one (or None at EOF)."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.proc = proc
        self.lines: list[str] = []
        self.first: "queue.Queue[Optional[str]]" = queue.Queue()

    def run(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            if not self.lines:
                self.first.put(line)
            self.lines.append(line)
        if not self.lines:
            self.first.put(None)

    def text(self) -> str:
        self.join(5.0)
        return "".join(self.lines)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(10)


def _report(label: str, snippet: Snippet, proc: subprocess.Popen, reader: _Reader, err: Path) -> str:
    return (f"--- {label} {snippet.where}: exit status {proc.returncode}\n"
            f"[stdout]\n{reader.text()}[stderr]\n{err.read_bytes().decode('utf-8', 'replace')}")


def run_unit(unit: Unit, workdir: Optional[Path] = None, timeout: float = TIMEOUT_S) -> Outcome:
    """Run a single snippet or a pair; ok when every process exited 0 before its deadline."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="llmdd-snippet-") as tmp:
            return run_unit(unit, Path(tmp), timeout)
    unit = on_a_free_port(unit)
    if len(unit.snippets) == 1:
        return _run_single(unit.snippets[0], workdir, timeout)
    return _run_pair(unit.snippets[0], unit.snippets[1], workdir, timeout)


def on_a_free_port(unit: Unit) -> Unit:
    """``unit`` with :data:`DOC_PORT` in its code replaced by a port free on 127.0.0.1 a moment ago (the
    same one in both blocks of a pair); a unit that does not name it is returned as it is."""
    if not any(_DOC_PORT.search(s.code) for s in unit.snippets):
        return unit
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return Unit(tuple(dataclasses.replace(s, code=_DOC_PORT.sub(str(port), s.code)) for s in unit.snippets))


def _run_single(snippet: Snippet, workdir: Path, timeout: float) -> Outcome:
    proc, _, err = _spawn(snippet, workdir, stdin=subprocess.DEVNULL)
    reader = _Reader(proc)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return Outcome(False, f"timed out after {timeout:.0f} s\n" + _report("block", snippet, proc, reader, err))
    ok = proc.returncode == 0
    return Outcome(ok, "" if ok else _report("block", snippet, proc, reader, err))


def _run_pair(first: Snippet, second: Snippet, workdir: Path, timeout: float) -> Outcome:
    p1, _, err1 = _spawn(first, workdir, stdin=subprocess.PIPE)
    r1 = _Reader(p1)
    r1.start()
    p2 = r2 = err2 = None
    problem = ""
    try:
        deadline1 = time.monotonic() + timeout
        try:
            ready = r1.first.get(timeout=timeout)
        except queue.Empty:
            ready = None
            problem = f"role={first.role} printed no line within {timeout:.0f} s (its readiness signal)"
        if ready is None and not problem:
            try:
                p1.wait(10)
                problem = f"role={first.role} exited before printing its readiness line"
            except subprocess.TimeoutExpired:
                problem = f"role={first.role} closed its stdout without printing its readiness line"
        if not problem:
            p2, _, err2 = _spawn(second, workdir, stdin=subprocess.DEVNULL)
            r2 = _Reader(p2)
            r2.start()
            try:
                p2.wait(timeout)
            except subprocess.TimeoutExpired:
                problem = f"role={second.role} timed out after {timeout:.0f} s"
        if p1.poll() is None:
            try:
                assert p1.stdin is not None
                p1.stdin.write(b"\n")
                p1.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                p1.wait(max(1.0, deadline1 - time.monotonic()))
            except subprocess.TimeoutExpired:
                problem = problem or f"role={first.role} did not exit after its Enter"
    finally:
        _kill(p1)
        if p2 is not None:
            _kill(p2)
    ok = not problem and p1.returncode == 0 and p2 is not None and p2.returncode == 0
    if ok:
        return Outcome(True, "")
    detail = [problem] if problem else []
    detail.append(_report(f"role={first.role}", first, p1, r1, err1))
    if p2 is not None:
        detail.append(_report(f"role={second.role}", second, p2, r2, err2))
    return Outcome(False, "\n".join(detail))


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="run the python snippets of Markdown pages")
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: README.md and docs/**/*.md)")
    parser.add_argument("--list-skips", action="store_true", help="print the opt-outs and exit")
    args = parser.parse_args(argv)
    pages = args.pages or doc_pages()
    found, errors = collect(pages)
    for e in errors:
        print("error:", e)
    if args.list_skips:
        print("\n".join(skip_lines(found)))
        return 1 if errors else 0
    failed = 0
    for unit in found:
        if unit.skip is not None:
            print(f"skip {unit.id}: {unit.skip}")
            continue
        started = time.monotonic()
        outcome = run_unit(unit)
        print(f"{'ok  ' if outcome.ok else 'FAIL'} {unit.id} ({time.monotonic() - started:.1f} s)")
        if not outcome.ok:
            failed += 1
            print(outcome.detail)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
