"""The control path's bulk notice for ``llmdd bench`` (issue 22, target 4).

A peer-read notice (``ReadDone``) of 256 entries x 8 block spans, half the entries keyed, seeded
random content (the same shape as bench/control_codec.py): encode + decode of its payload, timed in
``rounds`` rounds; per round the per-operation wall time and this thread's CPU time
(``time.thread_time``: on a shared machine it leaves out the time the thread waited for a core).
The target is judged on the CPU-time median (the codec's cost); the wall times are kept beside it.
"""

from __future__ import annotations

import random
import statistics
import time
from types import ModuleType
from typing import Any


def _notice(m: ModuleType, rng: random.Random, entries: int, spans: int) -> Any:
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
        out.append(m.ReadDoneEntry.from_spans(cache_id=rng.randrange(1 << 40), key=key,
                                              block_spans=tuple(block_spans)))
    return m.ReadDone(entries=tuple(out))


def run_control(rounds: int = 15, iterations: int = 100, seed: int = 22) -> dict:
    from llmdd._protocol import codec
    from llmdd._protocol import messages as m

    msg = _notice(m, random.Random(seed), 256, 8)
    code = codec.MESSAGE_TYPES[m.ReadDone]
    payload = codec.encode_payload(msg)
    if codec.decode_payload(code, payload) != msg:
        raise RuntimeError("the notice does not round-trip")   # the bench measures a working codec
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(iterations):
            codec.decode_payload(code, codec.encode_payload(msg))
        wall.append((time.perf_counter() - t0) / iterations * 1e3)
        cpu.append((time.thread_time() - c0) / iterations * 1e3)
    return {"peer_read_notice_256x8": {
        "encode_decode_ms": statistics.median(cpu), "cpu_ms_all": [round(x, 4) for x in cpu],
        "wall_ms": statistics.median(wall), "wall_ms_all": [round(x, 4) for x in wall],
        "payload_bytes": len(payload), "rounds": rounds, "iterations": iterations, "seed": seed,
        "wire_version": codec.WIRE_VERSION, "verified": True}}
