"""The two roles of the demo, each the main function of a spawned child process.

A role owns one engine (``LLMDataDist``), one demo model and one paged KV cache
registered as a single blocks cache of ``2 * n_layers`` tensors (layer-major K0, V0,
K1, V1, ...), exactly as vllm-ascend registers its paged KV.  The parent drives a
role through a ``multiprocessing`` pipe: it sends ``(command, args)`` and gets back
``("ok", payload)`` or ``("error", payload)``.  A role never prints; what it has to
say travels back in the payloads (timings, statistics, the lifecycle events its hook
subscriber saw).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import Any, Optional

import llmdd
from llmdd.plugin import hookimpl

__all__ = ["prompt_main", "decoder_main", "EventRecorder", "DEFAULT_SYNC_KV_TIMEOUT_MS"]

DEFAULT_SYNC_KV_TIMEOUT_MS = 10000


class EventRecorder:
    """A hook subscriber: records every link, task and cache transition of its engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[dict] = []

    @hookimpl
    def llmdd_link_transition(self, event) -> None:
        self._add(event)

    @hookimpl
    def llmdd_task_transition(self, event) -> None:
        self._add(event)

    @hookimpl
    def llmdd_cache_transition(self, event) -> None:
        self._add(event)

    def _add(self, event) -> None:
        info = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                for k, v in event.info.items()}
        record = {"machine": event.machine.value, "id": str(event.id), "source": event.source.value,
                  "dest": event.dest.value, "trigger": event.trigger, "at": event.at, "info": info,
                  "error": None if event.error is None else f"{type(event.error).__name__}: {event.error}"}
        with self._lock:
            self.events.append(record)

    def take(self) -> list[dict]:
        with self._lock:
            return list(self.events)


class _Role:
    """What both roles share: model, cache, engine, hook subscriber, the command loop."""

    role_name = ""

    def __init__(self, conn, spec: dict) -> None:
        from llmdd._tools.demo.model import Model, ModelConfig, PagedKVCache

        self.llmdd = llmdd
        self.conn = conn
        self.spec = spec
        self.config = ModelConfig(**spec["model"])
        self.model = Model(self.config)
        self.kv = PagedKVCache(self.config, spec["num_blocks"])
        self.cluster_id = spec["cluster_id"]
        self.recorder = EventRecorder()
        self.dd = self._make_engine()
        self.cache = self._register()

    def _make_engine(self):
        llmdd = self.llmdd
        cfg = llmdd.LLMConfig()
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        cfg.sync_kv_timeout = int(self.spec.get("sync_kv_timeout_ms", DEFAULT_SYNC_KV_TIMEOUT_MS))
        if self.spec.get("listen"):
            cfg.listen_ip_info = self.spec["listen"]
        options = cfg.generate_options()
        if self.spec.get("transport") not in (None, "auto"):
            options["llmdd.transport"] = self.spec["transport"]
        for key, value in self.spec.get("engine_options", {}).items():
            options[key] = value
        role = llmdd.LLMRole.PROMPT if self.role_name == "prompt" else llmdd.LLMRole.DECODER
        dd = llmdd.LLMDataDist(role, self.cluster_id)
        dd.init(options)
        # the plugin manager exists once init has run; later transitions reach the subscriber
        dd._pm.register(self.recorder, name="llmdd-demo-recorder")
        return dd

    def _register(self):
        llmdd = self.llmdd
        desc = llmdd.CacheDesc(self.kv.num_tensors, list(self.kv.shape), llmdd.DataType.DT_FLOAT)
        return self.dd.cache_manager.register_blocks_cache(desc, self.kv.addrs,
                                                           llmdd.BlocksCacheKey(self.cluster_id, 0))

    # -- the loop ------------------------------------------------------------------------
    def ready_payload(self) -> dict:
        return {"pid": os.getpid(), "cluster_id": self.cluster_id, "num_blocks": self.kv.num_blocks,
                "kv_bytes": self.kv.num_tensors * self.kv.tensor_bytes}

    def serve(self) -> None:
        self.conn.send(("ok", self.ready_payload()))
        while True:
            try:
                command, args = self.conn.recv()
            except (EOFError, OSError):   # the parent is gone: leave as on "exit"
                self._finalize()
                break
            if command == "exit":
                self._finalize()
                self.conn.send(("bye", {}))
                break
            handler = getattr(self, "cmd_" + command, None)
            try:
                if handler is None:
                    raise ValueError(f"unknown command {command!r}")
                reply = ("ok", handler(**args))
            except Exception as exc:  # reported to the parent, which decides
                reply = ("error", _describe(exc))
            self.conn.send(reply)

    def _finalize(self) -> None:
        try:
            self.dd.finalize()
        except Exception:  # the process is leaving either way
            pass

    def cmd_stats(self) -> dict:
        stats = self.dd.statistics()
        return {"links": stats["links"], "events": self.recorder.take(), "pid": os.getpid()}


