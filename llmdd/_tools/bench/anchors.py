"""The bench's anchors: what the same bytes cost without llmdd, measured in the worker that owns them.

In-process ``memcpy`` and gather, cross-process ``process_vm_readv`` (CMA) over the same iovecs,
TCP streams and request/response round trips over raw sockets (``_rr_*``, also the paired anchor of
``cmd_latency_pull``).  :class:`AnchorCommands` is a base of the bench
:class:`~llmdd._tools.bench.worker.Worker`: its ``cmd_*`` methods are worker commands.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Optional

import numpy as np

from llmdd._tools.bench.common import bw_summary, check_blocks, check_contiguous, lat_summary, prefault

HOST = "127.0.0.1"
_IOV_MAX = 1024


def _libc_readv():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def _recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got, n = 0, len(mv)
    while got < n:
        r = sock.recv_into(mv[got:], n - got)
        if r == 0:
            raise ConnectionError("peer closed")
        got += r


_RR_HEADER = struct.Struct("<QQ")   # the raw anchors' request: (offset, length)


def _rr_pull(sock: socket.socket, mv: memoryview, src_off: int, dst_off: int, nbytes: int) -> None:
    """One raw request/reply: the 16-byte request, the block back into ``mv`` at ``dst_off``."""
    sock.sendall(_RR_HEADER.pack(src_off, nbytes))
    _recv_exact(sock, mv[dst_off:dst_off + nbytes])


def _rr_push(sock: socket.socket, mv: memoryview, src_off: int, dst_off: int, nbytes: int, ack: memoryview) -> None:
    """One raw push: header and block in one ``sendmsg`` (the rest after a short send), the 1-byte answer."""
    head = _RR_HEADER.pack(dst_off, nbytes)
    k = sock.sendmsg([head, mv[src_off:src_off + nbytes]])
    if k < 16 + nbytes:
        if k < 16:
            sock.sendall(head[k:])
            k = 16
        sock.sendall(mv[src_off + k - 16:src_off + nbytes])
    _recv_exact(sock, ack)


def _serve_rr(conn: socket.socket, mv: memoryview, push: bool, n: Optional[int]) -> None:
    """Serve raw pulls (``push=False``: the bytes as reply) or pushes (the bytes stored, a 1-byte answer):
    ``n`` of them, or (``n=None``) until the client closes."""
    req = bytearray(16)
    rv = memoryview(req)
    done = 0
    while n is None or done < n:
        if n is None:
            first = conn.recv_into(rv, 16)
            if first == 0:
                return
            if first < 16:
                _recv_exact(conn, rv[first:])
        else:
            _recv_exact(conn, rv)
        off, length = _RR_HEADER.unpack(req)
        if push:
            _recv_exact(conn, mv[off:off + length])
            conn.sendall(b"k")
        else:
            conn.sendall(mv[off:off + length])
        done += 1


class AnchorCommands:
    """The anchor commands of the bench worker (a base of :class:`~llmdd._tools.bench.worker.Worker`,
    which holds the memory and the listening socket they use)."""

    bufs: dict[str, np.ndarray]
    listener: Optional[socket.socket]

    if TYPE_CHECKING:
        @property
        def buf(self) -> np.ndarray: ...

    def cmd_memcpy(self, nbytes: int, runs: int, warmup: int) -> dict:
        src = self.buf[:nbytes]
        dst = np.empty(nbytes, dtype=np.uint8)
        prefault(dst)
        for _ in range(warmup):
            np.copyto(dst, src)
        secs = []
        for _ in range(runs):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            secs.append(time.perf_counter() - t0)
        out = bw_summary(secs, nbytes)
        out["verified"] = bool(np.array_equal(dst[-4096:], src[-4096:]) and np.array_equal(dst[:4096], src[:4096]))
        return out

    def cmd_gather(self, num_tensors: int, num_blocks: int, block_bytes: int, src: list, dst: list, salt: int,
                   runs: int, warmup: int) -> dict:
        """In-process gather of the same blocks: one-pass ``np.take(out=, mode="clip")`` over all tensors
        (block table the same in every tensor, ``dst`` a full permutation, as in the llmdd workload)."""
        tensor = num_blocks * block_bytes
        nbytes = num_tensors * tensor
        s2 = self.buf[:nbytes].reshape(num_tensors * num_blocks, block_bytes)
        out = np.empty(nbytes, dtype=np.uint8)
        prefault(out)
        d2 = out.reshape(num_tensors * num_blocks, block_bytes)
        srcs = np.asarray(src, dtype=np.int64)
        dsts = np.asarray(dst, dtype=np.int64)
        assert len(np.unique(dsts)) == num_blocks, "gather anchor needs dst to be a full permutation"
        order = np.argsort(dsts)
        per_tensor = srcs[order]  # dst block k of a tensor receives src block per_tensor[k]
        index = (np.arange(num_tensors, dtype=np.int64)[:, None] * num_blocks + per_tensor[None, :]).ravel()
        fn = lambda: np.take(s2, index, axis=0, out=d2, mode="clip")  # noqa: E731
        for _ in range(warmup):
            fn()
        secs = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        res = bw_summary(secs, nbytes)
        res.update(check_blocks(out, num_tensors, tensor, block_bytes, dst, src, salt))
        return res

    def cmd_cma(self, pid: int, raddr: int, num_tensors: int, num_blocks: int, block_bytes: int, src: list,
                dst: list, salt: int, runs: int, warmup: int, threads: int = 1) -> dict:
        """``process_vm_readv`` of the same blocks from ``pid``: one iovec per block (a contiguous pull
        when ``num_blocks == 1``), at most IOV_MAX iovecs per call; single-thread, or with ``threads``
        > 1 the calls cut into that many consecutive groups of about equal bytes, one thread each (started
        inside the timed interval, as a batch on both cores has to)."""
        readv = _libc_readv()
        tensor = num_blocks * block_bytes
        nbytes = num_tensors * tensor
        laddr = int(self.buf.ctypes.data)
        t_off = np.arange(num_tensors, dtype=np.uint64)[:, None] * np.uint64(tensor)
        if num_blocks == 1:
            seg = 64 << 20  # contiguous: big iovecs (one call)
            offs = np.arange(0, nbytes, seg, dtype=np.uint64)
            lens = np.minimum(np.uint64(seg), np.uint64(nbytes) - offs)
            liov = np.stack([laddr + offs, lens], axis=1).astype(np.uint64)
            riov = np.stack([raddr + offs, lens], axis=1).astype(np.uint64)
        else:
            s = np.asarray(src, dtype=np.uint64)[None, :] * np.uint64(block_bytes)
            d = np.asarray(dst, dtype=np.uint64)[None, :] * np.uint64(block_bytes)
            n = num_tensors * len(src)
            liov = np.empty((n, 2), dtype=np.uint64)
            riov = np.empty((n, 2), dtype=np.uint64)
            liov[:, 0] = (np.uint64(laddr) + t_off + d).ravel()
            riov[:, 0] = (np.uint64(raddr) + t_off + s).ravel()
            liov[:, 1] = riov[:, 1] = block_bytes
        total = int(liov[:, 1].sum())
        per = -(-len(liov) // max(1, threads))  # iovecs per thread (equal-sized blocks: equal bytes)
        groups = [[(liov[i:min(i + _IOV_MAX, g + per)], riov[i:min(i + _IOV_MAX, g + per)])
                   for i in range(g, min(g + per, len(liov)), _IOV_MAX)] for g in range(0, len(liov), per)]
        moved = [0] * len(groups)

        def one(k: int) -> None:
            done = 0
            for lv, rv in groups[k]:
                got = readv(pid, lv.ctypes.data, len(lv), rv.ctypes.data, len(rv), 0)
                if got < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"process_vm_readv: {os.strerror(err)}")
                done += got
            moved[k] = done

        def fn() -> None:
            if len(groups) == 1:
                one(0)
            else:
                ts = [threading.Thread(target=one, args=(k,)) for k in range(1, len(groups))]
                for t in ts:
                    t.start()
                one(0)
                for t in ts:
                    t.join()
            if sum(moved) != total:
                raise RuntimeError(f"short process_vm_readv: {sum(moved)} of {total} bytes")
            moved[:] = [0] * len(groups)

        self.buf[:nbytes] = 0
        for _ in range(warmup):
            fn()
        secs = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        res = bw_summary(secs, total)
        if num_blocks == 1:
            res["verified"] = check_contiguous(self.buf, nbytes, salt)
        else:
            res.update(check_blocks(self.buf, num_tensors, tensor, block_bytes, dst, src, salt))
        return res

    def cmd_cma_latency(self, pid: int, raddr: int, num_blocks: int, block_bytes: int, n: int, warmup: int) -> dict:
        readv = _libc_readv()
        laddr = int(self.buf.ctypes.data)
        rng = np.random.default_rng(7)
        srcs = rng.integers(0, num_blocks, n + warmup)
        dsts = rng.integers(0, num_blocks, n + warmup)
        one_l = np.zeros((1, 2), dtype=np.uint64)
        one_r = np.zeros((1, 2), dtype=np.uint64)
        lp, rp = one_l.ctypes.data, one_r.ctypes.data
        us = []
        pc = time.perf_counter
        for i in range(n + warmup):
            t0 = pc()
            one_l[0, 0] = laddr + int(dsts[i]) * block_bytes
            one_l[0, 1] = block_bytes
            one_r[0, 0] = raddr + int(srcs[i]) * block_bytes
            one_r[0, 1] = block_bytes
            got = readv(pid, lp, 1, rp, 1, 0)
            dt = pc() - t0
            if got != block_bytes:
                raise RuntimeError(f"process_vm_readv returned {got}")
            if i >= warmup:
                us.append(dt * 1e6)
        return lat_summary(us)

    # sockets: a listener, then a sender and a receiver run at the same time
    def cmd_listen(self) -> int:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((HOST, 0))
        ls.listen(16)
        self.listener = ls
        return ls.getsockname()[1]

    def _listening(self) -> socket.socket:
        """The socket ``cmd_listen`` made; the serving commands fail before that."""
        if self.listener is None:
            raise RuntimeError("this worker does not listen: cmd_listen first")
        return self.listener

    def cmd_stream_recv(self, streams: int, nbytes: int, rounds: int, salt: int) -> dict:
        conns = []
        for _ in range(streams):
            c, _ = self._listening().accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns.append(c)
        self.buf[:nbytes] = 0
        mv = self.buf.data
        part = nbytes // streams

        def serve(i: int, c: socket.socket) -> None:
            for _ in range(rounds):
                _recv_exact(c, mv[i * part:(i + 1) * part])
                c.sendall(b"k")

        ts = [threading.Thread(target=serve, args=(i, c)) for i, c in enumerate(conns)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for c in conns:
            c.close()
        return {"verified": check_contiguous(self.buf, part * streams, salt)}

    def cmd_stream_send(self, port: int, streams: int, nbytes: int, runs: int, warmup: int) -> dict:
        mv = self.buf.data
        socks = []
        for _ in range(streams):
            s = socket.create_connection((HOST, port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(s)
        part = nbytes // streams

        def push(i: int, s: socket.socket) -> None:
            s.sendall(mv[i * part:(i + 1) * part])
            _recv_exact(s, memoryview(bytearray(1)))

        secs = []
        for r in range(runs + warmup):
            ts = [threading.Thread(target=push, args=(i, s)) for i, s in enumerate(socks)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            dt = time.perf_counter() - t0
            if r >= warmup:
                secs.append(dt)
        for s in socks:
            s.close()
        return bw_summary(secs, part * streams)

    def cmd_rr_serve(self, n: int) -> None:
        """Serve ``n`` pulls: a 16-byte request ``(offset, length)``, the bytes as reply."""
        c, _ = self._listening().accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _serve_rr(c, self.buf.data, push=False, n=n)
        c.close()

    def cmd_rr_push_serve(self, n: int) -> None:
        """Take ``n`` pushes: a 16-byte header ``(offset, length)`` and the bytes, stored; a 1-byte answer."""
        c, _ = self._listening().accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _serve_rr(c, self.buf.data, push=True, n=n)
        c.close()

    def cmd_rr_paired_serve(self, name: str) -> dict:
        """Serve raw pulls and raw pushes on buffer ``name`` (the engine's registered blocks), each on a
        port of its own, in background threads, until the client closes: the anchors that
        ``cmd_latency_pull(paired_port=...)`` interleaves with the engine's calls."""
        mv = self.bufs[name].data
        ports = {}
        for kind in ("pull", "push"):
            ls = socket.socket()
            ls.bind((HOST, 0))
            ls.listen(1)
            ports[kind] = ls.getsockname()[1]

            def serve(ls: socket.socket = ls, push: bool = kind == "push") -> None:
                with ls:
                    c, _ = ls.accept()
                with c:
                    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    _serve_rr(c, mv, push=push, n=None)

            threading.Thread(target=serve, name=f"llmdd-bench-rr-{kind}", daemon=True).start()
        return ports

    def cmd_rr_push_client(self, port: int, block_bytes: int, num_blocks: int, n: int, warmup: int) -> dict:
        """The raw push a tcp ``push_blocks`` of one block is compared with: header and block in one
        ``sendmsg``, then the 1-byte answer."""
        s = socket.create_connection((HOST, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mv = self.buf.data
        rng = np.random.default_rng(9)
        srcs = rng.integers(0, num_blocks, n + warmup).tolist()
        dsts = rng.integers(0, num_blocks, n + warmup).tolist()
        ack = memoryview(bytearray(1))
        us = []
        pc = time.perf_counter
        for i in range(n + warmup):
            t0 = pc()
            _rr_push(s, mv, srcs[i] * block_bytes, dsts[i] * block_bytes, block_bytes, ack)
            dt = pc() - t0
            if i >= warmup:
                us.append(dt * 1e6)
        s.close()
        out = lat_summary(us)
        out["last"] = {"src": srcs[-1], "dst": dsts[-1]}
        return out

    def cmd_rr_client(self, port: int, block_bytes: int, num_blocks: int, n: int, warmup: int) -> dict:
        s = socket.create_connection((HOST, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mv = self.buf.data
        rng = np.random.default_rng(7)
        srcs = rng.integers(0, num_blocks, n + warmup).tolist()
        dsts = rng.integers(0, num_blocks, n + warmup).tolist()
        us = []
        pc = time.perf_counter
        for i in range(n + warmup):
            t0 = pc()
            _rr_pull(s, mv, srcs[i] * block_bytes, dsts[i] * block_bytes, block_bytes)
            dt = pc() - t0
            if i >= warmup:
                us.append(dt * 1e6)
        s.close()
        return lat_summary(us)
