"""A transport's loopback self-test, in this process or with the region owned by a helper process."""

from __future__ import annotations

import functools
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import attrs
import numpy as np

from llmdd._tools.doctor.info import _plugin_manager
from llmdd._tools.doctor.child import _Child, _describe_error
from llmdd._tools.doctor.report import SelfTestResult
from llmdd._tools.doctor.util import (
    _CHILD_TIMEOUT_S,
    SELF_TEST_BYTES,
    SELF_TEST_OP_BYTES,
)

if TYPE_CHECKING:
    from llmdd._memory.backend import Segment
    from llmdd._seam.abc import Endpoint, Transport
    from llmdd.plugin import TransportRegistry


@functools.lru_cache(maxsize=1)
def _pattern(size: int) -> np.ndarray:
    """Deterministic, position-dependent bytes (a stale or shifted byte never matches); read-only, cached."""
    words = np.arange(size // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(0x6C6C6D6464446F63)
    out = words.view(np.uint8)
    out.flags.writeable = False
    return out


class _Owned:
    """The region a self-test reads: a pool-style shared-memory segment owned by one endpoint."""

    def __init__(self, transport_cls: type[Transport], size: int) -> None:
        from llmdd._base.enums import Placement
        from llmdd._memory.backend import HostBackend
        from llmdd._base.backing import SharedSegment
        from llmdd._seam.abc import MemRegion

        self.backend = HostBackend()
        self.endpoint: Optional[Endpoint] = None
        segment = self.backend.allocate_segment(size)
        self.segment: Optional[Segment] = segment
        try:
            segment.array()[:] = _pattern(size)
            self.endpoint = transport_cls({}).open_endpoint(host="127.0.0.1")
            self.desc = self.endpoint.register(MemRegion(
                region_id=1, addr=segment.addr, size=size, remote_accessible=True,
                placement=int(Placement.HOST), backing=SharedSegment(name=segment.name, offset=0)))
            self.peer = self.endpoint.describe()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.segment is not None:
            self.backend.release(self.segment)
            self.segment = None


def _owner_child(transport: str, size: int, send: Callable[[dict], None]) -> None:
    """Child side of a two-process self-test: own the region until the parent is done."""
    owned = None
    try:
        _, registry = _plugin_manager()
        owned = _Owned(registry.get(transport), size)
        send({"kind": "ready", "peer": owned.peer, "desc": owned.desc})
        sys.stdin.readline()  # "done", or EOF when the parent goes away
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        send({"kind": "error", "error": _describe_error(exc)})
    finally:
        if owned is not None:
            owned.close()


def self_test(transport: str, seconds: float = 3.0, *, size: int = SELF_TEST_BYTES,
              op_bytes: int = SELF_TEST_OP_BYTES, processes: str = "auto", registry: Optional[TransportRegistry] = None) -> SelfTestResult:
    """Read a registered ``size``-byte region with ``op_bytes`` ops for ``seconds``; verify; report GB/s.

    ``processes``: ``"one"`` (two endpoints in this process), ``"two"`` (the region is owned
    by an endpoint in a spawned child) or ``"auto"`` (one; two when one fails for a
    same-host-only transport).  Never raises: a failure is ``ok=False`` with its reason.
    """
    if processes not in ("auto", "one", "two"):
        raise ValueError(f"processes must be 'auto', 'one' or 'two', got {processes!r}")
    try:
        if registry is None:
            _, registry = _plugin_manager()
        cls = registry.get(transport)
        probed = registry.probe(transport)
    except Exception as exc:  # noqa: BLE001
        return SelfTestResult(transport=transport, ok=False, error=_describe_error(exc))
    if not probed.available:
        return SelfTestResult(transport=transport, ok=False,
                              error=f"not available here: {probed.reason or 'no reason given'}")
    try:
        if processes in ("auto", "one"):
            result = _self_test_run(cls, transport, seconds, size, op_bytes, two=False)
            if result.ok or processes == "one" or not cls.same_host_only:
                return result
            retry = _self_test_run(cls, transport, seconds, size, op_bytes, two=True)
            if retry.ok:
                return attrs.evolve(retry, note=f"in-process run failed ({result.error}); ran with two processes")
            return retry
        return _self_test_run(cls, transport, seconds, size, op_bytes, two=True)
    finally:
        _pattern.cache_clear()  # do not keep the region-sized pattern alive after the test


def _self_test_run(cls: type, transport: str, seconds: float, size: int, op_bytes: int, *,
                   two: bool) -> SelfTestResult:
    from llmdd._base.enums import Placement
    from llmdd._seam.abc import MemRegion
    from llmdd._seam.ops import make_ops

    result = functools.partial(SelfTestResult, transport=transport, region_bytes=size, op_bytes=op_bytes,
                               processes=2 if two else 1)
    if size <= 0 or op_bytes <= 0 or size % op_bytes or size % 8:
        return result(ok=False, error=f"region size {size} must be a positive multiple of the op size "
                                      f"{op_bytes} and of 8")
    owned = child = None
    local = channel = None
    started = time.monotonic()
    try:
        if two:
            child = _Child({"op": "own", "transport": transport, "size": size})
            msg = child.recv(_CHILD_TIMEOUT_S)
            if msg is None:
                return result(ok=False, error=child.failure())
            if msg.get("kind") != "ready":
                return result(ok=False, error=f"the helper process failed: {msg.get('error')}")
            peer, desc = msg["peer"], msg["desc"]
        else:
            owned = _Owned(cls, size)
            peer, desc = owned.peer, owned.desc
        dst = np.zeros(size, np.uint8)
        local = cls({}).open_endpoint(host="127.0.0.1")
        local.register(MemRegion(region_id=2, addr=int(dst.ctypes.data), size=size, remote_accessible=False,
                                 placement=int(Placement.HOST)))
        channel = local.connect(peer, timeout=10.0)
        channel.add_remote_region(1, size, desc)
        count = size // op_bytes
        offsets = np.arange(count, dtype=np.uint64) * np.uint64(op_bytes)
        ops = make_ops(2, offsets, 1, offsets, op_bytes)
        expected = _pattern(size)
        batch_limit = max(10.0, 4 * seconds)

        def read_once() -> float:
            t0 = time.perf_counter()
            completion = channel.read(ops, deadline=time.monotonic() + batch_limit)
            completion.wait()
            err = completion.error
            if err is not None:
                raise err
            return time.perf_counter() - t0

        read_once()  # warm-up, verified but not timed: maps the peer's memory, faults the destination in
        if not np.array_equal(dst, expected):
            bad = int(np.argmax(dst != expected))
            return result(ok=False, error=f"bytes differ after a read (first at offset {bad})")
        busy = 0.0
        batches = 0
        end = time.perf_counter() + max(0.0, seconds)
        while time.perf_counter() < end:
            busy += read_once()
            batches += 1
        dst[:] = 0  # the last read must rewrite every byte
        busy += read_once()
        batches += 1
        if not np.array_equal(dst, expected):
            bad = int(np.argmax(dst != expected))
            return result(ok=False, error=f"bytes differ after {batches + 1} reads (first at offset "
                                          f"{bad})", batches=batches)
        total = batches * size
        return result(ok=True, gbps=total / max(busy, 1e-9) / 1e9, bytes_read=total,
                      batches=batches, seconds=busy, verified=True)
    except Exception as exc:  # noqa: BLE001 - reported with its reason, never a traceback
        return result(ok=False, error=_describe_error(exc),
                      seconds=time.monotonic() - started)
    finally:
        for closer in (getattr(channel, "close", None), getattr(local, "close", None),
                       getattr(owned, "close", None)):
            if closer is not None:
                try:
                    closer()
                except Exception:  # noqa: BLE001 - cleanup of a failed test
                    pass
        if child is not None:
            child.send("done")
            child.close()
