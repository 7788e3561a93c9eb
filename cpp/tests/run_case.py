"""Runs one multi-process case of the C++ tests (ctest calls it): starts the processes, paces
them with one-word commands on stdin, waits for their one-word answers on stdout (every wait has
a deadline), and checks exit statuses.  Exit status 0 = the case passed.

    run_case.py --bin <build/tests dir> <case>
"""

from __future__ import annotations

import argparse
import glob
import os
import queue
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = [sys.executable, os.path.join(HERE, "py_peer.py")]
DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, argv: list, env: dict | None = None) -> None:
        self.name = name
        self.lines: queue.Queue = queue.Queue()
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  env=env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            print(f"[{self.name}] {line.rstrip()}", flush=True)
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, word: str, timeout: float = DEADLINE_S) -> None:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.name}: no {word!r} within {timeout} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"{self.name} ended (rc={self.p.wait()}) before saying {word!r}")
            if line == word:
                return
            if line.startswith("[ERROR]"):
                raise AssertionError(f"{self.name}: {line}")

    def send(self, word: str) -> None:
        self.p.stdin.write(word + "\n")
        self.p.stdin.flush()

    def finish(self, timeout: float = DEADLINE_S) -> int:
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout} s") from None
        self.reader.join(timeout=5)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def guide_pair(prompt_argv: list, decoder_argv: list) -> None:
    procs = []
    try:
        prompt = Proc("prompt", prompt_argv)
        procs.append(prompt)
        prompt.wait_for("READY")
        decoder = Proc("decoder", decoder_argv)
        procs.append(decoder)
        decoder.wait_for("PULLED")
        prompt.send("PUSH")
        prompt.wait_for("PUSHED")
        decoder.send("VERIFY")
        decoder.wait_for("VERIFIED")
        prompt.send("FORCE")
        prompt.wait_for("UNLINKED")
        decoder.send("FORCE")
        decoder.wait_for("UNLINKED")
        prompt.wait_for("DONE")
        decoder.wait_for("DONE")
        for p in procs:
            rc = p.finish()
            assert rc == 0, f"{p.name} exited with {rc}"
    finally:
        for p in procs:
            p.kill()


def with_server(client_argv_of_port, after=None) -> None:
    port = free_port()
    server = Proc("py-serve", PEER + ["serve", str(port)])
    try:
        server.wait_for("READY")
        client = Proc("client", client_argv_of_port(port))
        try:
            if after is not None:
                after(client)
            else:
                client.wait_for("DONE", timeout=60)
                rc = client.finish()
                assert rc == 0, f"client exited with {rc}"
        finally:
            client.kill()
        server.send("EXIT")  # the server survived whatever the client did
        server.wait_for("DONE")
        assert server.finish() == 0
    finally:
        server.kill()


def exit_promptly(client: Proc) -> None:
    client.wait_for("EXITING")
    start = time.monotonic()
    rc = client.finish(timeout=10)
    took = time.monotonic() - start
    assert rc == 0, f"exit_without_finalize exited with {rc}"
    assert took < 5.0, f"the process took {took:.2f} s to exit without Finalize"
    left = glob.glob(f"/dev/shm/llmdd_{client.p.pid}_*")
    assert not left, f"shared-memory segments left behind: {left}"
    print(f"exited {took * 1000:.0f} ms after main returned, no segment left", flush=True)


def bench_row(build: str) -> None:
    """``llmdd bench``'s C++ row: skipped with its reason without a build, measured and verified with one."""
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from llmdd._tools.bench import cpp

    os.environ["LLMDD_CPP_BUILD"] = os.path.join(build, "no-such-build")
    row = cpp.run_cpp(quick=True, rounds=1)
    assert set(row) == {"skipped"} and "not built" in row["skipped"], row
    os.environ["LLMDD_CPP_BUILD"] = build
    row = cpp.run_cpp(quick=True, progress=print, rounds=1)
    assert row["verified"] is True, row
    for side in ("cpp", "python"):
        assert row[side]["p50_us"] > 0 and row[side]["gbps"] > 0, row
    assert row["latency_ratio"] == row["cpp"]["p50_us"] / row["python"]["p50_us"]
    assert "PullKvBlocks" in row["line"]


