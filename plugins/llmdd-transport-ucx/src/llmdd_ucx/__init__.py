"""llmdd transport ``ucx``: one-sided READ/WRITE through UCX, driven by NVIDIA NIXL's Python API.

Where the hardware exists UCX runs RDMA (InfiniBand/RoCE); on this kind of host it picks
``cma`` (``process_vm_readv``) between processes of one host, and ``tcp`` otherwise. NIXL is
imported lazily (``probe()`` / first endpoint), never at import: without NIXL the plugin still
registers and ``probe()`` says why it is unavailable.

Shape
-----
* One ``nixl_agent`` per endpoint (unique name ``llmdd-<pid>-<random>``), UCX backend, NIXL's
  progress thread on, thread-safe (``NIXL_THREAD_SYNC_STRICT``).
* ``register(region)`` registers ``(addr, size, 0)`` as DRAM with the agent and returns the
  descriptor a peer needs: ``addr``, ``size``, ``dev_id``, a generation, and the agent's
  *partial* metadata for that region (its remote key), so regions registered after a link
  exists reach the peer through llmdd's own descriptor updates.
* ``describe()``: the agent name and its connection metadata (bytes, no region key). ``connect(peer)`` loads it
  (``add_remote_agent``) and says HELLO over a NIXL notification; the owner loads the
  initiator's metadata from it and answers WELCOME (see :mod:`llmdd_ucx._proto`). No etcd,
  no listener thread, no side channel.
* ``read``/``write``: every op is validated with :func:`check_ops` against the local regions
  and the remote regions the channel was given before a byte moves; ops are coalesced and
  turned into ``(addr, len, dev)`` numpy arrays (no per-op Python object), cut into chunks of
  at most ``llmdd.ucx.chunk_bytes`` / ``llmdd.ucx.chunk_descs``, and each chunk is one NIXL
  request (``initialize_xfer`` on ``get_xfer_descs(ndarray)``). At most
  ``llmdd.ucx.inflight`` requests of a batch are in flight. A batch that fits in the window
  is polled by the caller (``wait``/``done``); a longer one gets a driver thread.
* Completion: ``check_xfer_state`` is polled with a spin budget, then short sleeps that back
  off, never past the deadline. On error, deadline, ``cancel``, deregistration or close no new
  request is posted and the requests in flight are *drained* (polled until they are no longer
  in progress) before they are released and before the completion reports: a NIXL request is
  never released while in flight (ai-dynamo/nixl#2067), and after the completion reported
  its error no byte of the batch lands.

Trust level: UCX enforces registrations through remote keys on RDMA hardware. Over cma and
tcp it does not; there the owner's grants are enforced by the initiator (correct peers only):
the channel refuses regions it was not given or that are not remote-accessible, and the owner's
``deregister``/``close`` ask every client over the notification channel to refuse and drain
before they return (DRAIN/BYE, bounded by ``llmdd.ucx.control_timeout``).  ``describe()`` and the
HELLO carry the agent's connection metadata only; a region's remote key is sent (in its descriptor)
only when the region is remote-accessible, so a linked peer that calls NIXL itself, going around this
channel's checks, cannot address a region that is not remote-accessible: NIXL has no key for it
(``bench/results-committed/issue14/ucx_keys.py``).  Over cma/tcp UCX does not enforce keys between
processes of one user, so this narrows what NIXL will do for a peer; it is not a memory boundary.
The keys travel only over the link's control connection.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Mapping, Optional, Union


from llmdd.plugin import hookimpl
from llmdd.lowlevel import get_logger
from llmdd.lowlevel import TransportError
import msgspec

from llmdd.abc import Channel, Completion, Endpoint, EndpointDescriptor, RegionDescriptor, Transport, TransportInfo
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none
from llmdd.lowlevel import BatchSet, Cancelled, Corrupt, DoneCompletion, MemRegion, PeerGone, RegionRegistry
from llmdd.lowlevel import RegionTable, RegisteredRegion, Refused, TransportTimeout, check_ops, coalesce_ops
from llmdd.lowlevel import decode_payload, encode_payload

from . import _nixl, _proto

__all__ = ["UcxTransport", "UcxEndpoint", "UcxChannel", "EndpointFields", "RegionFields", "endpoint_fields",
           "region_fields", "hookimpl", "llmdd_register_transports"]


_log = get_logger("llmdd.transport.ucx")

VERSION = 1

OPT_TLS = "llmdd.ucx.tls"                       # -> UCX_TLS for this endpoint's UCX context
OPT_DEVICES = "llmdd.ucx.devices"               # -> NIXL UCX backend "ucx_devices" (UCX_NET_DEVICES)
OPT_CHUNK_BYTES = "llmdd.ucx.chunk_bytes"
OPT_CHUNK_DESCS = "llmdd.ucx.chunk_descs"
OPT_INFLIGHT = "llmdd.ucx.inflight"
OPT_CONTROL_TIMEOUT = "llmdd.ucx.control_timeout"
OPT_DRAIN_TIMEOUT = "llmdd.ucx.drain_timeout"
OPT_SPIN_US = "llmdd.ucx.spin_us"
OPT_PROGRESS_THREAD = "llmdd.ucx.progress_thread"  # 1: NIXL's own progress thread (busy-polls on cma/shm)
OPT_NOTIF_IDLE_MS = "llmdd.ucx.notif_idle_ms"      # the notification loop's longest idle sleep
OPT_TRAFFIC_CLASS = "llm.RdmaTrafficClass"      # -> UCX_IB_TRAFFIC_CLASS
OPT_SERVICE_LEVEL = "llm.RdmaServiceLevel"      # -> UCX_IB_SL
_DEFAULTS: dict[str, Any] = {
    OPT_TLS: "", OPT_DEVICES: "", OPT_CHUNK_BYTES: 256 << 20, OPT_CHUNK_DESCS: 1 << 16,
    OPT_INFLIGHT: 4, OPT_CONTROL_TIMEOUT: 5.0, OPT_DRAIN_TIMEOUT: 60.0, OPT_SPIN_US: 50.0,
    OPT_PROGRESS_THREAD: 0, OPT_NOTIF_IDLE_MS: 20.0,
}

_INIT_AGENT = "NIXL_INIT_AGENT"
#: threads that serve owners' DRAIN/BYE requests per endpoint (bounded: not one per peer)
_OWNER_WORKERS = 8


def _nixl_error(exc: BaseException, what: str) -> TransportError:
    """Map an exception of NIXL's bindings (``nixlRemoteDisconnectError``...) to a typed error."""
    if isinstance(exc, TransportError):
        return exc
    kind = type(exc).__name__
    if "Disconnect" in kind or "Unreach" in kind:
        return PeerGone(f"{what}: the peer agent is gone ({kind})")
    if "NotFound" in kind or "InvalidParam" in kind or "NotAllowed" in kind:
        return Refused(f"{what}: NIXL refused the descriptors ({kind}: {exc})")
    if "Backend" in kind:
        return PeerGone(f"{what}: the UCX backend failed ({kind}: {exc})")
    return Corrupt(f"{what}: unexpected NIXL failure ({kind}: {exc!r})")


