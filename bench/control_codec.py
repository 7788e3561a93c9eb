#!/usr/bin/env python3
"""Micro-benchmark of the control-plane codec (issue 22, target 4).

Times encoding and decoding of control messages, payload only (``encode_payload`` /
``decode_payload``) and as whole frames through two ``Connection`` objects (header, CRC32, buffer
handling).  The headline case is a peer-read notice (``ReadDone``) of 256 entries x 8 block spans,
half of the entries carrying a key: target 4 asks for encode + decode <= 0.3 ms.

Seeded random content; every case is run in ``--rounds`` rounds of ``--iterations`` operations and
each round's per-operation time is kept, so the JSON holds medians over rounds and the spread.
Only ``encode_payload``, ``decode_payload``, ``Connection`` and the message constructors are used,
which both the v1 (hand-rolled binary) and the v2 (MessagePack) codec provide: pointing
PYTHONPATH at an export of an older commit times that codec with the same script::

    python bench/control_codec.py --out bench/results-committed/issue22/control_codec-v2-1.json
    git archive <v1-commit> llmdd | tar -x -C /tmp/llmdd-v1
    PYTHONPATH=/tmp/llmdd-v1 python bench/control_codec.py --label v1 --out ...

The library never prints; this script does (a summary line per case).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

TARGET_MS = 0.3  # issue 22, target 4: ReadDone 256 x 8 encode + decode


def _build_read_done(m: Any, rng: random.Random, entries: int, spans: int) -> Any:
    out = []
    for i in range(entries):
        pos = rng.randrange(1 << 20)
        block_spans = []
        for _ in range(spans):
            start = pos + rng.randrange(1, 64)
            stop = start + rng.randrange(1, 32)
            block_spans.append(m.Span(start=start, stop=stop))
            pos = stop
        key = m.KeyRef.for_req(rng.randrange(1 << 48), rng.randrange(1 << 16)) if i % 2 else None
        # wire v3 carries the spans as flat bounds (ReadDoneEntry.from_spans); v1/v2 as Span objects
        make = getattr(m.ReadDoneEntry, "from_spans", m.ReadDoneEntry)
        out.append(make(cache_id=rng.randrange(1 << 40), key=key, block_spans=tuple(block_spans)))
    return m.ReadDone(entries=tuple(out))


def _build_cache_table(m: Any, rng: random.Random, caches: int) -> Any:
    added = tuple(m.CacheEntry(cache_id=i, addrs=tuple(rng.randrange(1 << 47) for _ in range(4)),
                               tensor_size=rng.randrange(1 << 24), shape=(rng.randrange(1, 512), 16, 128),
                               data_type=1, is_blocks=bool(i % 2)) for i in range(caches))
    keys = tuple(m.KeyEntry(key=m.KeyRef.for_req(rng.randrange(1 << 48), 0), cache_id=i, batch_index=0)
                 for i in range(caches))
    return m.CacheTableUpdate(version=1, full=True, caches_added=added, keys_added=keys)


def _cases(m: Any, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "read_done_256x8": _build_read_done(m, rng, 256, 8),
        "read_done_1x1": _build_read_done(m, rng, 1, 1),
        "read_done_1024x8": _build_read_done(m, rng, 1024, 8),
        "keepalive": m.Keepalive(seq=rng.randrange(1 << 32), sent_at_ns=time.monotonic_ns()),
        "transfer_request": m.TransferRequest(request_id=rng.randrange(1 << 32), op="push_done", args={
            "cache_id": rng.randrange(1 << 40), "blocks": [[1, 3], [7, 9]], "tag": rng.randbytes(16),
            "failed": False, "status": 0}),
        "cache_table_256": _build_cache_table(m, rng, 256),
    }


def _time_per_op(fn: Callable[[], Any], iterations: int) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) per call.  On a shared machine the CPU time leaves
    out the time the thread waited for a core; both are recorded."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations, (time.thread_time() - c0) / iterations


def _stats(samples_s: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in samples_s)
    q = statistics.quantiles(ms, n=10) if len(ms) >= 2 else [ms[0]] * 9
    return {"median": statistics.median(ms), "p10": q[0], "p90": q[-1], "min": ms[0], "rounds": len(ms)}


def _load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        with open("/proc/loadavg") as f:
            return "loadavg " + f.read().strip()


def _git_commit(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run(rounds: int, iterations: int, seed: int, only: list[str] | None = None) -> dict:
    import llmdd._protocol.codec as codec
    from llmdd._protocol import messages as m

    results: dict[str, dict] = {}
    for name, msg in _cases(m, seed).items():
        if only and name not in only:
            continue
        code = codec.MESSAGE_TYPES[type(msg)]
        payload = codec.encode_payload(msg)
        assert codec.decode_payload(code, payload) == msg, name  # the bench measures a working round trip
        tx, rx = codec.Connection(), codec.Connection()

        def frame_round_trip() -> None:
            rx.receive_data(tx.send(msg))
            rx.next_message()

        # scale the iterations to the message so each round takes about the same time
        n = max(1, iterations if len(payload) < 1024 else iterations * 1024 // len(payload))
        measures = {
            "encode_ms": lambda: codec.encode_payload(msg),
            "decode_ms": lambda: codec.decode_payload(code, payload),
            "encode_plus_decode_ms": lambda: codec.decode_payload(code, codec.encode_payload(msg)),
            "frame_send_receive_ms": frame_round_trip,
        }
        wall: dict[str, list] = {k: [] for k in measures}
        cpu: dict[str, list] = {k: [] for k in measures}
        for _ in range(rounds):   # interleaved, so drifting load hits every measure alike
            for key, fn in measures.items():
                w, c = _time_per_op(fn, n)
                wall[key].append(w)
                cpu[key].append(c)
        results[name] = {"payload_bytes": len(payload), "iterations_per_round": n,
                         **{k: _stats(v) for k, v in wall.items()},
                         "cpu": {k: _stats(v) for k, v in cpu.items()}}
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iterations", type=int, default=200, help="operations per round (small messages)")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--label", default="", help="a name for the codec measured (e.g. v1, v2)")
    ap.add_argument("--case", action="append", help="only these cases (repeatable)")
    ap.add_argument("--out", help="write the JSON results here")
    args = ap.parse_args(argv)
    import llmdd._protocol.codec as codec

    load_before = _load()
    results = run(args.rounds, args.iterations, args.seed, args.case)
    head = results.get("read_done_256x8")
    try:
        import msgspec
        msgspec_version = msgspec.__version__
    except ImportError:
        msgspec_version = None
    doc = {
        "bench": "control_codec",
        "command": " ".join(([f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else [])
                            + [os.path.basename(sys.executable), "bench/control_codec.py", *(argv or sys.argv[1:])]),
        "label": args.label or f"wire-v{codec.WIRE_VERSION}",
        "wire_version": codec.WIRE_VERSION,
        "codec_module": codec.__file__,
        "git_commit_of_codec": _git_commit(os.path.dirname(codec.__file__)),
        "python": platform.python_version(),
        "msgspec": msgspec_version,
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": _load(),
        "seed": args.seed,
        "target": {"case": "read_done_256x8", "encode_plus_decode_ms_max": TARGET_MS,
                   "met_wall_median": None if head is None else head["encode_plus_decode_ms"]["median"] <= TARGET_MS,
                   "met_cpu_median": None if head is None
                   else head["cpu"]["encode_plus_decode_ms"]["median"] <= TARGET_MS},
        "results": results,
    }
    for name, r in results.items():
        print(f"{name:18s} {r['payload_bytes']:7d} B  encode {r['encode_ms']['median']:.4f} ms  "
              f"decode {r['decode_ms']['median']:.4f} ms  both {r['encode_plus_decode_ms']['median']:.4f} ms  "
              f"frame {r['frame_send_receive_ms']['median']:.4f} ms; cpu both "
              f"{r['cpu']['encode_plus_decode_ms']['median']:.4f} ms (medians of {r['encode_ms']['rounds']})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
