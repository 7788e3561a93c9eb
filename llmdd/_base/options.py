"""Engine options: the injection and checks ``LLMDataDist.init`` performs (spec section 4.1),
and typed access to the option keys the engine reads."""

from __future__ import annotations

import ipaddress
import ssl
from typing import Mapping, Optional, overload

import attrs

from llmdd._base.enums import ROLE_TO_STR, LLMRole
from llmdd._base.ranktable import parse_local_comm_res
from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["EngineOptions", "prepare_engine_options", "parse_listen_ip_info", "DEFAULT_SYNC_KV_TIMEOUT_MS",
           "TlsConfig", "tls_config"]

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000

K_ROLE = "llm.Role"
K_LOCAL_COMM_RES = "llm.LocalCommRes"
K_TRANSFER_BACKEND = "llm.TransferBackend"
K_CACHE_MANAGER = "llm.EnableCacheManager"
K_REMOTE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
K_LISTEN_IP_INFO = "llm.listenIpInfo"
K_LISTEN_IP = "llm.ListenIp"
K_LISTEN_PORT = "llm.ListenPort"
K_SYNC_KV = "llm.SyncKvCacheWaitTime"
K_FLOW_GRAPH_MEM = "ge.flowGraphMemMaxSize"
#: llmdd's TLS keys (docs/configuration.md): one policy for control connections and tcp data connections
K_TLS_CERT = "llmdd.tls_cert"
K_TLS_KEY = "llmdd.tls_key"
K_TLS_CA = "llmdd.tls_ca"
#: TLS with a certificate but no CA verifies no peer: refused at init unless this says "1"/"true"
K_TLS_INSECURE = "llmdd.tls_insecure"
#: the name a client checks the server's certificate against (besides a target host given as a name)
K_TLS_SERVER_NAME = "llmdd.tls_server_name"


def _param_invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


#: :func:`ip_port_problem`'s answer for an address not of the form ip:port (a port out of range has another)
NOT_IP_PORT = "must be in the form ip:port"


def ip_port_problem(value: object) -> str:
    """What is wrong with an ``"ip:port"`` address ("" when nothing): not of that form, or a port out of range."""
    if not isinstance(value, str) or value.count(":") != 1:
        return NOT_IP_PORT
    ip, port_text = value.split(":")
    if not ip or not port_text.isdigit():
        return NOT_IP_PORT
    if int(port_text) > 65535:
        return f"has port {int(port_text)}, out of range (a port is 0..65535)"
    return ""


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    """``"ip:port"`` with exactly one ``:``; the ip must be an IPv4 address or a host name."""
    problem = ip_port_problem(value)
    if problem:
        raise _param_invalid(f"llm.listenIpInfo {problem}, but got {value!r}.")
    ip, port_text = value.split(":")
    return ip, int(port_text)


def _check_flow_graph_max_size(options: Mapping[str, str]) -> None:
    if K_FLOW_GRAPH_MEM not in options:
        return
    value = options[K_FLOW_GRAPH_MEM]
    if not isinstance(value, str):
        raise TypeError(f"{K_FLOW_GRAPH_MEM} only support ['str'], but got {type(value)}.")
    if "," in value or not value.isdigit():
        raise _param_invalid(f"{K_FLOW_GRAPH_MEM} must be a single pool size in digits, but got {value!r}.")


def prepare_engine_options(options: Mapping[str, str], role: LLMRole) -> dict[str, str]:
    """Copy ``options`` and apply the injections and checks of upstream's ``_setup_engine_option``."""
    opts = dict(options)
    opts[K_ROLE] = ROLE_TO_STR[role]
    local_comm_res = K_LOCAL_COMM_RES in opts
    transfer_backend = K_TRANSFER_BACKEND in opts
    if local_comm_res:
        opts.setdefault(K_CACHE_MANAGER, "1")
        opts.setdefault(K_REMOTE_ACCESSIBLE, "1")
    cache_mode = opts.get(K_CACHE_MANAGER) == "1"
    if local_comm_res and not cache_mode:
        raise _param_invalid("llm.LocalCommRes is not supported when llm.EnableCacheManager is not configured.")
    if transfer_backend:
        if not cache_mode:
            raise _param_invalid("llm.TransferBackend requires llm.EnableCacheManager to be 1.")
        opts.setdefault(K_REMOTE_ACCESSIBLE, "1")
        if opts[K_REMOTE_ACCESSIBLE] != "1":
            raise _param_invalid("llm.TransferBackend requires llm.EnableRemoteCacheAccessible to be 1.")
        if K_LISTEN_IP_INFO not in opts:
            raise _param_invalid("llm.TransferBackend requires llm.listenIpInfo to be configured.")
    if cache_mode and K_LISTEN_IP_INFO in opts:
        ip, port = parse_listen_ip_info(opts[K_LISTEN_IP_INFO])
        opts[K_LISTEN_IP] = ip
        opts[K_LISTEN_PORT] = str(port)
    _check_flow_graph_max_size(opts)
    return opts


