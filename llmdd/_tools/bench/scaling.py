"""Link scaling of one server engine: 1, 64 and 1,000 links from synthetic clients.

One engine per process is the contract's rule, so 1,000 peers cannot be 1,000 engines here.  The
clients are a few processes, each holding hundreds of links that speak the real protocol: a
control connection from its own loopback source address (127.0.x.y, as peers on other hosts
would), the sans-io :class:`~llmdd._protocol.handshake.ClientHandshake`, full table announcements,
a real tcp data endpoint (one per client process, shared by its links) that the server connects
its data channel to, and keepalive answers.  The server is a real engine (tcp forced) in its own
process.

Measured at each level N (links alive): the server's threads, RSS and descriptors, and the link
setup time of ``probes`` more links set up one at a time on top of the N (connect to the server's
tables arriving, i.e. LINKED on the server), each unlinked again.  Targets:
threads constant in N, RSS per link <= 64 KiB, setup p50 at 1,000 <= 2x the p50 at 1.

Run alone: ``python -m llmdd._tools.bench.scaling [--links 1,64,1000] [--json]``; ``llmdd bench`` (the
full run, not ``--quick``) includes it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

__all__ = ["run_scaling", "main"]

KiB = 1024
SERVER_ID = 7_000
PROBES = 20


def _proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                out[key] = int(value.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return {"threads": out["Threads"], "rss_bytes": out["VmRSS"] * 1024, "fds": out["fds"]}


# ---------------------------------------------------------------------------------------- server
def _server_main(conn) -> None:
    from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.listen_ip_info = "127.0.0.1:0"
    opts = dict(cfg.generate_options())
    opts.update({"llmdd.transport": "tcp", "llmdd.peer_timeout_ms": "30000"})
    dd = LLMDataDist(LLMRole.PROMPT, SERVER_ID)
    dd.init(opts)
    buf = np.arange(4 * 1024, dtype=np.float32)
    dd.cache_manager.register_blocks_cache(CacheDesc(1, [4, 1024], DataType.DT_FLOAT), [buf.ctypes.data],
                                           BlocksCacheKey(SERVER_ID, 0))
    lm = dd._require_core().link_manager
    listening = lm.listen_address
    if listening is None:   # llm.listenIpInfo is set above
        raise RuntimeError("the scaling server does not listen")
    conn.send({"port": listening[1], "pid": os.getpid()})
    while True:
        cmd = conn.recv()
        if cmd == "stats":
            links = lm.statistics()
            conn.send({"links": sum(1 for v in links.values() if v["state"] == "linked"),
                       "failed": sum(1 for v in links.values() if v["state"] == "failed"),
                       "io": {k: v for k, v in lm.io_statistics().items() if k != "listeners"}
                       if hasattr(lm, "io_statistics") else {}})
        elif cmd == "stop":
            dd.finalize()
            conn.send("stopped")
            return


# ---------------------------------------------------------------------------------------- clients
class _Client:
    """Synthetic links of one process: set up one at a time, kept alive by a selector thread."""

    def __init__(self, index: int, port: int) -> None:
        from llmdd_tcp import TcpTransport

        from llmdd._control.endpoints import to_wire
        from llmdd._protocol import messages as m
        from llmdd._protocol.codec import Connection
        from llmdd._protocol.handshake import HandshakeConfig, new_incarnation

        self.m = m
        self.Connection = Connection
        self.index = index
        self.port = port
        # the server connects one data stream per link to this endpoint: lift its caps for that
        self.endpoint = TcpTransport({"llmdd.max_pending_connections": "100000",
                                      "llmdd.max_pending_per_address": "100000",
                                      "llmdd.tcp.pending_timeout_ms": "600000"}).open_endpoint(host="127.0.0.1")
        # not serving links only: its own description opens its data port, the capability beside it in the offer
        desc = self.endpoint.describe()
        self.offer = m.TransportOffer(name="tcp", descriptor=to_wire(desc), capability=desc.capability)
        self.HandshakeConfig = HandshakeConfig
        self.new_incarnation = new_incarnation
        self.sel = selectors.DefaultSelector()
        self.lock = threading.Lock()
        self.links: dict[int, tuple] = {}          # cluster id -> (sock, codec)
        self.next_id = (index + 1) * 1_000_000
        self.errors: list = []
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _source(self, n: int) -> str:
        k = self.index * 10_000 + n
        return f"127.{1 + (k >> 16) % 250}.{(k >> 8) & 0xff}.{2 + (k & 0xff) % 250}"

    def setup(self) -> float:
        """One link, set up now; returns its setup seconds (connect to the server's tables in)."""
        from llmdd._protocol.codec import NEED_DATA, PEER_CLOSED
        from llmdd._protocol.handshake import ClientHandshake, HandshakeRefused
        from llmdd._protocol.tables import TableAnnouncer
        from llmdd._base.status import LLMStatusCode

        m = self.m
        cid = self.next_id
        self.next_id += 1
        t0 = time.perf_counter()
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((self._source(cid), 0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(30.0)
            sock.connect(("127.0.0.1", self.port))
            codec = self.Connection()
            cfg = self.HandshakeConfig(cluster_id=cid, incarnation=self.new_incarnation(), transports=(self.offer,))
            hs = ClientHandshake(cfg)

            def recv() -> Any:
                while True:
                    msg = codec.next_message()
                    if msg is not NEED_DATA:
                        return msg
                    codec.receive_data(sock.recv(65536))

            sock.sendall(codec.send(hs.start()))
            while not hs.finished:
                msg = recv()
                if msg is PEER_CLOSED:
                    raise RuntimeError("server closed during the handshake")
                for out in hs.receive(msg):
                    sock.sendall(codec.send(out))
            try:
                hs.result()
            except HandshakeRefused as exc:
                sock.close()
                if exc.refusal.status_code == LLMStatusCode.LLM_LINK_BUSY.value:
                    time.sleep(0.01)
                    continue   # over the server's pending caps: as a real client, retry
                raise
            break
        ann = TableAnnouncer()
        sock.sendall(codec.send_many([ann.regions_update(full=True),
                                      ann.cache_table_update(full=True)]))
        while True:   # the server's tables come once its data channel to us is up: LINKED there
            msg = recv()
            if msg is PEER_CLOSED:
                raise RuntimeError("server closed during the setup")
            if isinstance(msg, m.Keepalive):
                sock.sendall(codec.send(m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns,
                                                       sent_at_ns=time.monotonic_ns())))
            if isinstance(msg, m.CacheTableUpdate):
                break
        took = time.perf_counter() - t0
        sock.setblocking(False)
        with self.lock:
            self.links[cid] = (sock, codec)
        self.sel.register(sock, selectors.EVENT_READ, cid)
        self._wake_w.send(b"x")
        return took

    def unlink_last(self) -> None:
        m = self.m
        with self.lock:
            cid = max(self.links)
            sock, codec = self.links.pop(cid)
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.setblocking(True)
        sock.settimeout(10.0)
        sock.sendall(codec.send(m.UnlinkRequest(request_id=1, force=False, reason="bench")))
        deadline = time.monotonic() + 10.0
        from llmdd._protocol.codec import NEED_DATA, PEER_CLOSED

        while time.monotonic() < deadline:
            msg = codec.next_message()
            if msg is NEED_DATA:
                data = sock.recv(65536)
                codec.receive_data(data)
                continue
            if msg is PEER_CLOSED or isinstance(msg, m.UnlinkAck):
                break
        sock.close()

    def _serve(self) -> None:
        from llmdd._protocol.codec import NEED_DATA, PEER_CLOSED

        m = self.m
        while not self._stop:
            for key, _ in self.sel.select(1.0):
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    continue
                with self.lock:
                    entry = self.links.get(key.data)
                if entry is None:
                    continue
                sock, codec = entry
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    self.errors.append(f"link {key.data}: {exc}")
                    self.sel.unregister(sock)
                    continue
                if not data:
                    self.errors.append(f"link {key.data}: server closed")
                    self.sel.unregister(sock)
                    continue
                codec.receive_data(data)
                while True:
                    msg = codec.next_message()
                    if msg is NEED_DATA or msg is PEER_CLOSED:
                        break
                    if isinstance(msg, m.Keepalive):
                        try:
                            sock.send(codec.send(m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns,
                                                                sent_at_ns=time.monotonic_ns())))
                        except OSError:
                            pass

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self.thread.join(5.0)
        with self.lock:
            socks = [s for s, _ in self.links.values()]
            self.links.clear()
        for s in socks:
            s.close()
        self.endpoint.close()


def _client_main(conn, index: int, port: int) -> None:
    client = _Client(index, port)
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "link":
                conn.send([client.setup() for _ in range(arg)])
            elif cmd == "probe":
                times = []
                for _ in range(arg):
                    times.append(client.setup())
                    client.unlink_last()
                conn.send(times)
            elif cmd == "errors":
                conn.send(list(client.errors))
            elif cmd == "stop":
                client.close()
                conn.send("stopped")
                return
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send({"error": repr(exc)})


# ---------------------------------------------------------------------------------------- driver
def _call(conn, msg, timeout: float = 600.0) -> Any:
    conn.send(msg)
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {msg!r} in {timeout} s")
    out = conn.recv()
    if isinstance(out, dict) and "error" in out:
        raise RuntimeError(out["error"])
    return out


def run_scaling(levels=(1, 64, 1000), *, processes: int = 4, probes: int = PROBES,
                progress=None) -> dict:
    """Measure; returns a JSON-able dict with one point per level and the targets' verdicts."""
    ctx = mp.get_context("spawn")
    note = progress or (lambda s: None)
    s_conn, s_child = ctx.Pipe()
    server = ctx.Process(target=_server_main, args=(s_child,), daemon=True, name="llmdd-scale-server")
    server.start()
    clients: list = []
    try:
        if not s_conn.poll(120):
            raise TimeoutError("the server did not start")
        info = s_conn.recv()
        port, pid = info["port"], info["pid"]
        for i in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child, i, port), daemon=True, name=f"llmdd-scale-{i}")
            proc.start()
            clients.append((proc, parent))
        for _, c in clients:
            if not c.poll(120):
                raise TimeoutError("a client did not start")
            c.recv()
        base = _proc_status(pid)
        points = []
        alive = 0
        for level in sorted(levels):
            need = level - alive
            share = [need // processes + (1 if i < need % processes else 0) for i in range(processes)]
            for (_, c), k in zip(clients, share):
                if k:
                    c.send(("link", k))
            for (_, c), k in zip(clients, share):
                if k:
                    if not c.poll(900):
                        raise TimeoutError("linking did not finish")
                    out = c.recv()
                    if isinstance(out, dict):
                        raise RuntimeError(out["error"])
            alive = level
            peak = _proc_status(pid)["threads"]
            # at rest: the pools' workers end after 1 s without work; keepalives run on the loop thread
            time.sleep(1.5)
            stats = _call(s_conn, "stats")
            status = _proc_status(pid)
            probe_s = _call(clients[0][1], ("probe", probes))
            stats_after = _call(s_conn, "stats")
            point = {"links": level, "server_links": stats["links"], "server_failed_links": stats_after["failed"],
                     **status, "threads_after_linking": peak, "io": stats["io"],
                     "setup_ms_p50": float(np.median(probe_s)) * 1e3,
                     "setup_ms_p90": float(np.percentile(probe_s, 90)) * 1e3,
                     "setup_ms": [x * 1e3 for x in probe_s]}
            points.append(point)
            note(f"scaling: {level} links: server threads {status['threads']}, RSS {status['rss_bytes'] / 2**20:.1f} MiB, "
                 f"fds {status['fds']}, setup p50 {point['setup_ms_p50']:.2f} ms")
        errors = []
        for _, c in clients:
            errors.extend(_call(c, ("errors", None)))
        first, last = points[0], points[-1]
        if len(points) >= 2 and last["links"] > first["links"]:
            mid = points[-2]
            per_link = (last["rss_bytes"] - mid["rss_bytes"]) / max(1, last["links"] - mid["links"])
        else:
            per_link = None
        return {
            "levels": list(levels), "processes": processes, "probes": probes, "server_base": base,
            "points": points, "client_errors": errors[:20],
            "rss_per_link_bytes": per_link,
            "threads_constant": len({p["threads"] for p in points}) == 1,
            "threads": [p["threads"] for p in points],
            "setup_p50_ratio": last["setup_ms_p50"] / first["setup_ms_p50"] if len(points) >= 2 else None,
            "targets": {"rss_per_link_bytes_max": 64 * KiB, "setup_p50_ratio_max": 2.0},
        }
    finally:
        for _, c in clients:
            try:
                _call(c, ("stop", None), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        try:
            _call(s_conn, "stop", timeout=60)
        except Exception:  # noqa: BLE001
            pass
        for proc, _ in clients:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        server.join(10)
        if server.is_alive():
            server.kill()


def verdicts(result: dict) -> list[str]:
    lines = []
    per = result.get("rss_per_link_bytes")
    ratio = result.get("setup_p50_ratio")
    lines.append(f"[{'MET    ' if result['threads_constant'] else 'NOT MET'}] server threads constant in links: "
                 f"{result['threads']}")
    if per is not None:
        lines.append(f"[{'MET    ' if per <= 64 * KiB else 'NOT MET'}] server RSS per link: {per / KiB:.1f} KiB "
                     f"(goal <= 64 KiB)")
    if ratio is not None:
        lines.append(f"[{'MET    ' if ratio <= 2.0 else 'NOT MET'}] link setup p50 at {result['points'][-1]['links']} "
                     f"vs at {result['points'][0]['links']}: {ratio:.2f}x (goal <= 2x)")
    return lines


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmdd._tools.bench.scaling", description=__doc__.split("\n")[0])
    ap.add_argument("--links", default="1,64,1000", help="levels, comma-separated (default 1,64,1000)")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--probes", type=int, default=PROBES)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    levels = tuple(int(x) for x in args.links.split(","))
    result = run_scaling(levels, processes=args.processes, probes=args.probes,
                         progress=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for line in verdicts(result):
            print(line)
        if result["client_errors"]:
            print("client errors:", result["client_errors"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