def _ucx_env(options: Mapping[str, Any]) -> dict:
    env = {}
    if options.get(OPT_TLS):
        env["UCX_TLS"] = str(options[OPT_TLS])
    tc = options.get(OPT_TRAFFIC_CLASS)
    if tc not in (None, ""):
        env["UCX_IB_TRAFFIC_CLASS"] = str(int(tc))
    sl = options.get(OPT_SERVICE_LEVEL)
    if sl not in (None, ""):
        env["UCX_IB_SL"] = str(int(sl))
    return env


# --------------------------------------------------------------------------- descriptors


class EndpointFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a ucx :class:`~llmdd.abc.EndpointDescriptor` (version :data:`VERSION`)."""

    agent: str
    metadata: bytes          # the NIXL agent's connection metadata (no region key)
    host: str = ""
    hostname: str = ""
    pid: int = 0


class RegionFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a ucx :class:`~llmdd.abc.RegionDescriptor` (version :data:`VERSION`)."""

    agent: str
    region_id: int
    addr: int
    size: int
    dev_id: int = 0
    mem: str = "DRAM"
    gen: int = 0
    remote_accessible: bool = True
    metadata: bytes = b""    # the NIXL partial metadata with this region's key (remote-accessible only)


def endpoint_fields(desc: EndpointDescriptor) -> EndpointFields:
    """The fields of a ucx endpoint descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="ucx", version=VERSION, type=EndpointFields)


def region_fields(desc: RegionDescriptor) -> RegionFields:
    """The fields of a ucx region descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="ucx", version=VERSION, type=RegionFields)


# --------------------------------------------------------------------------- transport


class UcxTransport(Transport):
    """Any host: UCX through NIXL. Preferred over tcp (10), below same-host shm (100)."""

    name = "ucx"
    priority = 50
    same_host_only = False

    @classmethod
    def probe(cls) -> TransportInfo:
        try:
            api = _nixl.load()
        except ImportError as exc:
            return TransportInfo(name=cls.name, available=False, reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - probe never raises
            return TransportInfo(name=cls.name, available=False, reason=f"loading NIXL failed: {exc!r}")
        try:
            plugins = _ucx_plugin_names(api)
        except Exception as exc:  # noqa: BLE001
            return TransportInfo(name=cls.name, available=False, reason=f"NIXL plugin query failed: {exc!r}")
        details = dict(_nixl.version_info(), ucx_modules=os.environ.get("UCX_MODULES", ""), version=VERSION,
                       nixl_plugins=sorted(plugins))
        if "UCX" not in plugins:
            return TransportInfo(name=cls.name, available=False, details=details,
                                 reason=f"NIXL has no UCX backend plugin (found {sorted(plugins)})")
        return TransportInfo(name=cls.name, available=True, reason="", details=details)

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)
        cfg = {k: type(v)(self.options.get(k, v)) for k, v in _DEFAULTS.items()}
        for k in (OPT_TRAFFIC_CLASS, OPT_SERVICE_LEVEL):
            if self.options.get(k) not in (None, ""):
                cfg[k] = int(self.options[k])
        self._cfg = cfg

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> "UcxEndpoint":
        return UcxEndpoint(host=host, cfg=self._cfg)


_plugin_cache: Optional[frozenset] = None


