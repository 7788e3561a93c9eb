"""One ``llmdd bench`` run: the anchors, then every workload on every available transport.

Processes: every role is a spawned worker (:mod:`.worker`); the many short-lived link
clients of the link-scaling step come from a ``forkserver`` context (a fork of a clean
server process that has only imported the worker module), which keeps 64 engines within
seconds on two cores.  Every child is joined, or killed when it does not leave in time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from llmdd._tools.bench.common import GiB, KiB, MiB, Progress, load_average, rss_bytes
from llmdd._tools.bench.worker import worker_main
from llmdd._tools.bench.small import rows as small_rows
from llmdd._tools.bench.tls import VARIANTS, TlsFiles

PROMPT = 1
DECODER = 2
SALT_PROMPT = 1 << 56
SALT_DECODER = 2 << 56
SALT_ANCHOR = 3 << 56
NUM_TENSORS = 64  # 32 layers x (K, V)
LAYERS = 32


class BenchError(RuntimeError):
    """A step failed: a worker raised, died or did not answer in time."""


@dataclass
class Sizes:
    kv_bytes: int = GiB  # per KV workload: 64 tensors x (kv_bytes / 64)
    block_sizes: tuple = (64 * KiB, 16 * KiB)
    contiguous_bytes: int = GiB
    runs: int = 5
    warmup: int = 1
    latency_n: int = 1000
    latency_warmup: int = 100
    decoders: tuple = (1, 2, 4, 8)
    decoder_blocks: int = 64  # 64 KiB blocks per tensor that each concurrent decoder pulls
    decoder_reps: int = 3
    links: tuple = (1, 2, 4, 8, 16, 32, 64)
    stream_bytes: int = GiB
    concurrent_links: bool = False  # link the clients between two measuring points at once (--quick)
    scaling_links: tuple = (1, 64, 1000)  # synthetic-client link scaling of one server (.scaling); () skips

    @classmethod
    def quick(cls) -> "Sizes":
        return cls(kv_bytes=128 * MiB, contiguous_bytes=128 * MiB, runs=3, warmup=1, latency_n=200,
                   latency_warmup=20, decoders=(1, 2), decoder_blocks=16, decoder_reps=2, links=(1, 2, 4, 8),
                   stream_bytes=128 * MiB, concurrent_links=True, scaling_links=())


@dataclass
class Options:
    sizes: Sizes
    transports: Optional[list] = None  # None: every available one
    profile: bool = False
    seed: int = 0
    step_timeout: float = 300.0
    skip: set = field(default_factory=set)
    options: dict = field(default_factory=dict)   # engine options for every engine of the run (--option)


# ---------------------------------------------------------------------- workers
class Peer:
    """A worker process and its pipe."""

    def __init__(self, ctx, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child,), name=f"llmdd-bench-{name}", daemon=True)
        self.proc.start()
        child.close()
        self.pid: Optional[int] = None

    def wait_ready(self, timeout: float = 120.0) -> "Peer":
        self.pid = self.recv(timeout)["pid"]
        return self

    def send(self, command: str, **kwargs: Any) -> None:
        self.conn.send((command, kwargs))

    def recv(self, timeout: Optional[float] = None) -> Any:
        limit = self.timeout if timeout is None else timeout
        if not self.conn.poll(limit):
            raise BenchError(f"{self.name}: no answer within {limit:.0f} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise BenchError(f"{self.name}: worker died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise BenchError(f"{self.name}: {payload}")
        return payload

    def call(self, command: str, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.recv(timeout)


def start_peers(ctx, names: list, timeout: float) -> list:
    peers = [Peer(ctx, n, timeout) for n in names]
    try:
        for p in peers:
            p.wait_ready()
    except BaseException:
        close_all(peers)
        raise
    return peers


def close_all(peers: list, timeout: float = 30.0) -> None:
    """Ask every peer to finalize and leave (all at once), then join them; kill those that stay."""
    for p in peers:
        if p.proc.is_alive():
            try:
                p.send("exit")
            except (OSError, BrokenPipeError):
                pass
    deadline = time.monotonic() + timeout
    for p in peers:
        try:
            if p.proc.is_alive() and p.conn.poll(max(0.0, deadline - time.monotonic())):
                p.conn.recv()
        except (OSError, EOFError):
            pass
        p.proc.join(max(0.1, deadline - time.monotonic()))
        if p.proc.is_alive():
            p.proc.kill()
            p.proc.join(5)
        p.conn.close()


def broadcast(peers: list, command: str, per_peer: Callable[[int], dict]) -> list:
    """Send ``command`` to every peer (kwargs from ``per_peer(i)``), then collect every reply."""
    for i, p in enumerate(peers):
        p.send(command, **per_peer(i))
    return [p.recv() for p in peers]


# ---------------------------------------------------------------------- tables
def block_tables(num_blocks: int, seed: int) -> tuple[list, list]:
    """Independent random permutations for the source and destination block ids."""
    rng = np.random.default_rng(seed)
    return rng.permutation(num_blocks).tolist(), rng.permutation(num_blocks).tolist()


def available_transports() -> list:
    """Transports that ``llmdd.plugin``'s registry reports available here, most preferred first."""
    from llmdd._extension.manager import Hooks, make_plugin_manager

    registry = Hooks(make_plugin_manager()).register_transports()
    return [info.name for info in registry.available()]