def _describe(exc: BaseException) -> dict:
    code = getattr(exc, "status_code", None)
    return {"type": type(exc).__name__, "message": str(exc),
            "status_code": getattr(code, "name", None if code is None else str(code)),
            "traceback": traceback.format_exc()}


def _link_bytes(stats: dict, peer: Optional[int], field: str) -> int:
    link = stats["links"].get(peer)
    return 0 if link is None else int(link[field])


class _Releaser:
    """Layer events set by the prefill loop; a per-task synchronizer waits on them."""

    def __init__(self, layers: int) -> None:
        self.events = [threading.Event() for _ in range(layers)]
        self.released_at = [0.0] * layers
        self.failed = False

    def release(self, layer: int) -> None:
        self.released_at[layer] = time.monotonic()
        self.events[layer].set()

    def abort(self) -> None:
        """The prefill failed: every waiting synchronizer returns False (the task then fails)."""
        self.failed = True
        for event in self.events:
            event.set()


def _make_synchronizer(llmdd, releaser: _Releaser, timeout_s: float):
    class PrefillSynchronizer(llmdd.LayerSynchronizer):
        """Releases layer i once the prefill has written layer i's K and V; records when each
        layer's push started and when the next request came (the push of the previous layer is
        then done: the engine transfers layer i before it asks for layer i+1)."""

        def __init__(self) -> None:
            self.asked_at: dict[int, float] = {}
            self.started_at: dict[int, float] = {}

        def synchronize_layer(self, layer_index: int, timeout_in_millis) -> bool:
            self.asked_at[layer_index] = time.monotonic()
            ok = releaser.events[layer_index].wait(timeout_s) and not releaser.failed
            self.started_at[layer_index] = time.monotonic()
            return ok

    return PrefillSynchronizer()


class PromptRole(_Role):
    role_name = "prompt"

    def ready_payload(self) -> dict:
        out = super().ready_payload()
        out["listen"] = tuple(self.dd.statistics()["listen"])
        return out

    def cmd_prefill(self, prompt: list, table: list, push: list | None = None) -> dict:
        """Prefill ``prompt`` into the blocks ``table``; with ``push`` = [(decoder cluster, dst blocks)],
        push every layer to every decoder with ``transfer_cache_async`` while later layers compute."""
        llmdd = self.llmdd
        layers = self.config.n_layers
        releaser = _Releaser(layers)
        tasks = []
        src_blocks = [int(b) for b in table[:self.config.blocks_for(len(prompt))]]
        before = self.dd.statistics()
        if push:
            timeout_s = self.spec.get("sync_kv_timeout_ms", DEFAULT_SYNC_KV_TIMEOUT_MS) / 1000.0
            for decoder_cluster, dst_blocks in push:
                sync = _make_synchronizer(llmdd, releaser, timeout_s + 30.0)
                config = llmdd.TransferWithCacheKeyConfig(llmdd.BlocksCacheKey(int(decoder_cluster), 0),
                                                          range(0, layers), range(0, layers))
                task = self.dd.cache_manager.transfer_cache_async(
                    self.cache, sync, [config], src_block_indices=src_blocks,
                    dst_block_indices=[int(b) for b in dst_blocks])
                tasks.append((int(decoder_cluster), task, sync))
        start = time.monotonic()
        try:
            self.model.prefill(prompt, self.kv, table, on_layer=releaser.release)
        except BaseException:
            releaser.abort()
            for _, task, _ in tasks:
                task.synchronize()
            raise
        end = time.monotonic()
        out: dict[str, Any] = {"src_blocks": src_blocks, "prefill_start": start, "prefill_end": end,
                               "prefill_s": end - start, "layer_released_at": releaser.released_at, "push": []}
        for decoder_cluster, task, sync in tasks:
            status = task.synchronize()
            done_at = time.monotonic()
            results = task.get_results()
            stats = self.dd.statistics()
            moved = (_link_bytes(stats, decoder_cluster, "bytes_written")
                     - _link_bytes(before, decoder_cluster, "bytes_written"))
            # layer i was being pushed from its release until the engine asked for layer i+1
            busy = 0.0
            for layer in range(layers):
                begun = sync.started_at.get(layer)
                if begun is None:
                    continue
                ended = sync.asked_at.get(layer + 1, done_at)
                busy += max(0.0, ended - begun)
            out["push"].append({"decoder": decoder_cluster, "status": status.name,
                                "results": [None if r is None else r.name for r in results],
                                "done_at": done_at, "bytes": moved, "busy_s": busy,
                                "first_start": sync.started_at.get(0)})
        return out