def _ucx_plugin_names(api: Any) -> frozenset:
    """The NIXL backend plugins present, without creating an agent (no UCX context)."""
    global _plugin_cache
    if _plugin_cache is None:
        import glob
        pkg_dir = os.path.dirname(api.__file__)
        names = set()
        env_dir = os.environ.get("NIXL_PLUGIN_DIR")
        for d in filter(None, [env_dir, pkg_dir, pkg_dir + ".libs", os.path.join(pkg_dir + ".libs", "nixl")]):
            for path in glob.glob(os.path.join(d, "**", "libplugin_*.so*"), recursive=True):
                names.add(os.path.basename(path).split("libplugin_", 1)[1].split(".so")[0].split("-")[0])
        if not names:  # unknown layout: ask NIXL itself (creates a UCX-less agent)
            agent = api.nixl_agent(f"llmdd-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                                   api.nixl_agent_config(backends=[]))
            names = set(agent.get_plugin_list())
            del agent
        _plugin_cache = frozenset(names)
    return _plugin_cache


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(UcxTransport)


# --------------------------------------------------------------------------- batches


class _Xfer(Completion):
    """One batch: a list of NIXL requests (chunks), at most ``window`` in flight."""

    def __init__(self, ch: "UcxChannel", op: str, chunks: list, deadline: float, nbytes: int, nops: int,
                 local_ids: frozenset, remote_ids: frozenset) -> None:
        self._ch = ch
        self._agent = ch._ep._agent
        self._op = op
        self._chunks = chunks
        self._next = 0
        self._posted: list = []
        self._deadline = deadline
        self.nbytes = nbytes
        self.nops = nops
        self.local_ids = local_ids
        self.remote_ids = remote_ids
        self._window = max(1, int(ch._ep._cfg[OPT_INFLIGHT]))
        self._spin = float(ch._ep._cfg[OPT_SPIN_US]) * 1e-6
        self._drain_timeout = float(ch._ep._cfg[OPT_DRAIN_TIMEOUT])
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._error: Optional[TransportError] = None
        self._driver: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- driving

    def start(self) -> None:
        with self._lock:
            self._step()
        if not self._done.is_set() and self._next < len(self._chunks):
            self._driver = threading.Thread(target=self._drive, name="llmdd-ucx-xfer", daemon=True)
            self._driver.start()

    def _drive(self) -> None:
        backoff = _Backoff(self._spin)
        while not self._done.is_set():
            if self.poll():
                return
            backoff.pause(self._deadline)

    def poll(self) -> bool:
        """One non-blocking step; True once the batch is finished."""
        if self._done.is_set():
            return True
        if not self._lock.acquire(blocking=False):
            return self._done.is_set()
        try:
            if not self._done.is_set():
                self._step()
        finally:
            self._lock.release()
        return self._done.is_set()

    def _step(self) -> None:
        """Check posted requests, post more; fail on error or deadline (lock held)."""
        if time.monotonic() >= self._deadline:
            self._fail_locked(TransportTimeout("batch missed its deadline"))
            return
        agent = self._agent
        posted = self._posted
        still = []
        for i, h in enumerate(posted):
            try:
                st = agent.check_xfer_state(h)
            except Exception:  # noqa: BLE001 - treated like ERR
                st = "ERR"
            if st == "PROC":
                still.append(h)
            elif st == "DONE":
                agent.release_xfer_handle(h)
            else:
                self._posted = still + posted[i:]
                self._fail_locked(self._ch._transfer_error())
                return
        self._posted = still
        while self._next < len(self._chunks) and len(self._posted) < self._window:
            ldesc, rdesc = self._chunks[self._next]
            try:
                h = agent.initialize_xfer(self._op, agent.get_xfer_descs(ldesc, "DRAM"),
                                          agent.get_xfer_descs(rdesc, "DRAM"), self._ch._peer_name)
            except Exception as exc:  # noqa: BLE001
                self._fail_locked(self._ch._gone_error() or _nixl_error(exc, "creating the transfer"))
                return
            self._chunks[self._next] = None
            self._next += 1
            try:
                st = agent.transfer(h)
            except Exception as exc:  # noqa: BLE001
                self._posted.append(h)
                self._fail_locked(self._ch._gone_error() or _nixl_error(exc, "posting the transfer"))
                return
            if st == "DONE":
                agent.release_xfer_handle(h)
            elif st == "PROC":
                self._posted.append(h)
            else:
                self._posted.append(h)
                self._fail_locked(self._ch._transfer_error())
                return
        if self._next >= len(self._chunks) and not self._posted:
            self._finish(None)

    def _fail_locked(self, err: TransportError) -> None:
        """Post nothing more, drain every request still in flight, release, finish with ``err``."""
        self._next = len(self._chunks)
        self._chunks = []
        agent = self._agent
        end = time.monotonic() + self._drain_timeout
        backoff = _Backoff(self._spin)
        pending = self._posted
        while pending:
            left = []
            for h in pending:
                try:
                    st = agent.check_xfer_state(h)
                except Exception:  # noqa: BLE001 - a failed query means the request is over
                    st = "ERR"
                if st == "PROC":
                    left.append(h)
                else:
                    try:
                        agent.release_xfer_handle(h)
                    except Exception as exc:  # noqa: BLE001
                        _log.warning("llmdd.transport.ucx.release_failed", error=repr(exc))
            pending = left
            if pending:
                if time.monotonic() >= end:
                    # never release a request in flight (nixl#2067): keep it alive with the endpoint
                    self._ch._ep._stranded.extend(pending)
                    _log.error("llmdd.transport.ucx.drain_timeout", requests=len(pending))
                    err = PeerGone(f"{err}; {len(pending)} request(s) did not drain within "
                                   f"{self._drain_timeout:.0f}s")
                    break
                backoff.pause(end)
        self._posted = []
        self._finish(err)

    def _finish(self, err: Optional[TransportError]) -> None:
        if self._done.is_set():
            return
        self._error = err
        self._ch._batch_done(self, err)
        self._done.set()

    # ---------------------------------------------------------------- Completion API

    def fail(self, err: TransportError) -> None:
        """Fail (unless done) and drain; returns when no byte of the batch lands any more."""
        if self._done.is_set():
            return
        with self._lock:
            if not self._done.is_set():
                self._fail_locked(err)
        if self._driver is not None and self._driver is not threading.current_thread():
            self._driver.join()

    def done(self) -> bool:
        if self._driver is None:
            return self.poll()
        return self._done.is_set()

    def wait(self, timeout: Union[float, None] = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        backoff = _Backoff(self._spin)
        while True:
            if self._driver is None:
                if self.poll():
                    return True
            elif self._done.is_set():
                return True
            now = time.monotonic()
            if now >= self._deadline:
                self.fail(TransportTimeout("batch missed its deadline"))
                return True
            if end is not None and now >= end:
                return False
            if self._driver is not None:
                self._done.wait(min(x for x in (end, self._deadline, now + 0.05) if x is not None) - now)
            else:
                backoff.pause(min(self._deadline, end) if end is not None else self._deadline)

    @property
    def error(self) -> Union[TransportError, None]:
        return self._error if self._done.is_set() else None

    def cancel(self) -> None:
        self.fail(Cancelled("batch cancelled"))

    def touches(self, region_id: int) -> bool:
        """Whether the batch uses local region ``region_id`` (its deregistration fails the batch)."""
        return region_id in self.local_ids

    def __repr__(self) -> str:
        return f"<ucx batch {self._op} {self.nbytes} B {'done' if self._done.is_set() else 'running'}>"


class _Backoff:
    """Spin for a budget, then sleep 20 us doubling up to 1 ms: never starve the other core."""

    __slots__ = ("_spin_end", "_sleep")

    def __init__(self, spin_s: float) -> None:
        self._spin_end = time.monotonic() + spin_s
        self._sleep = 20e-6

    def pause(self, until: float) -> None:
        now = time.monotonic()
        if now < self._spin_end:
            return
        time.sleep(max(0.0, min(self._sleep, until - now)))
        self._sleep = min(self._sleep * 2, 1e-3)


# --------------------------------------------------------------------------- endpoint


class _LocalReg(RegisteredRegion):
    __slots__ = ("dlist", "gen")

    def __init__(self, region: MemRegion, dlist: Any, gen: int) -> None:
        super().__init__(region)
        self.dlist = dlist
        self.gen = gen


class UcxEndpoint(Endpoint):
    """One NIXL agent: registrations, the notification loop, channels to peers."""

    def __init__(self, *, host: str, cfg: Mapping[str, Any]) -> None:
        api = _nixl.load()
        self._cfg = dict(cfg)
        self._host = host
        self._name = f"llmdd-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        init = {}
        if self._cfg.get(OPT_DEVICES):
            init["ucx_devices"] = str(self._cfg[OPT_DEVICES])
        # NIXL's progress thread busy-polls the worker when UCX's transports cannot wake it (the
        # same-host shared-memory / cma transports have no event fd): a core per idle engine. Off by
        # default: requests are progressed by whoever waits on them (check_xfer_state) and the
        # notification loop below; cross-host UCX-over-tcp targets may want it (option = 1).
        conf = api.nixl_agent_config(enable_prog_thread=bool(int(self._cfg.get(OPT_PROGRESS_THREAD, 0))), backends=[],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            with _nixl.scoped_env(_ucx_env(self._cfg)):
                agent = api.nixl_agent(self._name, conf)
                agent.create_backend("UCX", init)
        except Exception as exc:  # noqa: BLE001
            raise Corrupt(f"could not create a NIXL agent with the UCX backend: {exc!r}") from None
        self._agent = agent
        self._lock = threading.RLock()
        self._closed = False
        self._regs: RegionRegistry[_LocalReg] = RegionRegistry(threading.Condition(self._lock),
                                                               on_rebuild=self._rebuild)
        self._gen = int.from_bytes(os.urandom(6), "little") << 8
        self._channels: set[UcxChannel] = set()
        self._by_peer: dict[str, set] = {}
        self._clients: dict[str, int] = {}
        self._waiters: dict[int, threading.Event] = {}
        self._stranded: list = []
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"regions": 0, "registered_bytes": 0, "clients": 0, "notifs_in": 0,
                                       "notifs_out": 0, "drains": 0, "control_timeouts": 0, "last_error": None}
        # what peers receive: the agent's connection info only (no region keys); a region's remote
        # key travels in its own descriptor, and only when the region is remote-accessible
        self._metadata = agent.get_partial_agent_metadata(
            api.nixlBind.nixlRegDList(agent.nixl_mems["DRAM"], np.empty((0, 3), np.uint64)), True)
        self._log = _log.bind(agent=self._name)
        self._stop = threading.Event()
        self._kick = threading.Event()  # wakes the notification loop early (a request awaits a reply, close)
        # owners' DRAIN/BYE are served off the notification loop by at most _OWNER_WORKERS threads
        # (started on demand), however many peers ask at once
        self._owner_requests = concurrent.futures.ThreadPoolExecutor(
            max_workers=_OWNER_WORKERS, thread_name_prefix="llmdd-ucx-drain")
        self._notif_thread = threading.Thread(target=self._notif_loop, name=f"llmdd-ucx-ctl-{self._name[-6:]}",
                                              daemon=True)
        self._notif_thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def agent_name(self) -> str:
        return self._name

    def describe(self) -> EndpointDescriptor:
        fields = EndpointFields(agent=self._name, metadata=bytes(self._metadata), host=self._host,
                                hostname=socket.gethostname(), pid=os.getpid())
        return EndpointDescriptor(transport="ucx", version=VERSION, payload=encode_payload(fields))

    def register(self, region: MemRegion) -> RegionDescriptor:
        with self._lock:
            if self._closed:
                raise Cancelled("endpoint is closed")
            self._regs.check_new(region.region_id)
            dlist = None
            partial = b""
            if region.size:
                try:
                    dlist = self._agent.register_memory(
                        np.array([[region.addr, region.size, 0]], dtype=np.uint64), "DRAM")
                    if region.remote_accessible:   # a key for peers only where they may reach it
                        partial = self._agent.get_partial_agent_metadata(dlist, False)
                except Exception as exc:  # noqa: BLE001
                    raise _nixl_error(exc, f"registering region {region.region_id}") from None
            self._gen += 1
            self._regs.add(_LocalReg(region, dlist, self._gen))
        fields = RegionFields(agent=self._name, region_id=region.region_id, addr=region.addr, size=region.size,
                              gen=self._gen, remote_accessible=region.remote_accessible, metadata=bytes(partial))
        return RegionDescriptor(transport="ucx", version=VERSION, payload=encode_payload(fields))

    def deregister(self, region_id: int) -> None:
        # this side: fail the batches touching it and drain them (requests in flight polled out)
        reg = self._regs.deregister(region_id)
        if reg is None:
            return
        # the owner side: every client refuses new ops on it and drains what touches it
        if reg.region.remote_accessible:
            self._broadcast(_proto.DRAIN, _proto.pack_region(region_id, reg.gen))
        with self._lock:
            self._stats["drains"] += 1
            if reg.dlist is not None and not self._closed:
                try:
                    self._agent.deregister_memory(reg.dlist)
                except Exception as exc:  # noqa: BLE001
                    self._log.warning("llmdd.transport.ucx.deregister_failed", region=region_id, error=repr(exc))

    def connect(self, peer: EndpointDescriptor, *, timeout: float) -> "UcxChannel":
        deadline = time.monotonic() + timeout
        if self._closed:
            raise Cancelled("endpoint is closed")
        fields = endpoint_fields(peer)
        try:
            name = self._agent.add_remote_agent(fields.metadata)
        except Exception as exc:  # noqa: BLE001
            raise PeerGone(f"cannot load the peer's NIXL metadata: {_nixl_error(exc, 'add_remote_agent')}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != fields.agent:
            raise Corrupt(f"peer metadata names agent {name!r}, description says {fields.agent!r}")
        ch = UcxChannel(self, name)
        with self._lock:
            self._channels.add(ch)
            self._by_peer.setdefault(name, set()).add(ch)
        try:
            ok = self._request(name, _proto.HELLO, self._metadata,
                               max(0.05, deadline - time.monotonic()))
        except TransportError:
            ok = False
        if not ok:
            ch._mark_gone(PeerGone(f"peer agent {name} did not answer the ucx handshake"), notify=False)
            ch.close()
            raise PeerGone(f"peer agent {name} did not answer the ucx handshake within {timeout:.1f}s")
        return ch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels)
        for ch in channels:
            ch.close()
        self._regs.close()   # what is left: cancel, then drain
        self._broadcast(_proto.BYE, b"")
        self._stop.set()
        self._kick.set()
        if self._notif_thread is not threading.current_thread():
            self._notif_thread.join(5.0)
        self._owner_requests.shutdown(wait=False)
        with self._lock:
            for reg in self._regs.entries.values():
                if reg.dlist is not None:
                    try:
                        self._agent.deregister_memory(reg.dlist)
                    except Exception as exc:  # noqa: BLE001
                        self._log.warning("llmdd.transport.ucx.deregister_failed", error=repr(exc))
            self._regs.entries.clear()
            self._regs.rebuild()
            if not self._stranded:
                self._agent = None  # the agent (and its UCX worker) goes with its last reference

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, agent=self._name, channels=len(self._channels), clients=len(self._clients),
                        stranded_requests=len(self._stranded), closed=self._closed)

    # ------------------------------------------------------------------ internals

    def _rebuild(self, regs: RegionRegistry) -> None:
        self._stats["regions"] = len(regs)
        self._stats["registered_bytes"] = sum(e.region.size for e in regs.entries.values())

    def _send(self, peer: str, kind: int, token: int, payload: bytes = b"") -> bool:
        try:
            self._agent.send_notif(peer, _proto.pack(kind, token, payload))
        except Exception as exc:  # noqa: BLE001 - a gone peer cannot be told anything
            self._log.info("llmdd.transport.ucx.notify_failed", peer=peer, error=repr(exc))
            return False
        with self._lock:
            self._stats["notifs_out"] += 1
        return True

    def _request(self, peer: str, kind: int, payload: bytes, timeout: float) -> bool:
        token = int.from_bytes(os.urandom(8), "little")
        ev = threading.Event()
        with self._lock:
            self._waiters[token] = ev
        self._kick.set()  # poll fast until the reply is in
        try:
            if not self._send(peer, kind, token, payload):
                return False
            return ev.wait(timeout)
        finally:
            with self._lock:
                self._waiters.pop(token, None)

    def _broadcast(self, kind: int, payload: bytes) -> None:
        """Send ``kind`` to every client and wait (bounded) for each one's acknowledgement.

        Every request leaves first, then one deadline covers every answer (the notification loop
        sets each waiter): no thread per client, however many peers are linked."""
        with self._lock:
            clients = list(self._clients)
        if not clients:
            return
        timeout = float(self._cfg[OPT_CONTROL_TIMEOUT])
        waits = {peer: (int.from_bytes(os.urandom(8), "little"), threading.Event()) for peer in clients}
        with self._lock:
            for token, ev in waits.values():
                self._waiters[token] = ev
        self._kick.set()  # poll fast until the replies are in
        results: dict[str, bool] = {}
        try:
            for peer, (token, _ev) in waits.items():
                if not self._send(peer, kind, token, payload):
                    results[peer] = False
            deadline = time.monotonic() + timeout
            for peer, (_token, ev) in waits.items():
                if peer not in results:
                    results[peer] = ev.wait(max(0.0, deadline - time.monotonic()))
        finally:
            with self._lock:
                for token, _ev in waits.values():
                    self._waiters.pop(token, None)
        silent = [p for p, ok in results.items() if not ok]
        if silent:
            with self._lock:
                for p in silent:
                    self._clients.pop(p, None)  # unreachable: it cannot post requests any more either
                self._stats["control_timeouts"] += len(silent)
            self._log.warning("llmdd.transport.ucx.client_silent", kind=kind, clients=silent)

    def _notif_loop(self) -> None:
        """Poll NIXL's notifications (which also progresses the worker): every 0.5 ms while a reply
        is awaited or messages arrive, backing off to ``notif_idle_ms`` when idle (no busy polling)."""
        idle = 0.0005
        longest = max(0.0005, float(self._cfg.get(OPT_NOTIF_IDLE_MS, 20.0)) / 1000.0)
        kick = self._kick
        while not self._stop.is_set():
            try:
                agent = self._agent
                notifs = agent.get_new_notifs() if agent is not None else {}
            except Exception as exc:  # noqa: BLE001
                self._log.warning("llmdd.transport.ucx.notif_failed", error=repr(exc))
                notifs = {}
            if not notifs:
                if self._waiters:
                    idle = 0.0005  # a request of ours awaits its reply
                kick.wait(idle)
                if kick.is_set():
                    kick.clear()
                    idle = 0.0005
                else:
                    idle = min(idle * 2, longest)
                continue
            idle = 0.0005
            for sender, msgs in notifs.items():
                sender = sender.decode() if isinstance(sender, bytes) else str(sender)
                for msg in msgs:
                    try:
                        self._on_notif(sender, msg)
                    except Exception as exc:  # noqa: BLE001 - a bad message never kills the loop
                        self._log.warning("llmdd.transport.ucx.bad_notif", peer=sender, error=repr(exc))

    def _on_notif(self, sender: str, msg: bytes) -> None:
        parsed = _proto.unpack(msg)
        if parsed is None:
            return
        kind, token, payload = parsed
        with self._lock:
            self._stats["notifs_in"] += 1
        if kind in (_proto.WELCOME, _proto.DRAINED, _proto.BYE_ACK, _proto.GOODBYE_ACK):
            with self._lock:
                ev = self._waiters.get(token)
            if ev is not None:
                ev.set()
        elif kind == _proto.HELLO:
            if self._closed:
                return
            try:
                self._agent.add_remote_agent(payload)
            except Exception as exc:  # noqa: BLE001
                self._log.warning("llmdd.transport.ucx.hello_failed", peer=sender, error=repr(exc))
                return
            with self._lock:
                self._clients[sender] = self._clients.get(sender, 0) + 1
                self._stats["clients"] = len(self._clients)
            self._send(sender, _proto.WELCOME, token)
        elif kind == _proto.GOODBYE:
            with self._lock:
                n = self._clients.get(sender, 0) - 1
                if n > 0:
                    self._clients[sender] = n
                else:
                    self._clients.pop(sender, None)
                self._stats["clients"] = len(self._clients)
            self._send(sender, _proto.GOODBYE_ACK, token)
        elif kind in (_proto.DRAIN, _proto.BYE):
            # served off the loop (draining polls NIXL and must not hold it up), on a bounded pool
            try:
                self._owner_requests.submit(self._serve_owner_request, sender, kind, token, payload)
            except RuntimeError as exc:  # closing, or no thread to be had: the owner counts us silent
                self._log.warning("llmdd.transport.ucx.owner_request_dropped", peer=sender, error=repr(exc))

    def _serve_owner_request(self, sender: str, kind: int, token: int, payload: bytes) -> None:
        with self._lock:
            channels = list(self._by_peer.get(sender, ()))
        if kind == _proto.DRAIN:
            region = _proto.unpack_region(payload)
            if region is None:
                return
            for ch in channels:
                ch._revoke(*region)
            self._send(sender, _proto.DRAINED, token)
        else:
            for ch in channels:
                ch._mark_gone(PeerGone(f"peer agent {sender} closed its endpoint"), notify=False)
            self._send(sender, _proto.BYE_ACK, token)

    def _forget_channel(self, ch: "UcxChannel") -> None:
        with self._lock:
            self._channels.discard(ch)
            peers = self._by_peer.get(ch._peer_name)
            if peers is not None:
                peers.discard(ch)
                if not peers:
                    self._by_peer.pop(ch._peer_name, None)


# --------------------------------------------------------------------------- channel


class _Remote:
    __slots__ = ("size", "addr", "dev", "gen", "accessible")

    def __init__(self, size: int, addr: int, dev: int, gen: int, accessible: bool) -> None:
        self.size, self.addr, self.dev, self.gen, self.accessible = size, addr, dev, gen, accessible


class UcxChannel(Channel):
    """Requests from the local agent to one peer agent."""

    def __init__(self, endpoint: UcxEndpoint, peer_name: str) -> None:
        self._ep = endpoint
        self._peer_name = peer_name
        self._lock = threading.RLock()
        self._remote: dict[int, _Remote] = {}
        self._table = RegionTable()
        self._ids = np.empty(0, np.int64)
        self._addrs = np.empty(0, np.uint64)
        self._devs = np.empty(0, np.uint64)
        self._gone: Optional[TransportError] = None
        self._batches: BatchSet[_Xfer] = BatchSet(threading.Condition(self._lock))
        # int counters, and last_error (str or None)
        self._stats: dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "ops_read": 0, "ops_written": 0,
                                       "batches": 0, "requests": 0, "failed": 0, "refused": 0, "last_error": None}

    # ------------------------------------------------------------------ public API

    def add_remote_region(self, region_id: int, size: int, desc: RegionDescriptor) -> None:
        fields = region_fields(desc)
        if fields.agent != self._peer_name:
            raise Refused(f"descriptor of region {region_id} belongs to another endpoint")
        md = fields.metadata
        if md:
            try:  # the region's remote key (registered after the link may have been made)
                self._ep._agent.add_remote_agent(bytes(md))
            except Exception as exc:  # noqa: BLE001
                raise _nixl_error(exc, f"loading the key of remote region {region_id}") from None
        r = _Remote(min(int(size), fields.size), fields.addr, fields.dev_id, fields.gen, fields.remote_accessible)
        with self._lock:
            self._remote[int(region_id)] = r
            self._rebuild()

    def remove_remote_region(self, region_id: int) -> None:
        with self._lock:
            self._remote.pop(int(region_id), None)
            self._rebuild()

    def read(self, ops: np.ndarray, *, deadline: float) -> Completion:
        # the seam's one refusal path: a refusal or failure is the completion's error, never raised
        try:
            return self._submit("READ", ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def write(self, ops: np.ndarray, *, deadline: float) -> Completion:
        try:
            return self._submit("WRITE", ops, deadline)
        except TransportError as exc:
            return DoneCompletion(exc)

    def close(self) -> None:
        if not self._batches.close(Cancelled("channel closed")):   # fail the batches in flight, drain them
            return
        if self._gone is None and self._ep._agent is not None:
            self._ep._request(self._peer_name, _proto.GOODBYE, b"", float(self._ep._cfg[OPT_CONTROL_TIMEOUT]))
        self._ep._forget_channel(self)

    def statistics(self) -> dict:
        with self._lock:
            return dict(self._stats, peer=self._peer_name, remote_regions=len(self._remote),
                        closed=self._batches.closed, gone=self._gone is not None)

    # ------------------------------------------------------------------ internals

    def _rebuild(self) -> None:
        ids = sorted(i for i, r in self._remote.items() if r.accessible)
        self._table = RegionTable({i: self._remote[i].size for i in ids},
                                  private=[i for i, r in self._remote.items() if not r.accessible])
        self._ids = np.array(ids, dtype=np.int64)
        self._addrs = np.array([self._remote[i].addr for i in ids], dtype=np.uint64)
        self._devs = np.array([self._remote[i].dev for i in ids], dtype=np.uint64)

    def _gone_error(self) -> Optional[TransportError]:
        return self._gone

    def _transfer_error(self) -> TransportError:
        """What a request in state ERR means: with UCX's peer error handling, a lost peer."""
        return self._gone or PeerGone(f"transfer to {self._peer_name} failed (peer unreachable or gone)")

    def _revoke(self, region_id: int, gen: int) -> None:
        with self._lock:
            r = self._remote.get(region_id)
            if r is not None and r.gen == gen:
                del self._remote[region_id]
                self._rebuild()
            touching = self._batches.matching(lambda b: region_id in b.remote_ids)
        for b in touching:
            b.fail(Cancelled(f"remote region {region_id} was deregistered by its owner"))

    def _mark_gone(self, err: TransportError, *, notify: bool) -> None:
        with self._lock:
            if self._gone is None:
                self._gone = err
            active = list(self._batches)
        for b in active:
            b.fail(err)

    def _batch_done(self, batch: _Xfer, err: Optional[TransportError]) -> None:
        self._ep._regs.untrack(batch)   # not under the channel's lock: _submit takes the endpoint's first
        with self._lock:
            self._batches.discard_locked(batch)
            self._stats["batches"] += 1
            if err is None:
                key = "read" if batch._op == "READ" else "written"
                self._stats[f"bytes_{key}"] += batch.nbytes
                self._stats[f"ops_{key}"] += batch.nops
            else:
                self._stats["failed"] += 1
                self._stats["last_error"] = str(err)

    def _submit(self, op: str, ops: np.ndarray, deadline: float) -> Completion:
        ep = self._ep
        with ep._lock, self._lock:
            if self._batches.closed or ep._closed:
                raise Cancelled("channel closed")
            try:
                arr = check_ops(ops, ep._regs.table, self._table)
            except Refused as exc:
                self._stats["refused"] += 1
                self._stats["last_error"] = str(exc)
                raise
            if self._gone is not None:
                return DoneCompletion(self._gone)
            if time.monotonic() >= deadline:
                return DoneCompletion(TransportTimeout("deadline passed before the batch started"))
            arr = coalesce_ops(arr)
            if not len(arr):
                return DoneCompletion(None)
            lpos = np.searchsorted(ep._regs.ids, arr["local_region"].astype(np.int64))
            rpos = np.searchsorted(self._ids, arr["remote_region"].astype(np.int64))
            n = len(arr)
            ldesc = np.empty((n, 3), dtype=np.uint64)
            rdesc = np.empty((n, 3), dtype=np.uint64)
            np.add(ep._regs.addrs[lpos], arr["local_offset"], out=ldesc[:, 0])
            ldesc[:, 1] = arr["length"]
            ldesc[:, 2] = 0
            np.add(self._addrs[rpos], arr["remote_offset"], out=rdesc[:, 0])
            rdesc[:, 1] = arr["length"]
            rdesc[:, 2] = self._devs[rpos]
            total = int(arr["length"].sum(dtype=np.uint64))
            chunks = _chunk(ldesc, rdesc, int(ep._cfg[OPT_CHUNK_BYTES]), int(ep._cfg[OPT_CHUNK_DESCS]))
            batch = _Xfer(self, op, chunks, deadline, total, len(arr),
                          frozenset(np.unique(arr["local_region"]).tolist()),
                          frozenset(np.unique(arr["remote_region"]).tolist()))
            self._batches.add(batch)
            ep._regs.track(batch)   # the endpoint's deregistration / close fails it
            self._stats["requests"] += len(chunks)
            # posted under the locks: a DRAIN/deregistration either sees this batch or refuses it
            batch.start()
        return batch


def _chunk(ldesc: np.ndarray, rdesc: np.ndarray, max_bytes: int, max_descs: int) -> list:
    """Cut descriptor arrays into consecutive pieces of at most ``max_bytes`` / ``max_descs``.

    A single descriptor larger than ``max_bytes`` is split too, so that a drain after cancel or
    deadline waits for at most ``inflight x max_bytes`` of traffic.
    """
    lens = ldesc[:, 1]
    if int(lens.max()) > max_bytes:
        reps = ((lens + np.uint64(max_bytes - 1)) // np.uint64(max_bytes)).astype(np.int64)
        idx = np.repeat(np.arange(len(lens)), reps)
        first = np.concatenate(([0], np.cumsum(reps)[:-1]))
        k = (np.arange(len(idx)) - np.repeat(first, reps)).astype(np.uint64)
        off = k * np.uint64(max_bytes)
        piece = np.minimum(lens[idx] - off, np.uint64(max_bytes))
        ldesc = np.stack([ldesc[idx, 0] + off, piece, ldesc[idx, 2]], axis=1)
        rdesc = np.stack([rdesc[idx, 0] + off, piece, rdesc[idx, 2]], axis=1)
        lens = piece
    if len(lens) <= max_descs and int(lens.sum(dtype=np.uint64)) <= max_bytes:
        return [(ldesc, rdesc)]
    ends = np.cumsum(lens, dtype=np.uint64)
    out = []
    start = 0
    n = len(lens)
    while start < n:
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + max_bytes, side="right"))
        stop = min(max(stop, start + 1), n, start + max_descs)
        out.append((np.ascontiguousarray(ldesc[start:stop]), np.ascontiguousarray(rdesc[start:stop])))
        start = stop
    return out