def variants(available: list) -> list:
    """The rows measured on request only (``VARIANTS``) whose transport is available here."""
    return [v for v, base in VARIANTS.items() if base in available]


def machine_facts() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    import llmdd

    versions = {"llmdd": getattr(llmdd, "__version__", "?"), "numpy": np.__version__,
                "python": platform.python_version()}
    return {"nproc": os.cpu_count(), "cpu_model": model, "kernel": platform.release(), "mem_bytes": mem,
            "versions": versions}


# ---------------------------------------------------------------------- the run
class Run:
    def __init__(self, opts: Options, progress: Progress) -> None:
        self.o = opts
        self.s = opts.sizes
        self.p = progress
        self.spawn = mp.get_context("spawn")
        self.results: dict = {"anchors": {}, "transports": {}, "errors": []}
        self._tls: Optional[TlsFiles] = None

    def _engine(self, t: str) -> dict:
        """A worker's ``init`` arguments for row ``t``: a variant names its base transport and settings."""
        if t not in VARIANTS:
            return {"transport": t, "options": dict(self.o.options)}
        if self._tls is None:
            try:
                self._tls = TlsFiles()
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                raise BenchError(f"{t}: {exc}") from None
        return {"transport": VARIANTS[t], "options": {**self._tls.options, **self.o.options}}

    # steps are counted up front for the progress bar
    @staticmethod
    def count_steps(opts: Options, transports: list) -> int:
        s = opts.sizes
        # start, memcpy, gather x2, cma contig, cma x2, cma 2-thread x2, cma lat, tcp x2, rr
        anchors = 1 + 1 + 2 + 1 + 2 + 2 + 1 + 2 + 1 if "anchors" not in opts.skip else 0
        per_t = 2 + 2 * len(s.block_sizes) + 3 + len(s.decoders) + 2 + len(s.links)
        if opts.profile:
            per_t += len(s.block_sizes) + 1
        return anchors + per_t * len(transports) + len(late_phases(opts))

    def _tables(self, block_bytes: int) -> tuple[int, list, list]:
        nb = self.s.kv_bytes // NUM_TENSORS // block_bytes
        src, dst = block_tables(nb, self.o.seed + block_bytes)
        return nb, src, dst

    # -------------------------------------------------------------- anchors
    def anchors(self) -> None:
        s = self.s
        out = self.results["anchors"]
        size = max(s.kv_bytes, s.contiguous_bytes, s.stream_bytes)
        a, b = start_peers(self.spawn, ["anchor-src", "anchor-dst"], self.o.step_timeout)
        try:
            info = a.call("alloc", nbytes=size)
            a.call("fill", salt=SALT_ANCHOR)
            b.call("alloc", nbytes=size)
            self.p.step("anchors: workers ready")
            out["memcpy"] = a.call("memcpy", nbytes=s.contiguous_bytes, runs=s.runs, warmup=s.warmup)
            self.p.step(f"anchor memcpy np.copyto {s.contiguous_bytes / GiB:g} GiB: {out['memcpy']['median']:.2f} GB/s")
            for bb in s.block_sizes:
                nb, src, dst = self._tables(bb)
                k = f"gather_{bb // KiB}k"
                out[k] = a.call("gather", num_tensors=NUM_TENSORS, num_blocks=nb, block_bytes=bb, src=src, dst=dst,
                                salt=SALT_ANCHOR, runs=s.runs, warmup=s.warmup)
                self.p.step(f"anchor gather {NUM_TENSORS}x{nb}x{bb // KiB}KiB np.take: {out[k]['median']:.2f} GB/s")
            out["cma_contiguous"] = b.call("cma", pid=info["pid"], raddr=info["addr"], num_tensors=1, num_blocks=1,
                                           block_bytes=s.contiguous_bytes, src=[0], dst=[0], salt=SALT_ANCHOR,
                                           runs=s.runs, warmup=s.warmup)
            self.p.step(f"anchor process_vm_readv contiguous: {out['cma_contiguous']['median']:.2f} GB/s")
            # one thread, then both cores (what a cross-process copy can reach here)
            for threads, prefix, how in ((1, "cma", ""), (2, "cma2", ", 2 threads")):
                for bb in s.block_sizes:
                    nb, src, dst = self._tables(bb)
                    k = f"{prefix}_{bb // KiB}k"
                    out[k] = b.call("cma", pid=info["pid"], raddr=info["addr"], num_tensors=NUM_TENSORS,
                                    num_blocks=nb, block_bytes=bb, src=src, dst=dst, salt=SALT_ANCHOR, runs=s.runs,
                                    warmup=s.warmup, threads=threads)
                    self.p.step(f"anchor process_vm_readv {bb // KiB} KiB blocks{how}: {out[k]['median']:.2f} GB/s")
            nb64 = s.kv_bytes // (64 * KiB)
            out["cma_latency_64k"] = b.call("cma_latency", pid=info["pid"], raddr=info["addr"], num_blocks=nb64,
                                            block_bytes=64 * KiB, n=s.latency_n, warmup=s.latency_warmup)
            self.p.step(f"anchor process_vm_readv one 64 KiB block: p50 {out['cma_latency_64k']['p50']:.1f} us")
            for streams in (1, 2):
                port = b.call("listen")
                b.send("stream_recv", streams=streams, nbytes=s.stream_bytes, rounds=s.runs + s.warmup,
                       salt=SALT_ANCHOR)
                res = a.call("stream_send", port=port, streams=streams, nbytes=s.stream_bytes, runs=s.runs,
                             warmup=s.warmup)
                res.update(b.recv())
                out[f"tcp_{streams}stream"] = res
                self.p.step(f"anchor raw tcp socket, {streams} stream(s): {res['median']:.2f} GB/s")
            port = a.call("listen")
            a.send("rr_serve", n=s.latency_n + s.latency_warmup)
            out["tcp_rr_64k"] = b.call("rr_client", port=port, block_bytes=64 * KiB, num_blocks=nb64, n=s.latency_n,
                                       warmup=s.latency_warmup)
            a.recv()
            self.p.step(f"anchor raw tcp request/reply 64 KiB: p50 {out['tcp_rr_64k']['p50']:.1f} us")
            b.call("fill", salt=SALT_DECODER)   # the pusher's blocks: a pattern of their own, checked on the other side
            port = a.call("listen")
            a.send("rr_push_serve", n=s.latency_n + s.latency_warmup)
            r = b.call("rr_push_client", port=port, block_bytes=64 * KiB, num_blocks=nb64, n=s.latency_n,
                       warmup=s.latency_warmup)
            a.recv()
            last = r.pop("last")
            r.update(a.call("check_blocks", num_tensors=1, tensor_bytes=nb64 * 64 * KiB, block_bytes=64 * KiB,
                            dst_blocks=[last["dst"]], src_blocks=[last["src"]], salt=SALT_DECODER))
            out["tcp_rr_push_64k"] = r
            self.p.step(f"anchor raw tcp push 64 KiB (block, 1-byte answer): p50 {r['p50']:.1f} us")
        finally:
            close_all([a, b])

    # -------------------------------------------------------------- one transport
    def transport(self, t: str) -> None:
        """Every workload on transport ``t``.

        Every cache is registered before the link: a cache registered after it reaches the peer
        later, in a table update on the control channel (see ``_until_known`` in worker.py), so no
        timing waits for one.  The workloads share one buffer per side
        with a buffer per cache (the engine refuses overlapping registrations): the 64 KiB layout,
        the 16 KiB layout and one contiguous tensor."""
        s = self.s
        res: dict = {}
        self.results["transports"][t] = res
        prompt, d1 = start_peers(self.spawn, [f"{t}-prompt", f"{t}-decoder-1"], self.o.step_timeout)
        extra: list = []
        try:
            pinfo = prompt.call("init", role="PROMPT", cluster_id=PROMPT, listen=True, **self._engine(t))
            d1.call("init", role="DECODER", cluster_id=DECODER, **self._engine(t))
            layouts = {}
            for mid, bb in enumerate(s.block_sizes, start=10):
                nb = s.kv_bytes // NUM_TENSORS // bb
                name = f"b{bb // KiB}k"
                layouts[bb] = (mid, nb, name)
                broadcast([prompt, d1], "alloc", lambda i: {"nbytes": s.kv_bytes, "name": name})
                prompt.call("fill", salt=SALT_PROMPT, name=name)
                broadcast([prompt, d1], "register_blocks", lambda i: {
                    "model_id": mid, "num_tensors": NUM_TENSORS, "num_blocks": nb, "block_bytes": bb, "name": name})
            broadcast([prompt, d1], "alloc", lambda i: {"nbytes": s.contiguous_bytes, "name": "contig"})
            prompt.call("fill", salt=SALT_PROMPT, name="contig")
            pcid = prompt.call("register_contiguous", model_id=30, nbytes=s.contiguous_bytes, name="contig")
            d1.call("register_contiguous", model_id=30, nbytes=s.contiguous_bytes, name="contig")
            total = len(s.block_sizes) * s.kv_bytes + s.contiguous_bytes
            self.p.step(f"{t}: {total / MiB:g} MiB allocated, filled and registered on each side")
            link = d1.call("link", remote=PROMPT, port=pinfo["port"])
            if link["status"] != "LLM_SUCCESS":
                raise BenchError(f"{t}: link failed: {link}")
            res["link"] = link
            if t == "tcp+tls" and not link.get("data_tls"):
                raise BenchError(f"{t}: the link's data connections are not TLS: {link}")
            self.p.step(f"{t}: prompt and decoder linked ({link['transport']}, {link['link_s'] * 1e3:.1f} ms)")
            for bb in s.block_sizes:
                mid, nb, name = layouts[bb]
                _, src, dst = self._tables(bb)
                tensor = nb * bb
                label = f"{NUM_TENSORS}x{nb}x{bb // KiB}KiB"
                d1.call("zero", name=name)
                r = d1.call("blocks_timed", op="pull", remote=PROMPT, model_id=mid, remote_model_id=mid, src=src,
                            dst=dst, nbytes=s.kv_bytes, runs=s.runs, warmup=s.warmup)
                r.update(d1.call("check_blocks", num_tensors=NUM_TENSORS, tensor_bytes=tensor, block_bytes=bb,
                                 dst_blocks=dst, src_blocks=src, salt=SALT_PROMPT, name=name))
                res[f"pull_blocks_{bb // KiB}k"] = r
                self.p.step(f"{t}: pull_blocks {label}: {r['median']:.2f} GB/s, verified={r['verified']}")
                if self.o.profile:
                    res[f"profile_pull_blocks_{bb // KiB}k"] = d1.call(
                        "blocks_profile", op="pull", remote=PROMPT, model_id=mid, remote_model_id=mid, src=src,
                        dst=dst, runs=max(2, s.runs))
                    self.p.step(f"{t}: cProfile of pull_blocks {label}")
                d1.call("fill", salt=SALT_DECODER, name=name)
                prompt.call("zero", name=name)
                r = d1.call("blocks_timed", op="push", remote=PROMPT, model_id=mid, remote_model_id=mid, src=src,
                            dst=dst, nbytes=s.kv_bytes, runs=s.runs, warmup=s.warmup)
                r.update(prompt.call("check_blocks", num_tensors=NUM_TENSORS, tensor_bytes=tensor, block_bytes=bb,
                                     dst_blocks=dst, src_blocks=src, salt=SALT_DECODER, name=name))
                res[f"push_blocks_{bb // KiB}k"] = r
                self.p.step(f"{t}: push_blocks {label}: {r['median']:.2f} GB/s, verified={r['verified']}")
                prompt.call("fill", salt=SALT_PROMPT, name=name)

            # transfer_cache_async, 64 KiB layout, prompt -> decoder, layers released one by one
            bb = 64 * KiB
            mid, nb, name = layouts[bb]
            _, src, dst = self._tables(bb)
            d1.call("zero", name=name)
            r = prompt.call("transfer_async", remote=DECODER, model_id=mid, remote_model_id=mid, layers=LAYERS,
                            src=src, dst=dst, nbytes=s.kv_bytes, runs=s.runs, warmup=s.warmup)
            r.update(d1.call("check_blocks", num_tensors=NUM_TENSORS, tensor_bytes=nb * bb, block_bytes=bb,
                             dst_blocks=dst, src_blocks=src, salt=SALT_PROMPT, name=name))
            res["transfer_cache_async_64k"] = r
            self.p.step(f"{t}: transfer_cache_async {LAYERS} layers: {r['median']:.2f} GB/s, verified={r['verified']}")

            # pull_cache of one contiguous cache
            d1.call("zero", name="contig")
            r = d1.call("pull_cache_timed", remote=PROMPT, remote_cache_id=pcid, model_id=30,
                        nbytes=s.contiguous_bytes, runs=s.runs, warmup=s.warmup)
            r["verified"] = d1.call("check_contiguous", nbytes=s.contiguous_bytes, salt=SALT_PROMPT, name="contig")
            res["pull_cache"] = r
            self.p.step(f"{t}: pull_cache {s.contiguous_bytes / MiB:g} MiB: {r['median']:.2f} GB/s, "
                        f"verified={r['verified']}")

            # one block of one tensor (tensor 0 of the 64 KiB layout); over tcp, raw request/replies
            # between the same two processes and on the same memory are interleaved with the calls
            # (the paired anchor: the same load as the engine's calls, not the run's start)
            paired = prompt.call("rr_paired_serve", name=name) if t == "tcp" else {}
            r = d1.call("latency_pull", remote=PROMPT, model_id=mid, remote_model_id=mid, num_blocks=nb,
                        n=s.latency_n, warmup=s.latency_warmup, paired_port=paired.get("pull"), name=name,
                        block_bytes=bb)
            last = r.pop("last")
            r.update(d1.call("check_blocks", num_tensors=1, tensor_bytes=nb * bb, block_bytes=bb,
                             dst_blocks=[last["dst"]], src_blocks=[last["src"]], salt=SALT_PROMPT, name=name))
            res["latency_64k"] = r
            self.p.step(f"{t}: one 64 KiB block: p50 {r['p50']:.1f} us, p99 {r['p99']:.1f} us"
                        + (f"; paired raw request/reply p50 {r['paired']['p50']:.1f} us" if "paired" in r else ""))
            # one block of one tensor pushed (decoder -> prompt), checked on the prompt; the prompt's
            # bytes are its own pattern again afterwards (the decoders below pull them)
            d1.call("fill", salt=SALT_DECODER, name=name)
            r = d1.call("latency_pull", op="push", remote=PROMPT, model_id=mid, remote_model_id=mid, num_blocks=nb,
                        n=s.latency_n, warmup=s.latency_warmup, paired_port=paired.get("push"), name=name,
                        block_bytes=bb)
            last = r.pop("last")
            r.update(prompt.call("check_blocks", num_tensors=1, tensor_bytes=nb * bb, block_bytes=bb,
                                 dst_blocks=[last["dst"]], src_blocks=[last["src"]], salt=SALT_DECODER, name=name))
            res["latency_push_64k"] = r
            prompt.call("fill", salt=SALT_PROMPT, name=name)
            self.p.step(f"{t}: one 64 KiB block pushed: p50 {r['p50']:.1f} us, p99 {r['p99']:.1f} us"
                        + (f"; paired raw push p50 {r['paired']['p50']:.1f} us" if "paired" in r else ""))
            if self.o.profile:
                prof = d1.call("latency_pull", remote=PROMPT, model_id=mid, remote_model_id=mid, num_blocks=nb,
                               n=s.latency_n, warmup=s.latency_warmup, profile=True)
                res["profile_latency_64k"] = prof["profile"]
                self.p.step(f"{t}: cProfile of the one-block pull")
            if t == "shm":  # issue 21: push of one block, 8 blocks x 2 tensors, against bare process_vm_*v
                res["small"] = small_rows(prompt, d1, layouts, s.latency_n, s.latency_warmup, salt_prompt=SALT_PROMPT,
                                          salt_decoder=SALT_DECODER, prompt_id=PROMPT, step=self.p.step)

            # N decoders pulling from one prompt
            res["decoders"] = self._decoders(t, pinfo["port"], d1, layouts[bb], extra)
            close_all(extra)
            extra = []
            res["link_stats_prompt"] = prompt.call("link_stats")
        finally:
            close_all(extra + [d1, prompt])
        res["links"] = self._links(t)

    def _decoders(self, t: str, port: int, d1: Peer, layout: tuple, extra: list) -> dict:
        """N decoders pull at once from the prompt's 64 KiB cache (decoder 1 into its own 64 KiB cache,
        the others into caches of ``decoder_blocks`` blocks per tensor)."""
        s = self.s
        bb = 64 * KiB
        mid, nb, name = layout
        nbd = min(s.decoder_blocks, nb)
        per_bytes = NUM_TENSORS * nbd * bb
        need = max(s.decoders) - 1
        if need:
            extra.extend(start_peers(self.spawn, [f"{t}-decoder-{i + 2}" for i in range(need)], self.o.step_timeout))
            broadcast(extra, "init", lambda i: {"role": "DECODER", "cluster_id": DECODER + 1 + i, **self._engine(t)})
            broadcast(extra, "alloc", lambda i: {"nbytes": per_bytes, "name": name})
            broadcast(extra, "register_blocks", lambda i: {"model_id": mid, "num_tensors": NUM_TENSORS,
                                                          "num_blocks": nbd, "block_bytes": bb, "name": name})
            for p in extra:
                r = p.call("link", remote=PROMPT, port=port)
                if r["status"] != "LLM_SUCCESS":
                    raise BenchError(f"{t}: {p.name}: link failed: {r}")
        decs = [d1] + extra
        blocks_of = [nb] + [nbd] * len(extra)  # blocks per tensor of each decoder's cache
        out: dict = {"bytes_per_decoder_per_pull": per_bytes, "reps": s.decoder_reps}
        rng = np.random.default_rng(self.o.seed + 99)
        for n in s.decoders:
            group = decs[:n]
            tables = [(rng.choice(nb, nbd, replace=False).tolist(), rng.permutation(blocks_of[i])[:nbd].tolist())
                      for i in range(n)]
            broadcast(group, "zero", lambda i: {"name": name})
            start_at = time.monotonic() + 0.3 + 0.05 * n
            spans = broadcast(group, "blocks_at", lambda i: {
                "start_at": start_at, "remote": PROMPT, "model_id": mid, "remote_model_id": mid,
                "src": tables[i][0], "dst": tables[i][1], "reps": s.decoder_reps})
            checks = broadcast(group, "check_blocks", lambda i: {
                "num_tensors": NUM_TENSORS, "tensor_bytes": blocks_of[i] * bb, "block_bytes": bb,
                "dst_blocks": tables[i][1], "src_blocks": tables[i][0], "salt": SALT_PROMPT, "name": name,
                "src_tensor_bytes": nb * bb})
            moved = per_bytes * s.decoder_reps
            per = [moved / (sp["end"] - sp["start"]) / 1e9 for sp in spans]
            wall = max(sp["end"] for sp in spans) - min(sp["start"] for sp in spans)
            out[str(n)] = {"aggregate_gbps": moved * n / wall / 1e9, "per_decoder_gbps": per,
                           "mean_gbps": float(np.mean(per)), "min_gbps": min(per),
                           "verified": all(c["verified"] for c in checks), "wall_s": wall}
            self.p.step(f"{t}: {n} decoder(s): aggregate {out[str(n)]['aggregate_gbps']:.2f} GB/s, "
                        f"min {min(per):.2f}, verified={out[str(n)]['verified']}")
        return out

    def _links(self, t: str) -> dict:
        s = self.s
        fork = mp.get_context("forkserver")
        fork.set_forkserver_preload(["llmdd._tools.bench.worker", "llmdd", "numpy"])
        server = start_peers(self.spawn, [f"{t}-link-server"], self.o.step_timeout)[0]
        clients: list = []
        try:
            info = server.call("init", role="PROMPT", cluster_id=1000, listen=True, **self._engine(t))
            idle = {"rss_before_init": info["rss_before_init"], "rss_after_init": info["rss_after_init"],
                    "delta_bytes": info["rss_after_init"] - info["rss_before_init"],
                    "rss_process_start": info["rss_process_start"], "init_s": info["init_s"]}
            self.p.step(f"{t}: idle engine: +{idle['delta_bytes'] / MiB:.1f} MiB RSS "
                        f"({info['rss_after_init'] / MiB:.1f} MiB total)")
            n = max(s.links)
            clients = start_peers(fork, [f"{t}-link-client-{i}" for i in range(n)], self.o.step_timeout)
            broadcast(clients, "init", lambda i: {"role": "DECODER", "cluster_id": 2000 + i, **self._engine(t)})
            rss0 = server.call("rss")
            time.sleep(0.05)
            self.p.step(f"{t}: {n} link clients ready")
            link_s: list[float] = []
            points: list[dict[str, Any]] = []
            failure = None
            bounds = [0] + sorted(s.links)
            for lo, hi in zip(bounds, bounds[1:]):
                group = clients[lo:hi]
                if s.concurrent_links:
                    replies = broadcast(group, "link", lambda i: {"remote": 1000, "port": info["port"]})
                else:
                    replies = [c.call("link", remote=1000, port=info["port"]) for c in group]
                failed = [(c, r) for c, r in zip(group, replies) if r["status"] != "LLM_SUCCESS"]
                link_s.extend(r["link_s"] for r in replies if r["status"] == "LLM_SUCCESS")
                if failed:
                    c, r = failed[0]
                    failure = {"links_before": lo, "client": c.name, "reply": r, "failed": len(failed)}
                    self.results["errors"].append({"step": f"{t} links", "error": f"{c.name}: link failed: {r}"})
                    self.p.step(f"{t}: link {lo + 1}..{hi} FAILED ({len(failed)} of {len(group)}): {r['status']} "
                                f"after {r['link_s']:.1f} s")
                    break
                i = hi - 1
                time.sleep(0.05)
                rss = server.call("rss")
                first = points[0]["rss_bytes"] if points else rss
                marginal = (rss - first) / i if i else None
                points.append({"links": i + 1, "rss_bytes": rss, "delta_bytes": rss - rss0,
                               "per_link_bytes": (rss - rss0) / (i + 1), "marginal_per_link_bytes": marginal,
                               "link_ms_p50": float(np.median(link_s)) * 1e3})
                self.p.step(f"{t}: {i + 1} link(s): server +{(rss - rss0) / MiB:.2f} MiB"
                            + ("" if marginal is None else f", {marginal / KiB:.0f} KiB per link after the first")
                            + f", link p50 {np.median(link_s) * 1e3:.1f} ms")
            memory = server.call("memory_stats")
            return {"idle": idle, "points": points, "link_ms": [x * 1e3 for x in link_s],
                    "link_ms_p50": float(np.median(link_s)) * 1e3, "link_ms_max": max(link_s) * 1e3,
                    "links_concurrent": s.concurrent_links, "failure": failure,
                    "server_memory_stats": memory}
        finally:
            close_all(clients + [server])