@overload
def _int_option(opts: Mapping[str, str], key: str, default: int, low: int, high: int) -> int: ...
@overload
def _int_option(opts: Mapping[str, str], key: str, default: None, low: int, high: int) -> int | None: ...
def _int_option(opts: Mapping[str, str], key: str, default: int | None, low: int, high: int) -> int | None:
    if key not in opts:
        return default
    text = opts[key]
    if not isinstance(text, str) or not text.strip().lstrip("-").isdigit():
        raise _param_invalid(f"option {key} must be an integer string, but got {text!r}.")
    value = int(text)
    if not low <= value <= high:
        raise _param_invalid(f"option {key}={value} is out of range [{low}, {high}].")
    return value


_U32_MAX = 2**32 - 1


def _rdma_options(opts: Mapping[str, str]) -> tuple[int | None, int | None]:
    """``llm.RdmaTrafficClass`` / ``llm.RdmaServiceLevel`` bounded as upstream bounds them per mode.

    Upstream's default link managers read both as unsigned 32-bit numbers and pass them to the
    comm library; only the hixl backend (``llm.TransferBackend`` = ``hixl``) bounds them: traffic
    class in [0, 255] and a multiple of 4, service level in [0, 7].  llmdd has no RDMA NIC to
    give them to; they are checked and kept.
    """
    tc = _int_option(opts, "llm.RdmaTrafficClass", None, 0, _U32_MAX)
    sl = _int_option(opts, "llm.RdmaServiceLevel", None, 0, _U32_MAX)
    if opts.get(K_TRANSFER_BACKEND) == "hixl":
        if tc is not None and (tc > 255 or tc % 4):
            raise _param_invalid(f"option llm.RdmaTrafficClass={tc} is invalid with the hixl transfer backend: "
                                 "it must be in [0, 255] and a multiple of 4.")
        if sl is not None and sl > 7:
            raise _param_invalid(f"option llm.RdmaServiceLevel={sl} is invalid with the hixl transfer backend: "
                                 "it must be in [0, 7].")
    return tc, sl


def _check_device_ids(opts: Mapping[str, str]) -> None:
    """``ge.exec.deviceId``, when given, is one device id or several separated by ``;`` (upstream
    parses each as a number at init and refuses the options otherwise)."""
    if "ge.exec.deviceId" not in opts:
        return
    text = opts["ge.exec.deviceId"]
    items = text.split(";") if isinstance(text, str) else None
    if not items or not all(item.isdigit() and int(item) < 2**31 for item in items):
        raise _param_invalid(f"option ge.exec.deviceId={text!r} is invalid: it should be composed of numbers, "
                             "separated by semicolons.")


@attrs.frozen(kw_only=True)
class EngineOptions:
    """The options an initialized engine reads, parsed and checked once at ``init``."""

    raw: Mapping[str, str]
    role: LLMRole
    cache_mode: bool
    remote_cache_accessible: bool
    sync_kv_timeout_ms: int
    listen: tuple[str, int] | None
    local_comm_res: str | None
    transfer_backend: str | None
    link_total_time_s: int | None
    link_retry_count: int | None
    rdma_traffic_class: int | None
    rdma_service_level: int | None

    @classmethod
    def parse(cls, opts: Mapping[str, str], role: LLMRole) -> "EngineOptions":
        listen = None
        if K_LISTEN_IP in opts:
            listen = (opts[K_LISTEN_IP], int(opts[K_LISTEN_PORT]))
        local_comm_res = opts.get(K_LOCAL_COMM_RES)
        if local_comm_res is not None:
            if not isinstance(local_comm_res, str):
                raise TypeError(f"{K_LOCAL_COMM_RES} only support ['str'], but got {type(local_comm_res)}.")
            parse_local_comm_res(local_comm_res)  # "" (auto) or a valid 1.0/1.2/1.3 JSON, else LLM_PARAM_INVALID
        _check_device_ids(opts)
        rdma_tc, rdma_sl = _rdma_options(opts)
        return cls(
            raw=dict(opts),
            role=role,
            cache_mode=opts.get(K_CACHE_MANAGER) == "1",
            remote_cache_accessible=opts.get(K_REMOTE_ACCESSIBLE, "0") == "1",
            sync_kv_timeout_ms=_int_option(opts, K_SYNC_KV, DEFAULT_SYNC_KV_TIMEOUT_MS, 1, 2**31 - 1),
            listen=listen,
            local_comm_res=opts.get(K_LOCAL_COMM_RES),
            transfer_backend=opts.get(K_TRANSFER_BACKEND),
            link_total_time_s=_int_option(opts, "llm.LinkTotalTime", None, 0, 2**32 - 1),
            link_retry_count=_int_option(opts, "llm.LinkRetryCount", None, 1, 100),
            rdma_traffic_class=rdma_tc,
            rdma_service_level=rdma_sl,
        )