def examples_by_hand(b: str) -> None:
    """The examples run by hand without their driver say how they are paced instead of exiting silently,
    and a decoder with no prompt to link to says why the link failed (the reason, not only the code)."""
    prompt = os.path.join(b, "example_prompt")
    for stdin, said in ((subprocess.DEVNULL, "[ERROR] stdin ended before the command PUSH (sent once the decoder "
                                             "printed PULLED): these examples are paced by one-word commands"),
                        ("HELLO\n", '[ERROR] expected the command PUSH (sent once the decoder printed PULLED), '
                                    'got "HELLO": these examples are paced')):
        p = subprocess.run([prompt, str(free_port())], input=None if stdin is subprocess.DEVNULL else stdin,
                           stdin=stdin if stdin is subprocess.DEVNULL else None, capture_output=True, text=True,
                           timeout=DEADLINE_S)
        lines = p.stdout.splitlines()
        assert p.returncode != 0 and lines[0] == "READY", p.stdout
        assert lines[1].startswith(said), p.stdout
        assert "cpp/tests/run_case.py --bin" in p.stdout and "docs/cpp.md" in p.stdout, p.stdout
    p = subprocess.run([prompt], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=DEADLINE_S)
    assert p.returncode == 2 and p.stdout.startswith("usage: ") and "paced by one-word commands" in p.stdout, p.stdout
    closed = free_port()
    p = subprocess.run([os.path.join(b, "example_decoder"), str(closed)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=DEADLINE_S)
    assert p.returncode != 0, p.stdout
    assert p.stdout.startswith("[ERROR] LinkLlmClusters failed, ret = "), p.stdout
    # "cannot connect to 127.0.0.1:PORT: ... refused" (or, on a starved machine, "link to 127.0.0.1:PORT failed: ...")
    assert "; cluster 1: " in p.stdout and f"127.0.0.1:{closed}" in p.stdout, p.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("case")
    args = ap.parse_args()
    b = args.bin
    port = free_port()
    cpp_prompt = [os.path.join(b, "example_prompt"), str(port)]
    cpp_decoder = [os.path.join(b, "example_decoder"), str(port)]
    if args.case == "cpp_cpp":
        guide_pair(cpp_prompt, cpp_decoder)
    elif args.case == "cpp_prompt_py_decoder":
        guide_pair(cpp_prompt, PEER + ["decoder", str(port)])
    elif args.case == "py_prompt_cpp_decoder":
        guide_pair(PEER + ["prompt", str(port)], cpp_decoder)
    elif args.case == "remote_checks":
        with_server(lambda p: [os.path.join(b, "remote_checks"), str(p)])
    elif args.case == "exit_without_finalize":
        with_server(lambda p: [os.path.join(b, "exit_without_finalize"), str(p)], after=exit_promptly)
    elif args.case == "exit_after_thread_init":  # the interpreter started on a thread that is gone
        with_server(lambda p: [os.path.join(b, "exit_without_finalize"), str(p), "thread"], after=exit_promptly)
    elif args.case == "embedded_host":
        p = Proc("embedded_host", [os.path.join(b, "embedded_host")])
        p.wait_for("DONE")
        assert p.finish() == 0
    elif args.case == "bad_python":
        env = dict(os.environ, LLMDD_PYTHON="/nonexistent/bin/python3")
        p = Proc("api_local", [os.path.join(b, "api_local"), "bad_python"], env=env)
        p.wait_for("DONE")
        assert p.finish() == 0
    elif args.case == "examples_by_hand":
        examples_by_hand(b)
    elif args.case == "bench_row":
        bench_row(os.path.dirname(os.path.abspath(b)))
    else:
        raise SystemExit(f"unknown case {args.case}")
    print(f"case {args.case}: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
