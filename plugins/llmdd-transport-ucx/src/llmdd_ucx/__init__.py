"""llmdd transport ``ucx``: one-sided READ/WRITE through UCX, driven by NVIDIA NIXL's Python API.

Where the hardware exists UCX runs RDMA (InfiniBand/RoCE); on this kind of host it picks
``cma`` (``process_vm_readv``) between processes of one host, and ``tcp`` otherwise. NIXL is
imported lazily (``probe()`` / first endpoint), never at import: without NIXL the plugin still
registers and ``probe()`` says why it is unavailable.

Shape
-----
* One ``nixl_agent`` per endpoint (unique name ``llmdd-<pid>-<random>``), UCX backend, thread-safe:
  ``NIXL_THREAD_SYNC_RW`` with ``llmdd.ucx.threads`` UCX workers (default 2), or
  ``NIXL_THREAD_SYNC_STRICT`` and one worker with ``threads=1``.
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
  is polled by the caller (``wait``/``done``); a longer one gets a driver thread. A batch of at
  least ``llmdd.ucx.split_min_bytes`` is cut by bytes into parts run by ``llmdd.ucx.threads``
  posting threads, each on a UCX worker of its own (:mod:`._lanes`): two cores where UCX runs each
  get in the post call (cma).
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

Modules
-------
This package holds the transport class and the plugin hook; each other piece is one module:
:mod:`._options` (option names, defaults, the UCX environment they map to), :mod:`._fields` (the
descriptors' payloads), :mod:`._nixl` (lazy NIXL access, NIXL's errors as typed ones), :mod:`._proto`
(the control messages), :mod:`._endpoint` (the agent, registrations, the notification loop),
:mod:`._channel` (ops checked and turned into descriptor arrays), :mod:`._xfer` (one batch's
NIXL requests: chunking, the in-flight window, completion and drain) and :mod:`._lanes` (a large
batch split across the endpoint's posting threads).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Mapping, Optional, Union

from llmdd.abc import Transport, TransportInfo
from llmdd.plugin import hookimpl

from . import _nixl
from ._channel import UcxChannel
from ._endpoint import UcxEndpoint
from ._fields import VERSION, EndpointFields, RegionFields, endpoint_fields, region_fields
from ._options import OPT_CHUNK_BYTES as OPT_CHUNK_BYTES
from ._options import OPT_CHUNK_DESCS as OPT_CHUNK_DESCS
from ._options import OPT_CONTROL_TIMEOUT as OPT_CONTROL_TIMEOUT
from ._options import OPT_DEVICES as OPT_DEVICES
from ._options import OPT_DRAIN_TIMEOUT as OPT_DRAIN_TIMEOUT
from ._options import OPT_INFLIGHT as OPT_INFLIGHT
from ._options import OPT_NOTIF_IDLE_MS as OPT_NOTIF_IDLE_MS
from ._options import OPT_PROGRESS_THREAD as OPT_PROGRESS_THREAD
from ._options import OPT_SPIN_US as OPT_SPIN_US
from ._options import OPT_SPLIT_MIN as OPT_SPLIT_MIN
from ._options import OPT_THREADS as OPT_THREADS
from ._options import OPT_TLS as OPT_TLS
from ._options import DEFAULTS, OPT_SERVICE_LEVEL, OPT_TRAFFIC_CLASS

__all__ = ["UcxTransport", "UcxEndpoint", "UcxChannel", "EndpointFields", "RegionFields", "endpoint_fields",
           "region_fields", "hookimpl", "llmdd_register_transports"]


_INIT_AGENT = "NIXL_INIT_AGENT"
#: what makes ucx available where this plugin is installed without NIXL (``llmdd info`` / ``llmdd doctor`` say it)
NIXL_FIX = ("pip install --no-deps nixl-cu12 (NIXL, this transport's engine: `llmdd[ucx]` and `llmdd[all]` do not "
            "pull it in, because its wheel requires torch and CUDA wheels that llmdd does not need)")


class UcxTransport(Transport):
    """Any host: UCX through NIXL. Preferred over tcp (10), below same-host shm (100)."""

    name = "ucx"
    priority = 50
    same_host_only = False

    @classmethod
    def probe(cls) -> TransportInfo:
        try:
            api = _nixl.load()
        except ImportError as exc:   # `llmdd[ucx]`/`llmdd[all]` bring this plugin, not NIXL (it requires torch+CUDA)
            return TransportInfo(name=cls.name, available=False, reason=str(exc),
                                 details={"fix": NIXL_FIX})
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
        cfg = {k: type(v)(self.options.get(k, v)) for k, v in DEFAULTS.items()}
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