def is_local_address(ip: str) -> bool:
    """True when ``ip`` names this machine (loopback, wildcard, or a local interface)."""
    import socket

    try:
        addr = ipaddress.ip_address(socket.gethostbyname(ip))
    except (OSError, ValueError):
        return False
    if addr.is_loopback or addr.is_unspecified:
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((str(addr), 0))
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- TLS


@attrs.frozen(kw_only=True)
class TlsConfig:
    """The TLS contexts that the ``llmdd.tls_*`` options make: the engine's link manager wraps its
    control connections with them and the tcp transport (which gets the same options) its data
    connections, so both follow one policy."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    client_named: Optional[ssl.SSLContext]   # the client context that checks host names (with a CA)
    server_name: Optional[str]

    def wrap_client(self, sock, host: str, **kwargs):
        """TLS on a connected client socket: the server's certificate must name ``server_name`` when
        it is set, else ``host`` when that is a name rather than an IP literal (with a CA only)."""
        name = self.server_name
        if name is None and self.client_named is not None and not is_ip_literal(host):
            name = host
        if name is not None and self.client_named is not None:
            return self.client_named.wrap_socket(sock, server_hostname=name, **kwargs)
        return self.client.wrap_socket(sock, **kwargs)


def _truthy(value) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def tls_config(raw: Mapping[str, str]) -> Optional[TlsConfig]:
    """The :class:`TlsConfig` of ``raw`` options, ``None`` without TLS options; raises
    ``LLM_PARAM_INVALID`` for TLS that would verify no peer (no CA) unless ``llmdd.tls_insecure``
    says so, for a server name without a CA, and for files that do not load."""
    cert, key, ca = raw.get(K_TLS_CERT) or None, raw.get(K_TLS_KEY) or None, raw.get(K_TLS_CA) or None
    server_name = raw.get(K_TLS_SERVER_NAME) or None
    if (cert or ca) and not ca and not _truthy(raw.get(K_TLS_INSECURE)):
        raise _param_invalid(f"TLS is configured ({K_TLS_CERT}) without a CA ({K_TLS_CA}): no peer would be "
                             f"verified; give a CA, or set {K_TLS_INSECURE}=1 to accept that")
    if server_name and not ca:
        raise _param_invalid(f"{K_TLS_SERVER_NAME} needs a CA ({K_TLS_CA}) to check the name against")
    if not (cert or ca):
        return None
    server, client = _tls_contexts(cert, key, ca)
    named = _tls_contexts(cert, key, ca, check_hostname=True)[1] if ca else None
    return TlsConfig(server=server, client=client, client_named=named, server_name=server_name)


def _tls_contexts(cert: Optional[str], key: Optional[str], ca: Optional[str], *, check_hostname: bool = False):
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        if cert:
            server.load_cert_chain(cert, key)
            client.load_cert_chain(cert, key)
        if ca:
            server.load_verify_locations(ca)
            server.verify_mode = ssl.CERT_REQUIRED  # mutual TLS when a CA is given
            client.load_verify_locations(ca)
            client.verify_mode = ssl.CERT_REQUIRED
            client.check_hostname = check_hostname
        else:
            client.verify_mode = ssl.CERT_NONE
    except (OSError, ssl.SSLError) as exc:
        raise _param_invalid(f"cannot set up TLS from llmdd.tls_* options: {exc}") from None
    return server, client


def is_ip_literal(host: str) -> bool:
    """``host`` is an IPv4 or IPv6 literal (bracketed or not), not a name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True