class DecoderRole(_Role):
    role_name = "decoder"

    def __init__(self, conn, spec: dict) -> None:
        super().__init__(conn, spec)
        self.table = [int(b) for b in spec["table"]]
        self.prompt_cluster: int | None = None

    def _cluster_info(self, prompt_cluster: int, ip: str | None = None, port: int | None = None):
        info = self.llmdd.LLMClusterInfo()
        info.remote_cluster_id = prompt_cluster
        if ip is not None:
            info.append_local_ip_info("127.0.0.1", 0)
            info.append_remote_ip_info(ip, port)
        return info

    def cmd_link(self, ip: str, port: int, prompt_cluster: int, timeout_ms: int = 5000) -> dict:
        start = time.monotonic()
        status, per_cluster = self.dd.link_clusters([self._cluster_info(prompt_cluster, ip, port)], timeout_ms)
        self.prompt_cluster = prompt_cluster
        return {"status": status.name, "per_cluster": [s.name for s in per_cluster],
                "link_s": time.monotonic() - start}

    def cmd_unlink(self, prompt_cluster: int, force: bool = True) -> dict:
        status, per_cluster = self.dd.unlink_clusters([self._cluster_info(prompt_cluster)], 3000, force=force)
        return {"status": status.name, "per_cluster": [s.name for s in per_cluster]}

    def cmd_pull(self, src_blocks: list, prompt_len: int, split_layer: int | None = None) -> dict:
        """``pull_blocks`` of the prompt's blocks into this decoder's own block table.

        With ``split_layer`` the pull goes in two layer ranges, and between them the
        decoder reports ``half`` and waits for the parent's go (a fault lands there).
        """
        llmdd = self.llmdd
        key = llmdd.BlocksCacheKey(self.prompt_cluster, 0)
        src = [int(b) for b in src_blocks]
        dst = self.table[:len(src)]
        before = self.dd.statistics()
        start = time.monotonic()
        if split_layer is None:
            self.dd.cache_manager.pull_blocks(key, self.cache, src, dst)
        else:
            layers = self.config.n_layers
            self.dd.cache_manager.pull_blocks(key, self.cache, src, dst, src_layer_range=range(0, split_layer),
                                              dst_layer_range=range(0, split_layer))
            self.conn.send(("half", {"layers_pulled": split_layer, "at": time.monotonic()}))
            command, _ = self.conn.recv()
            if command != "continue":
                raise RuntimeError(f"expected 'continue', got {command!r}")
            start_rest = time.monotonic()
            try:
                self.dd.cache_manager.pull_blocks(key, self.cache, src, dst,
                                                  src_layer_range=range(split_layer, layers),
                                                  dst_layer_range=range(split_layer, layers))
            except llmdd.LLMException as exc:
                return {"failed": True, "error": _describe(exc), "after_s": time.monotonic() - start_rest,
                        "link": self.dd.statistics()["links"].get(self.prompt_cluster)}
        end = time.monotonic()
        moved = (_link_bytes(self.dd.statistics(), self.prompt_cluster, "bytes_read")
                 - _link_bytes(before, self.prompt_cluster, "bytes_read"))
        return {"failed": False, "transfer_s": end - start, "end": end, "bytes": moved, "dst_blocks": dst}

    def cmd_decode(self, prompt: list, n_tokens: int, reference: dict, corrupt: dict | None = None) -> dict:
        """Check the prompt's KV in this decoder's blocks against the reference, then decode greedily."""
        from llmdd._tools.demo._corrupt import flip_byte
        from llmdd._tools.demo._verify import compare_kv

        prompt_len = len(prompt)
        corrupted = None
        if corrupt:
            corrupted = flip_byte(self.kv, self.table, prompt_len, **corrupt)
        kv_check = compare_kv(self.kv, self.table, prompt_len, reference)
        marks: list[float] = []
        start = time.monotonic()
        tokens = self.model.generate(prompt, self.kv, self.table, n_tokens,
                                     on_token=lambda step, token: marks.append(time.monotonic()))
        return {"tokens": tokens, "kv_check": kv_check, "corrupted": corrupted, "decode_start": start,
                "first_token_at": marks[0] if marks else start, "first_step_s": (marks[0] - start) if marks else 0.0,
                "decode_s": (marks[-1] - start) if marks else 0.0}


def prompt_main(conn, spec: dict) -> None:
    _main(PromptRole, conn, spec)


def decoder_main(conn, spec: dict) -> None:
    _main(DecoderRole, conn, spec)


def _main(cls, conn, spec: dict) -> None:
    # Ctrl-C at a terminal reaches the whole process group: the parent alone answers it (it stops this
    # process with "exit", which finalizes the engine), so a role process never prints a traceback of its own.
    # The parent started this process with SIGINT blocked (_Child): one sent before this line is dropped here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        role = cls(conn, spec)
    except Exception as exc:
        conn.send(("error", _describe(exc)))
        return
    role.serve()
