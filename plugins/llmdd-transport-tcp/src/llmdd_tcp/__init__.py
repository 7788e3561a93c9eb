"""llmdd transport ``tcp``: a one-sided client/server engine over TCP.

Every endpoint listens on ``host:0`` (ephemeral port, bound to the given host only) and
serves READ and WRITE requests against *its own* registered regions: the owner checks
region id, bounds and the remote-accessible flag of every op (vectorised, all or nothing)
before a byte moves, and refuses the whole request otherwise. The peer's memory is never
addressed directly, which is the trust level of this transport: the owner mediates every op.

Wire (little endian, one request at a time per stream):

* connect: server ``HELLO(magic, version, auth, endpoint_id[16], nonce_s[16])``; the client
  answers ``OPEN(nonce_c[16], handle[16], HMAC(key, "c"|id|nonce_s|nonce_c))`` where ``cap`` is
  the capability the owner granted to the client's link (``Endpoint.grant``; it reached the client
  inside the owner's descriptor, over the link's control connection), ``handle =
  SHA256("llmdd-tcp-handle"|cap)[:16]`` names the grant and ``key`` is ``cap`` itself, or
  ``HMAC(secret, "llmdd-tcp-key"|cap)`` with a shared secret.  The owner answers
  ``OPEN_RSP(0, HMAC(key, "s"|id|nonce_c|nonce_s))`` and from then on serves that stream for that
  grant only (its link live, its regions only), or ``OPEN_RSP(1, 0)`` and closes.  Neither the
  capability nor the secret is ever sent on a data connection.
* request: ``REQ(magic, kind, count, total)`` + ``count`` packed ``(region u4, offset u8,
  length u8)``; a segment carries at most ``segment_bytes`` of payload.
* READ: ``RSP(ok)`` + the bytes of every op in order, or ``RSP(refused, reason)``.
* WRITE: ``RSP(go)`` or ``RSP(refused)``; after go the client sends exactly ``total`` bytes,
  which the owner receives straight into the validated destinations; then ``RSP(ok)``. The
  owner never reads more than announced, and never reads before validating, so a WRITE can
  not overfill it; bytes in flight are capped by the segment size plus the socket buffers.
* additions (compatible both ways; see :mod:`._wire`): the HELLO's former pad byte carries the
  owner's features (``FEAT_QUICK``); request flags ``F_PAD`` (a READ's OK header padded to 16 bytes;
  towards a ``FEAT_QUICK`` owner every answer padded to a multiple of 16 and a WRITE's ops followed by
  zeros up to one) and ``F_EAGER`` (towards a ``FEAT_QUICK`` owner: a WRITE's payload follows the
  request at once; one answer, ``RSP(ok)``, or ``RSP(refused)`` and the payload read and dropped).  The
  channel's one-call small-transfer path (:mod:`._quick`) uses them.

TLS: with ``llmdd.tls_*`` options (the engine's, which reach every transport) every data connection
is TLS first, built by :func:`llmdd._base.options.tls_config` as the engine's control connections are: mutual
with a CA, the server name checked as ``llmdd.tls_server_name`` says, refused without a CA unless
``llmdd.tls_insecure``.  The wire above is unchanged inside TLS.  ``describe()`` says ``tls``; a channel
refuses, before connecting, a peer whose ``tls`` differs from its own (no silent plaintext).  The
server runs the handshake on the I/O loop under the pending timer and caps; a failed one is counted
(``tls_failures``), logged and closed.

Data moves with ``sendmsg`` / ``recvmsg(MSG_WAITALL)`` (libc, through ctypes: the GIL is released)
over one ``struct iovec`` array per request, built from the numpy op arrays with numpy (region base
addresses by ``np.searchsorted``, plus offsets) and handed over IOV_MAX entries at a time: no copy
through ``bytes`` and no Python object per op. Large batches are coalesced and split over two streams.  Over TLS (no
``sendmsg``, no flags on receive, no ``MSG_PEEK``) the same windows go out as staged buffers of up
to 256 KiB (small ops) or slices of that size (large ones) and come in with ``recv_into`` straight
into the destinations; the loop notices a request by taking its first byte.  Deadlines on TLS
streams are Python socket timeouts (under ``SO_RCVTIMEO`` a blocking SSL read would retry forever).

Cancellation and deadlines: streams are blocking sockets armed with ``SO_RCVTIMEO`` /
``SO_SNDTIMEO`` set to the time left; cancel, deadline, close and deregistration shut the
sockets down and join the worker threads before the completion reports its error.

Serving: one I/O loop per endpoint (:class:`llmdd._runtime.ioloop.IoLoop`) accepts, runs the HELLO/AUTH
exchange without blocking and watches idle streams; a stream with a request waiting is served
by one of a bounded pool of workers (``llmdd.tcp.server_workers``), which keeps it while requests
follow each other closely (``llmdd.tcp.linger_ms``) and then hands it back to the loop.  No thread
waits on an idle stream.  A stream that has not proven it belongs to a link (a valid OPEN for a live
grant) within ``llmdd.tcp.pending_timeout_ms`` (10 s) is closed; at most ``llmdd.max_pending_connections`` (64)
such streams per endpoint and ``llmdd.max_pending_per_address`` (8) per source address are held;
past the per-address cap the next one is closed at once, and with every slot taken a newcomer from
an address holding fewer takes the place of the busiest address's oldest (else it is closed at once).

Grants (the trust boundary): the engine's link manager calls :meth:`TcpEndpoint.serve_links_only`
right after opening the endpoint, then :meth:`~TcpEndpoint.grant` once per link and incarnation with
a fresh 256-bit capability and the regions it announced to that link, and
:meth:`~TcpEndpoint.revoke` when the link ends (unlink, failure, replacement by a restarted peer,
finalize).  A stream serves one grant: every request is checked against the remote-accessible
regions *and* the grant's regions, and dies with the grant.  An endpoint used directly (tests,
``llmdd doctor``) serves the holders of its ``describe()``, which then carries an endpoint-wide
capability.

Modules, one concept each: this one the transport and its registration; ``_endpoint``
(:class:`TcpEndpoint`: the data port's owner, its registry, grants and serving); ``_server`` (one accepted
stream on the I/O loop); ``_request`` (the owner's reading of a request); ``_few`` (the owner's few-ops
path, plain Python); ``_channel`` (:class:`TcpChannel`: the client side); ``_quick`` (the channel's
one-call small transfers, issue 21); ``_grants`` (capability
handles, MAC keys, the owner's record of a grant); ``_wire`` (the messages and an answer's framing);
``_native`` and ``_tcpfast.c`` (the C hot path: a client's one-call transfer, the owner's serving of small
requests; the pure-Python path where it is absent); ``_io`` (a request's bytes on a plain socket: iovec arrays through ``sendmsg`` / ``recvmsg``); ``_tls_io``
(a request's bytes over TLS: staging); ``_sock`` (blocking-socket helpers); ``_descriptors`` (the
descriptor payloads); ``_options`` (options and defaults).
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Mapping, Union

from llmdd.abc import Transport, TransportInfo
from llmdd.lowlevel import Refused, tls_config
from llmdd.plugin import hookimpl

from ._channel import TcpChannel
from ._descriptors import EndpointFields, RegionFields, endpoint_fields, region_fields
from ._endpoint import TcpEndpoint
from ._io import WINDOW
from ._native import ENV_NATIVE, NATIVE_ABI, NATIVE_REASON, data_path, native
from ._options import DEFAULTS, OPT_NATIVE
from ._wire import VERSION

__all__ = ["TcpTransport", "TcpEndpoint", "TcpChannel", "EndpointFields", "RegionFields", "endpoint_fields",
           "region_fields", "hookimpl", "llmdd_register_transports", "data_path", "OPT_NATIVE", "NATIVE_ABI",
           "ENV_NATIVE", "NATIVE_REASON"]


class TcpTransport(Transport):
    """Any host to any host over TCP; the owner mediates every op."""

    name = "tcp"
    priority = 10
    same_host_only = False
    authenticates = True

    @classmethod
    def probe(cls) -> TransportInfo:
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.close()
        except OSError as exc:
            return TransportInfo(name=cls.name, available=False, reason=f"no TCP sockets: {exc}")
        if not hasattr(socket.socket, "recvmsg_into"):
            return TransportInfo(name=cls.name, available=False, reason="socket.recvmsg_into is not available")
        return TransportInfo(name=cls.name, available=True, reason="",
                             details={"version": VERSION, "window": WINDOW, "data_path": data_path()})

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)
        self._cfg = {k: type(v)(self.options.get(k, v)) for k, v in DEFAULTS.items()}
        mode = str(self._cfg[OPT_NATIVE]).strip().lower()
        if mode not in ("auto", "on", "off"):
            raise Refused(f"{OPT_NATIVE} must be auto, on or off, got {self._cfg[OPT_NATIVE]!r}")
        if mode == "on" and native is None:
            raise Refused(f"{OPT_NATIVE}=on but the C hot path is unavailable: {NATIVE_REASON}")
        self._cfg[OPT_NATIVE] = mode
        # the engine's options reach every transport: with llmdd.tls_* set, data connections use TLS
        # under the same policy as the engine's control connections (llmdd._base.options.tls_config)
        self._tls = tls_config(self.options)
        if self._tls is not None:
            self._tls.server.num_tickets = 0   # no session tickets: nothing unasked-for on an idle stream

    def open_endpoint(self, *, host: str = "127.0.0.1", secret: Union[bytes, None] = None) -> "TcpEndpoint":
        return TcpEndpoint(host=host, secret=secret, cfg=self._cfg, tls=self._tls)


@hookimpl
def llmdd_register_transports(register: Callable[[type], Any]) -> None:
    register(TcpTransport)
