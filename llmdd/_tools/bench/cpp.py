"""The C++ row of ``llmdd bench``: libllm_datadist's ``PullKvBlocks`` against the Python call.

One Python prompt serves two caches; a C++ decoder (``cpp/build/tests/bench_pull``) and a Python
decoder (this module, ``pydecoder``) each link to it in turn, interleaved over several rounds in
the same run, and time

* one 64 KiB block of one tensor (``PullKvBlocks`` / ``pull_blocks``), p50 and p99;
* every 64 KiB block of ``tensors`` x ``blocks`` (reversed, so no two blocks coalesce), GB/s,

checking the bytes they received.  The row reports the medians over the rounds, the ratios
(C++ p50 / Python p50, target <= 1.2; C++ GB/s / Python GB/s, target >= 0.9) and the resident
memory of each decoder process at the end (the library's cost beyond a Python engine).

When the C++ library is not built the row is skipped with the reason and what to do (build it with
``bash scripts/test_cpp.sh`` or ``cmake -S cpp -B cpp/build && cmake --build cpp/build``; from an installed
wheel, which has no C++ sources, in a checkout of them, named by ``LLMDD_CPP_BUILD``);
``LLMDD_CPP_BUILD`` names another build directory.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import numpy as np

from llmdd._tools.bench.common import KiB, MiB, rss_bytes

SALT = 0x5EED0000
BLOCK = 64 * KiB
BLOCK_INTS = BLOCK // 4
PROMPT, DECODER = 1, 2
#: the source checkout this module runs from (llmdd/_tools/bench/cpp.py -> the checkout's root); in an
#: installed wheel this is site-packages, which has no cpp/ (see :func:`not_built_reason`)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def not_built_reason() -> str:
    """Why the C++ row is skipped, with what to do: in a source checkout, build it; from an installed wheel
    (which ships no C++ sources), build it in a checkout of the sources and name that build."""
    if os.environ.get("LLMDD_CPP_BUILD"):
        return (f"C++ library not built: no tests/bench_pull in LLMDD_CPP_BUILD={os.environ['LLMDD_CPP_BUILD']} "
                f"(build it with `bash scripts/test_cpp.sh` in llmdd's source checkout)")
    if os.path.isfile(os.path.join(_REPO, "cpp", "CMakeLists.txt")):
        return ("C++ library not built: no cpp/build/tests/bench_pull (run `bash scripts/test_cpp.sh` or "
                "`cmake -S cpp -B cpp/build && cmake --build cpp/build`; LLMDD_CPP_BUILD names another build)")
    return ("the C++ API is not part of an installed llmdd (a wheel ships no C++ sources): to measure it, build it "
            "in a checkout of llmdd's sources (`bash scripts/test_cpp.sh` there builds cpp/build) and run "
            "`LLMDD_CPP_BUILD=<checkout>/cpp/build llmdd bench`")


def _binary() -> Optional[str]:
    build = os.environ.get("LLMDD_CPP_BUILD") or os.path.join(_REPO, "cpp", "build")
    path = os.path.join(build, "tests", "bench_pull")
    return path if os.access(path, os.X_OK) else None


def _engine(cluster_id: int, role, port: Optional[int], pool: int):
    import llmdd

    config = llmdd.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.mem_pool_cfg = json.dumps({"memory_size": pool})
    config.sync_kv_timeout = 30000
    if port is not None:
        config.listen_ip_info = f"127.0.0.1:{port}"
    dd = llmdd.LLMDataDist(role, cluster_id)
    dd.init(config.generate_options())
    return dd


def _desc(tensors: int, blocks: int):
    import llmdd

    return llmdd.CacheDesc(tensors, [blocks, BLOCK_INTS], llmdd.DataType.DT_INT32)


def _pool(tensors: int, blocks: int) -> int:
    return (16 + tensors * blocks) * BLOCK + 16 * MiB


def serve(port: int, tensors: int, blocks: int) -> None:
    """The prompt: cache 1 (1 x 16 blocks) and cache 2 (tensors x blocks), blocks keys = cache ids."""
    import llmdd

    dd = _engine(PROMPT, llmdd.LLMRole.PROMPT, port, _pool(tensors, blocks))
    cm = dd.cache_manager
    one = cm.allocate_blocks_cache(_desc(1, 16), llmdd.BlocksCacheKey(PROMPT, 1))
    many = cm.allocate_blocks_cache(_desc(tensors, blocks), llmdd.BlocksCacheKey(PROMPT, 2))
    words = blocks * BLOCK // 8
    for cache, n in ((one, 16 * BLOCK // 8), (many, words)):
        for t, addr in enumerate(cache.tensor_addrs):
            arr = np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(addr))
            arr[:] = np.arange(n, dtype=np.uint64) + np.uint64(SALT + t * n)
    print("READY", flush=True)
    sys.stdin.readline()
    dd.finalize()


def pydecoder(port: int, lat_n: int, lat_warmup: int, tensors: int, blocks: int, reps: int) -> None:
    """The Python decoder: the same steps as bench_pull.cc, printed as one JSON line."""
    import llmdd

    dd = _engine(DECODER, llmdd.LLMRole.DECODER, None, _pool(tensors, blocks))
    cm = dd.cache_manager
    info = llmdd.LLMClusterInfo()
    info.remote_cluster_id = PROMPT
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    status, _ = dd.link_clusters([info], 5000)
    if status != llmdd.LLMStatusCode.LLM_SUCCESS:
        print(json.dumps({"error": f"link failed: {status}"}), flush=True)
        return
    one = cm.allocate_blocks_cache(_desc(1, 16))
    many = cm.allocate_blocks_cache(_desc(tensors, blocks))
    n = blocks * BLOCK // 8
    views = [np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(a)) for a in many.tensor_addrs]
    for v in views:
        v[:] = 0
    call_us = []
    for i in range(lat_warmup + lat_n):  # a call that moves nothing: an unknown id unregistered
        t0 = time.perf_counter()
        cm.unregister_cache(999999)
        t1 = time.perf_counter()
        if i >= lat_warmup:
            call_us.append((t1 - t0) * 1e6)
    call_us.sort()
    key1 = llmdd.BlocksCacheKey(PROMPT, 1)
    us = []
    for i in range(lat_warmup + lat_n):
        b = i % 16
        t0 = time.perf_counter()
        cm.pull_blocks(key1, one, [b], [b])
        t1 = time.perf_counter()
        if i >= lat_warmup:
            us.append((t1 - t0) * 1e6)
    us.sort()
    src = list(range(blocks))
    dst = src[::-1]
    key2 = llmdd.BlocksCacheKey(PROMPT, 2)
    nbytes = tensors * blocks * BLOCK
    rates = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        cm.pull_blocks(key2, many, src, dst)
        t1 = time.perf_counter()
        if r:
            rates.append(nbytes / (t1 - t0) / 1e9)
    per_block = BLOCK // 8
    verified = True
    for t, v in enumerate(views):
        got = v.reshape(blocks, per_block)[dst]
        want = (np.arange(blocks, dtype=np.uint64)[:, None] * per_block + np.arange(per_block, dtype=np.uint64)
                + np.uint64(SALT + t * n))
        verified = verified and bool(np.array_equal(got, want))
    rates.sort()
    rss = rss_bytes()
    dd.unlink_clusters([info], 1000)
    dd.finalize()
    print(json.dumps({"p50_us": us[len(us) // 2], "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))], "n": len(us),
                      "call_p50_us": call_us[len(call_us) // 2], "gbps": rates[len(rates) // 2],
                      "gbps_all": rates, "bytes": nbytes, "verified": verified, "rss_bytes": rss}), flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_json(argv: list, timeout: float) -> dict:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{os.path.basename(argv[0])} printed no result (rc={out.returncode}): "
                           f"{(out.stderr or out.stdout).strip()[-300:]}")
    result = json.loads(lines[-1])
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def run_cpp(quick: bool, progress: Optional[Callable[[str], None]] = None, rounds: int = 3) -> dict:
    """The C++ row (or ``{"skipped": reason}``)."""
    note = progress or (lambda _s: None)
    binary = _binary()
    if binary is None:
        reason = not_built_reason()
        note(f"cpp: skipped ({reason})")
        return {"skipped": reason}
    lat_n, lat_warmup, tensors, blocks, reps = (200, 20, 4, 64, 5) if quick else (1000, 100, 8, 128, 5)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "llmdd._tools.bench.cpp", "serve", str(port), str(tensors),
                               str(blocks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stdin, stdout = server.stdin, server.stdout
    if stdin is None or stdout is None:   # both are PIPE above
        raise RuntimeError("the bench prompt's pipes were not made")
    runs: dict = {"cpp": [], "python": []}
    orders: list = []  # per round, the side that ran first and the one that ran second
    try:
        line = stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"the bench prompt did not start (rc={server.poll()})")
        args = [str(port), str(lat_n), str(lat_warmup), str(tensors), str(blocks), str(reps)]
        for r in range(rounds):
            # interleaved ABBA: C++ first in odd rounds (1, 3, ...), Python first in even ones, so that
            # what running first or second costs does not fall on one side only (with an odd number
            # of rounds C++ runs first once more; "orders" records it)
            order = ("cpp", "python") if r % 2 == 0 else ("python", "cpp")
            orders.append(list(order))
            for side in order:
                argv = [binary] + args if side == "cpp" else [sys.executable, "-m", "llmdd._tools.bench.cpp",
                                                               "pydecoder"] + args
                runs[side].append(_run_json(argv, timeout=300))
            note(f"cpp: round {r + 1}/{rounds} ({order[0]} first): C++ p50 {runs['cpp'][-1]['p50_us']:.1f} us, "
                 f"Python p50 {runs['python'][-1]['p50_us']:.1f} us")
    finally:
        if server.poll() is None:
            stdin.write("EXIT\n")
            stdin.flush()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    keys = ("p50_us", "p99_us", "call_p50_us", "gbps", "rss_bytes")
    med = {side: {k: statistics.median(x[k] for x in runs[side]) for k in keys} for side in runs}
    lat_ratio = med["cpp"]["p50_us"] / med["python"]["p50_us"]
    bw_ratio = med["cpp"]["gbps"] / med["python"]["gbps"]
    rss_delta = med["cpp"]["rss_bytes"] - med["python"]["rss_bytes"]
    row = {
        "cpp": med["cpp"], "python": med["python"], "runs": runs, "rounds": rounds, "orders": orders,
        "sizes": {"latency_n": lat_n, "latency_warmup": lat_warmup, "tensors": tensors, "blocks": blocks,
                  "block_bytes": BLOCK, "bw_reps": reps},
        "latency_ratio": lat_ratio, "latency_met": lat_ratio <= 1.2,
        "bandwidth_ratio": bw_ratio, "bandwidth_met": bw_ratio >= 0.9,
        "rss_delta_bytes": rss_delta, "rss_met": rss_delta <= 30 * MiB,
        "verified": all(x["verified"] for side in runs.values() for x in side),
    }
    row["line"] = (f"C++ PullKvBlocks (one 64 KiB block) p50 {med['cpp']['p50_us']:.1f} us vs Python "
                   f"{med['python']['p50_us']:.1f} us = {lat_ratio:.2f}x (goal <= 1.2); 64 KiB-block bandwidth "
                   f"{med['cpp']['gbps']:.2f} vs {med['python']['gbps']:.2f} GB/s = {bw_ratio:.2f}x (goal >= 0.9); "
                   f"RSS {rss_delta / MiB:+.1f} MiB vs the Python decoder (goal <= 30); verified={row['verified']}")
    note(f"cpp: {row['line']}")
    return row


if __name__ == "__main__":
    if sys.argv[1] == "row":  # the row alone: python -m llmdd._tools.bench.cpp row [--quick] [--out FILE] [rounds]
        args = sys.argv[2:]
        out_path = None
        if "--out" in args:  # the full result (every round, load, UTC times, git HEAD) as JSON in FILE
            i = args.index("--out")
            out_path = args[i + 1]
            del args[i:i + 2]
        quick = "--quick" in args
        rounds = [int(a) for a in args if a != "--quick"]
        load0, utc0 = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        result = run_cpp(quick, progress=lambda s: print(s, file=sys.stderr, flush=True),
                         rounds=rounds[0] if rounds else (1 if quick else 3))
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        if out_path:
            def _git(*a):
                r = subprocess.run(["git", "-C", _REPO] + list(a), capture_output=True, text=True)
                return r.stdout.rstrip("\n") if r.returncode == 0 else None

            result = dict(result, command=" ".join(["python", "-m", "llmdd._tools.bench.cpp"] + sys.argv[1:]),
                          quick=quick, load_before=list(load0), load_after=list(os.getloadavg()),
                          utc_start=utc0, utc_end=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          git_head=_git("rev-parse", "HEAD"), cpus=os.cpu_count(),
                          git_status=(_git("status", "--porcelain", "--untracked-files=no") or "").splitlines())
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
        sys.exit(0 if result.get("verified", True) else 1)
    cmd, rest = sys.argv[1], [int(a) for a in sys.argv[2:]]
    commands: dict[str, Callable[..., None]] = {"serve": serve, "pydecoder": pydecoder}
    commands[cmd](*rest)
