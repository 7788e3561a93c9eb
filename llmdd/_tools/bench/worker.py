"""The bench's worker process: one engine (or none, for anchors), its memory, its commands.

The parent drives a worker through a ``multiprocessing`` pipe: it sends ``(command,
kwargs)`` and gets ``("ok", payload)`` or ``("error", text)``.  Commands that must run
at the same time in two workers (a socket sender and its receiver, a prompt that pushes
and a decoder) are sent to both before either reply is read.

Every timed loop is here, next to the memory it touches, so a timing never includes a
pipe round trip to the parent.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import socket
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from llmdd._tools.bench.anchors import HOST, AnchorCommands, _rr_pull, _rr_push
from llmdd._tools.bench.common import (KiB, bw_summary, check_blocks, check_contiguous, fill_pattern, lat_summary, prefault,
                     rss_bytes)

if TYPE_CHECKING:
    from llmdd._api.datadist import LLMDataDist

PAIRED_CHUNK = 50   # engine calls and raw anchor calls alternate in chunks of this many (cmd_latency_pull)


def _until_known(fn, limit_s: float = 15.0) -> float:
    """Call ``fn`` until it stops failing with ``LLM_KV_CACHE_NOT_EXIST``; returns the seconds until it succeeded
    (the successful call included).

    A cache registered after the link reaches a linked peer asynchronously (a table update on the
    control channel), so the first call after a registration on the other side may not know it yet.
    """
    import llmdd

    t0 = time.perf_counter()
    while True:
        try:
            fn()
            return time.perf_counter() - t0
        except llmdd.LLMException as exc:
            if exc.status_code != llmdd.LLMStatusCode.LLM_KV_CACHE_NOT_EXIST or time.perf_counter() - t0 > limit_s:
                raise
        except RuntimeError as exc:  # an async task whose result said the cache does not exist
            if "NOT_EXIST" not in str(exc) or time.perf_counter() - t0 > limit_s:
                raise
        time.sleep(0.002)


class Worker(AnchorCommands):
    """The state of one worker process; ``cmd_<name>`` methods are its commands."""

    def __init__(self) -> None:
        self.rss_start = rss_bytes()
        self.dd: Optional[LLMDataDist] = None      # set by cmd_init
        self.cluster_id: Optional[int] = None
        self.bufs: dict[str, np.ndarray] = {}
        self.caches: dict[int, Any] = {}
        self.listener: Optional[socket.socket] = None

    # ------------------------------------------------------------------ engine
    @property
    def engine(self) -> LLMDataDist:
        """The engine ``cmd_init`` made; the commands that use it fail before that."""
        if self.dd is None:
            raise RuntimeError("this worker has no engine yet: cmd_init first")
        return self.dd

    def cmd_init(self, role: str, cluster_id: int, transport: str, listen: bool = False,
                 sync_ms: int = 20000, options: Optional[dict] = None) -> dict:
        """Create and init the engine; reports RSS before and after ``init`` (no caches yet).
        ``options``: more engine options (a variant row's, e.g. tcp+tls's ``llmdd.tls_*``)."""
        import gc

        import llmdd

        gc.collect()
        before = rss_bytes()
        cfg = llmdd.LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        cfg.sync_kv_timeout = sync_ms
        if listen:
            cfg.listen_ip_info = f"{HOST}:0"
        extra = options or {}
        options = cfg.generate_options()
        options["llmdd.transport"] = transport
        options.update(extra)
        dd = llmdd.LLMDataDist(llmdd.LLMRole[role], cluster_id)
        t0 = time.perf_counter()
        dd.init(options)
        init_s = time.perf_counter() - t0
        gc.collect()
        after = rss_bytes()
        self.dd = dd
        self.cluster_id = cluster_id
        port = dd.statistics()["listen"][1] if listen else None
        return {"pid": os.getpid(), "port": port, "rss_process_start": self.rss_start, "rss_before_init": before,
                "rss_after_init": after, "init_s": init_s}

    def cmd_link(self, remote: int, port: int, timeout_ms: int = 20000) -> dict:
        import llmdd

        info = llmdd.LLMClusterInfo()
        info.remote_cluster_id = remote
        info.append_local_ip_info(HOST, 0)
        info.append_remote_ip_info(HOST, port)
        t0 = time.perf_counter()
        ret, rets = self.engine.link_clusters([info], timeout_ms)
        link_s = time.perf_counter() - t0
        link = self.engine.statistics()["links"].get(remote) or {}
        out = {"status": ret.name, "per_cluster": [r.name for r in rets], "link_s": link_s,
               "transport": link.get("transport"), "transport_reason": link.get("transport_reason")}
        if link.get("transport") == "tcp":   # do its data connections use TLS (the tcp+tls row)?
            out["data_tls"] = bool(self.engine._require_core().link_manager.endpoint("tcp").statistics().get("tls"))
        return out

    def cmd_link_stats(self) -> dict:
        return {str(k): {f: v[f] for f in ("transport", "bytes_read", "bytes_written", "transfers", "failures")}
                for k, v in self.engine.statistics()["links"].items()}

    def cmd_rss(self) -> int:
        import gc

        gc.collect()
        return rss_bytes()

    def cmd_memory_stats(self) -> dict:
        mem = self.engine.statistics().get("memory", {})
        return {k: v for k, v in mem.items() if isinstance(v, (int, float, str, bool, type(None)))}

    # ------------------------------------------------------------------ memory
    @property
    def buf(self) -> np.ndarray:
        return self.bufs["main"]

    def cmd_alloc(self, nbytes: int, name: str = "main") -> dict:
        self.bufs.pop(name, None)
        buf = np.empty(nbytes, dtype=np.uint8)
        prefault(buf)
        self.bufs[name] = buf
        return {"pid": os.getpid(), "addr": int(buf.ctypes.data)}

    def cmd_fill(self, salt: int, name: str = "main") -> None:
        fill_pattern(self.bufs[name], salt)

    def cmd_zero(self, name: str = "main") -> None:
        self.bufs[name][:] = 0

    def cmd_check_blocks(self, num_tensors: int, tensor_bytes: int, block_bytes: int, dst_blocks: list,
                         src_blocks: list, salt: int, name: str = "main",
                         src_tensor_bytes: Optional[int] = None) -> dict:
        return check_blocks(self.bufs[name], num_tensors, tensor_bytes, block_bytes, dst_blocks, src_blocks, salt,
                            src_tensor_bytes=src_tensor_bytes)

    def cmd_check_contiguous(self, nbytes: int, salt: int, name: str = "main") -> bool:
        return check_contiguous(self.bufs[name], nbytes, salt)

    def cmd_register_blocks(self, model_id: int, num_tensors: int, num_blocks: int, block_bytes: int,
                            name: str = "main") -> int:
        """Register ``num_tensors`` consecutive tensors of ``num_blocks * block_bytes`` in buffer ``name``."""
        import llmdd

        tensor = num_blocks * block_bytes
        buf = self.bufs[name]
        base = int(buf.ctypes.data)
        assert num_tensors * tensor <= len(buf)
        desc = llmdd.CacheDesc(num_tensors, [num_blocks, block_bytes], llmdd.DataType.DT_UINT8)
        engine = self.engine
        cache = engine.cache_manager.register_blocks_cache(
            desc, [base + t * tensor for t in range(num_tensors)], llmdd.BlocksCacheKey(engine.cluster_id, model_id))
        self.caches[model_id] = cache
        return cache.cache_id

    def cmd_register_contiguous(self, model_id: int, nbytes: int, name: str = "main") -> int:
        import llmdd

        desc = llmdd.CacheDesc(1, [1, nbytes], llmdd.DataType.DT_UINT8)
        cache = self.engine.cache_manager.register_cache(desc, [int(self.bufs[name].ctypes.data)])
        self.caches[model_id] = cache
        return cache.cache_id

    def cmd_unregister(self, model_id: int) -> None:
        cache = self.caches.pop(model_id)
        self.engine.cache_manager.unregister_cache(cache.cache_id)

    # ------------------------------------------------------------------ llmdd workloads
    def _blocks_op(self, op: str, remote: int, model_id: int, remote_model_id: int, src: list, dst: list):
        import llmdd

        cm = self.engine.cache_manager
        cache = self.caches[model_id]
        if op == "pull":
            key = llmdd.BlocksCacheKey(remote, remote_model_id)
            return lambda: cm.pull_blocks(key, cache, src, dst)
        key = llmdd.BlocksCacheKey(remote, remote_model_id)
        return lambda: cm.push_blocks(key, cache, src, dst)

    def cmd_blocks_timed(self, op: str, remote: int, model_id: int, remote_model_id: int, src: list, dst: list,
                         nbytes: int, runs: int, warmup: int) -> dict:
        """``pull_blocks`` (``op="pull"``) or ``push_blocks`` (``"push"``), timed ``runs`` times."""
        fn = self._blocks_op(op, remote, model_id, remote_model_id, src, dst)
        waited = _until_known(fn)
        for _ in range(warmup - 1):
            fn()
        secs = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        out = bw_summary(secs, nbytes)
        out["first_call_s"] = waited
        return out

    def cmd_blocks_profile(self, op: str, remote: int, model_id: int, remote_model_id: int, src: list,
                           dst: list, runs: int, top: int = 25) -> str:
        """cProfile of ``runs`` calls of the blocks operation (this thread only), top entries by tottime."""
        fn = self._blocks_op(op, remote, model_id, remote_model_id, src, dst)
        _until_known(fn)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(runs):
            fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()

    def cmd_blocks_at(self, start_at: float, remote: int, model_id: int, remote_model_id: int, src: list,
                      dst: list, reps: int) -> dict:
        """Pull ``reps`` times starting at ``time.monotonic() == start_at`` (for concurrent decoders)."""
        fn = self._blocks_op("pull", remote, model_id, remote_model_id, src, dst)
        _until_known(fn)
        delay = start_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        began = time.monotonic()
        for _ in range(reps):
            fn()
        return {"start": began, "end": time.monotonic()}

    def cmd_latency_pull(self, remote: int, model_id: int, remote_model_id: int, num_blocks: int, n: int,
                         warmup: int, profile: bool = False, op: str = "pull", paired_port: Optional[int] = None,
                         name: str = "main", block_bytes: int = 64 * KiB) -> dict:
        """p50/p99 of ``n`` ``pull_blocks`` (``op="push"``: ``push_blocks``) calls of one block of one
        tensor (tensor 0: layer range of one layer with one tensor per layer), random block ids.

        With ``paired_port`` (a ``cmd_rr_paired_serve`` port of the remote worker, for this ``op``),
        the same number of raw request/replies (or raw pushes) of one block of buffer ``name`` (the
        cache's memory on both sides) are interleaved with the engine's calls in chunks of
        ``PAIRED_CHUNK``, each raw chunk just before an engine chunk: the anchor sees the same
        processes, the same memory and the same load as the engine.  Their figures are ``paired``;
        the engine's call is the last one, so the caller's check of the last blocks checks the engine."""
        import llmdd

        cm = self.engine.cache_manager
        cache = self.caches[model_id]
        key = llmdd.BlocksCacheKey(remote, remote_model_id)
        one = range(0, 1)
        rng = np.random.default_rng(7 if op == "pull" else 8)
        srcs = rng.integers(0, num_blocks, n + warmup).tolist()
        dsts = rng.integers(0, num_blocks, n + warmup).tolist()
        prof = cProfile.Profile() if profile else None
        move = cm.pull_blocks if op == "pull" else cm.push_blocks
        waited = _until_known(lambda: move(key, cache, [0], [0], src_layer_range=one, dst_layer_range=one,
                                           tensor_num_per_layer=1))
        raw = None
        if paired_port is not None:
            if profile:
                raise ValueError("a paired run is not profiled (the raw calls would be in the profile)")
            sock = socket.create_connection((HOST, paired_port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mv = self.bufs[name].data
            prng = np.random.default_rng(17 if op == "pull" else 18)   # the raw calls' own block ids
            psrcs = (prng.integers(0, num_blocks, n + warmup) * block_bytes).tolist()
            pdsts = (prng.integers(0, num_blocks, n + warmup) * block_bytes).tolist()
            ack = memoryview(bytearray(1))
            if op == "pull":
                def raw(j: int) -> None:
                    _rr_pull(sock, mv, psrcs[j], pdsts[j], block_bytes)
            else:
                def raw(j: int) -> None:
                    _rr_push(sock, mv, psrcs[j], pdsts[j], block_bytes, ack)
        us: list = []
        raw_us: list = []
        pc = time.perf_counter
        chunk = PAIRED_CHUNK if raw is not None else n + warmup
        try:
            for first in range(0, n + warmup, chunk):
                last = min(n + warmup, first + chunk)
                if raw is not None:
                    for j in range(first, last):
                        t0 = pc()
                        raw(j)
                        dt = pc() - t0
                        if j >= warmup:
                            raw_us.append(dt * 1e6)
                for i in range(first, last):
                    s, d = [srcs[i]], [dsts[i]]
                    if prof is not None and i == warmup:
                        prof.enable()
                    t0 = pc()
                    move(key, cache, s, d, src_layer_range=one, dst_layer_range=one, tensor_num_per_layer=1)
                    dt = pc() - t0
                    if i >= warmup:
                        us.append(dt * 1e6)
        finally:
            if raw is not None:
                sock.close()
        out = lat_summary(us)
        out["last"] = {"src": srcs[-1], "dst": dsts[-1]}
        out["first_call_s"] = waited
        if raw is not None:
            out["paired"] = lat_summary(raw_us)
            out["paired"]["chunk"] = chunk
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            out["profile"] = text.getvalue()
        return out

    def cmd_pull_cache_timed(self, remote: int, remote_cache_id: int, model_id: int, nbytes: int, runs: int,
                             warmup: int) -> dict:
        import llmdd

        cm = self.engine.cache_manager
        cache = self.caches[model_id]
        key = llmdd.CacheKeyByIdAndIndex(remote, remote_cache_id, 0)
        waited = _until_known(lambda: cm.pull_cache(key, cache, 0))
        for _ in range(warmup - 1):
            cm.pull_cache(key, cache, 0)
        secs = []
        for _ in range(runs):
            t0 = time.perf_counter()
            cm.pull_cache(key, cache, 0)
            secs.append(time.perf_counter() - t0)
        out = bw_summary(secs, nbytes)
        out["first_call_s"] = waited
        return out

    def cmd_transfer_async(self, remote: int, model_id: int, remote_model_id: int, layers: int, src: list,
                           dst: list, nbytes: int, runs: int, warmup: int) -> dict:
        """``transfer_cache_async`` of every layer to ``remote``; a releaser thread releases the layers one by
        one (layer i+1 once the engine has asked for it after layer i), the caller waits on the task."""
        import llmdd

        cm = self.engine.cache_manager
        cache = self.caches[model_id]

        class Releaser(llmdd.LayerSynchronizer):
            def __init__(self) -> None:
                self.events = [threading.Event() for _ in range(layers)]
                self.asked = [0.0] * layers

            def synchronize_layer(self, layer_index: int, timeout_in_millis) -> bool:
                self.asked[layer_index] = time.perf_counter()
                return self.events[layer_index].wait(60)

        def one() -> tuple[float, list]:
            sync = Releaser()
            config = llmdd.TransferWithCacheKeyConfig(llmdd.BlocksCacheKey(remote, remote_model_id),
                                                      range(0, layers), range(0, layers))

            def release() -> None:
                for ev in sync.events:
                    ev.set()
                    time.sleep(0)

            t0 = time.perf_counter()
            task = cm.transfer_cache_async(cache, sync, [config], src_block_indices=src, dst_block_indices=dst)
            rel = threading.Thread(target=release)
            rel.start()
            status = task.synchronize()
            dt = time.perf_counter() - t0
            rel.join()
            bad = [r for r in task.get_results() if r is not None and r != llmdd.LLMStatusCode.LLM_SUCCESS]
            if status != llmdd.LLMStatusCode.LLM_SUCCESS or bad:
                raise RuntimeError(f"transfer_cache_async: {status}, results {[str(r) for r in bad]}")
            gaps = [(sync.asked[i + 1] - sync.asked[i]) * 1e6 for i in range(layers - 1) if sync.asked[i + 1]]
            return dt, gaps

        waited = _until_known(one)
        for _ in range(warmup - 1):
            one()
        secs, gaps = [], []
        for _ in range(runs):
            dt, g = one()
            secs.append(dt)
            gaps.extend(g)
        out = bw_summary(secs, nbytes)
        out["layers"] = layers
        out["first_call_s"] = waited
        if gaps:
            out["per_layer_us_p50"] = float(np.median(gaps))
        return out

    # ------------------------------------------------------------------ loop
    def serve(self, conn) -> None:
        conn.send(("ok", {"pid": os.getpid()}))
        while True:
            try:
                command, kwargs = conn.recv()
            except (EOFError, OSError):
                break
            if command == "exit":
                try:
                    if self.dd is not None:
                        self.engine.finalize()#KEEP
                finally:
                    conn.send(("ok", None))
                break
            try:
                reply = ("ok", getattr(self, "cmd_" + command)(**kwargs))
            except Exception as exc:  # reported to the parent, which fails the step
                reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            conn.send(reply)


from llmdd._tools.bench import small as _small  # noqa: E402 - the small-transfer rows (issue 21) as Worker commands

_small.install(Worker)


def worker_main(conn) -> None:
    Worker().serve(conn)


__all__ = ["Worker", "worker_main", "KiB"]