def late_phases(opts: Options) -> list[str]:
    """The phases after the per-transport steps, in order: each is one step of the progress bar (so that
    the bar does not sit full while they run) and says what it does when it starts."""
    phases = [p for p in ("idle", "control", "scaling", "cpp") if p not in opts.skip]
    return [p for p in phases if p != "scaling" or opts.sizes.scaling_links]


_LATE_WHAT = {"idle": "an idle engine per transport, each in a fresh interpreter (its memory)",
              "control": "the bulk control notice's encode/decode cost",
              "scaling": "links and transfers as the number of peers grows",
              "cpp": "the C++ API's pull against the Python call (when libllm_datadist is built)"}


def run_bench(opts: Options, progress_enabled: bool = True) -> dict:
    """Run everything; returns the results dictionary (without ratios: see :mod:`.report`)."""
    transports = opts.transports if opts.transports is not None else available_transports()
    progress = Progress(Run.count_steps(opts, transports), enabled=progress_enabled)
    run = Run(opts, progress)
    meta = machine_facts()
    meta.update({"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": load_average(),
                 "transports": transports, "sizes": asdict(opts.sizes), "seed": opts.seed,
                 "options": dict(opts.options), "parent_rss_start": rss_bytes()})
    run.results["meta"] = meta
    began = time.monotonic()
    if "anchors" not in opts.skip:
        try:
            run.anchors()
        except BenchError as exc:
            run.results["errors"].append({"step": "anchors", "error": str(exc)})
            progress.note(f"anchors FAILED: {str(exc).splitlines()[0]}")
    for t in transports:
        try:
            run.transport(t)
        except BenchError as exc:
            run.results["errors"].append({"step": t, "error": str(exc)})
            progress.note(f"{t} FAILED: {str(exc).splitlines()[0]}")
    late = late_phases(opts)

    def phase(name: str) -> bool:
        if name in late:
            progress.note(f"{name}: {_LATE_WHAT[name]} ...")
        return name in late

    if phase("idle"):   # an idle engine per transport, each in a fresh interpreter (issue 22, target 5)
        from llmdd._tools.bench.idle import idle_engine

        for t in transports:
            if t in run.results["transports"] and t not in VARIANTS:
                try:
                    run.results["transports"][t]["idle_engine"] = idle_engine(t)
                    progress.note(f"{t}: idle engine {run.results['transports'][t]['idle_engine']['rss_bytes'] / MiB:.1f} MiB")
                except Exception as exc:  # noqa: BLE001 - one step's failure is a result, not a crash
                    run.results["errors"].append({"step": f"{t} idle engine", "error": repr(exc)})
        progress.step("idle: done")
    if phase("control"):   # the bulk control notice's codec cost (issue 22, target 4)
        from llmdd._tools.bench.control import run_control

        try:
            run.results["control"] = run_control(rounds=5 if opts.sizes == Sizes.quick() else 15)
        except Exception as exc:  # noqa: BLE001 - one step's failure is a result, not a crash
            run.results["errors"].append({"step": "control", "error": repr(exc)})
            progress.note(f"control FAILED: {exc!r}")
        progress.step("control: done")
    if phase("scaling"):
        from llmdd._tools.bench.scaling import run_scaling

        try:
            run.results["scaling"] = run_scaling(opts.sizes.scaling_links, progress=progress.note)
        except Exception as exc:  # noqa: BLE001 - one step's failure is a result, not a crash
            run.results["errors"].append({"step": "scaling", "error": repr(exc)})
            progress.note(f"scaling FAILED: {exc!r}")
        progress.step("scaling: done")
    if phase("cpp"):  # libllm_datadist's PullKvBlocks vs the Python call (skipped if not built)
        from llmdd._tools.bench.cpp import run_cpp

        try:
            quick = opts.sizes == Sizes.quick()
            run.results["cpp"] = run_cpp(quick=quick, progress=progress.note, rounds=1 if quick else 3)
        except Exception as exc:  # noqa: BLE001 - one step's failure is a result, not a crash
            run.results["errors"].append({"step": "cpp", "error": repr(exc)})
            progress.note(f"cpp FAILED: {exc!r}")
        progress.step("cpp: done")
    meta["load_after"] = load_average()
    meta["elapsed_s"] = time.monotonic() - began
    return run.results
