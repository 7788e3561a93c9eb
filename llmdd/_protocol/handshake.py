"""Sans-io link handshake of the llmdd control plane.

Theory of operation (one connection, client = the side that called ``link_clusters``)::

    client                                   server
    IDLE --start()--> HELLO_SENT   Hello ->  AWAIT_HELLO
                                              | secret configured: -> CHALLENGED
                     <- AuthChallenge         |   (server nonce + incarnation only)
    HELLO_SENT -> AUTH_SENT   AuthResponse -> CHALLENGED --mac ok--> version check
                                              v
                                             AUTHENTICATED  (host decides: accept()/refuse())
                     <- Welcome | Refuse
    ESTABLISHED | REFUSED                    ESTABLISHED | REFUSED

* Authentication is HMAC-SHA256 challenge-response over both nonces, both incarnations and the
  client's encoded Hello (so a man in the middle cannot edit the offer); the server answers
  with its own proof in ``Welcome.proof`` (mutual authentication, different label).  The secret
  never crosses the wire; MACs are compared with ``hmac.compare_digest``; nonces are fresh per
  connection, so a captured answer cannot be replayed.
* A client with a secret refuses a server that does not authenticate (no downgrade).
* Version negotiation (highest common version) happens after authentication, so an
  unauthenticated client learns nothing, not even the version range; every refusal carries a
  status code and a reason, never a region or key.
* While not ESTABLISHED the host should keep ``Connection.max_frame_size`` at
  :data:`PRE_AUTH_MAX_FRAME_SIZE`.
* Every (state, message type) pair not in the tables below is a protocol violation: the side
  that sees it answers with a Refuse and ends in REFUSED.  Nothing outside these tables decides
  a handshake transition.

After the handshake, each side announces its memory and applies the peer's announcements
(:mod:`llmdd._protocol.tables`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from typing import Any, Iterable, Optional

import attrs
import msgspec

from llmdd._base.enums import LLMRole
from llmdd._base.status import InvalidStateError, LLMStatusCode, LocalUsageError, RemoteError, code_2_status
from llmdd._protocol import messages as m
from llmdd._protocol import wire
from llmdd._protocol.codec import encode_payload

__all__ = [
    "PROTOCOL_VERSION",
    "MIN_PROTOCOL_VERSION",
    "PRE_AUTH_MAX_FRAME_SIZE",
    "NONCE_SIZE",
    "new_incarnation",
    "new_nonce",
    "HandshakeState",
    "HandshakeConfig",
    "PeerInfo",
    "HandshakeRefused",
    "ClientHandshake",
    "ServerHandshake",
    "CLIENT_RULES",
    "SERVER_RULES",
]

PROTOCOL_VERSION = 1
MIN_PROTOCOL_VERSION = 1
PRE_AUTH_MAX_FRAME_SIZE = 64 * 1024
NONCE_SIZE = 32

_CLIENT_LABEL = b"llmdd-auth-v1 client"
_SERVER_LABEL = b"llmdd-auth-v1 server"
_FRAME_KEY_LABEL = b"llmdd-frame-key-v1"
_LINK_FAILED = LLMStatusCode.LLM_LINK_FAILED.value


def new_incarnation() -> bytes:
    """A fresh random incarnation (16 bytes): a restarted process is a new peer."""
    return os.urandom(m.INCARNATION_SIZE)


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, label, hashlib.sha256)
    for part in parts:  # length-prefixed, so part boundaries cannot be shifted
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


class HandshakeState(enum.Enum):
    IDLE = "idle"                      # client, before start()
    HELLO_SENT = "hello_sent"          # client
    AUTH_SENT = "auth_sent"            # client
    AWAIT_HELLO = "await_hello"        # server
    CHALLENGED = "challenged"          # server
    AUTHENTICATED = "authenticated"    # server: Hello verified, waiting for accept()/refuse()
    ESTABLISHED = "established"        # final (for the handshake)
    REFUSED = "refused"                # final: a Refuse was sent or received


_FINAL = frozenset({HandshakeState.ESTABLISHED, HandshakeState.REFUSED})


def _secret_converter(value: Any) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise LocalUsageError("the link secret must be non-empty bytes or str",
                              status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return bytes(value)


def _to_tuple(value: Iterable[Any]) -> tuple:
    return tuple(value)


@attrs.frozen(kw_only=True)
class HandshakeConfig:
    """What this side says about itself.  ``secret`` never appears in repr or on the wire."""

    cluster_id: int = attrs.field(validator=wire.u64)
    role: LLMRole = attrs.field(default=LLMRole.PROMPT, converter=LLMRole)
    incarnation: bytes = attrs.field(factory=new_incarnation,
                                     validator=wire.bytes_len(m.INCARNATION_SIZE, m.INCARNATION_SIZE))
    host: m.HostIdentity = attrs.field(factory=m.HostIdentity.local,
                                       validator=attrs.validators.instance_of(m.HostIdentity))
    transports: tuple = attrs.field(default=(), converter=_to_tuple, validator=wire.tuple_of(m.TransportOffer))
    secret: Optional[bytes] = attrs.field(default=None, converter=_secret_converter, repr=False)
    min_version: int = attrs.field(default=MIN_PROTOCOL_VERSION, validator=wire.u16)
    max_version: int = attrs.field(default=PROTOCOL_VERSION, validator=wire.u16)

    @max_version.validator
    def _check_versions(self, _attribute: attrs.Attribute, value: int) -> None:
        if value < self.min_version:
            raise ValueError(f"max_version {value} < min_version {self.min_version}")


@attrs.frozen(kw_only=True)
class PeerInfo:
    """What the handshake established about the peer (same shape on both sides)."""

    cluster_id: int
    incarnation: bytes
    role: LLMRole
    host: m.HostIdentity
    version: int                       # negotiated protocol version
    transport: m.TransportOffer        # the chosen transport, with the *peer's* descriptor
    offered: tuple                     # every TransportOffer the peer made (server: just its choice)
    authenticated: bool
    #: with a shared secret: the key both sides derive for MACs on the frames after the handshake
    #: (``Connection.enable_frame_mac``); never sent, never shown
    frame_key: bytes | None = attrs.field(default=None, repr=False)


class HandshakeRefused(RemoteError):
    """The handshake ended in a Refuse (sent or received); ``refusal`` says why."""

    def __init__(self, refusal: m.Refuse, *, by_peer: bool) -> None:
        who = "peer refused the link" if by_peer else "refused the peer"
        super().__init__(f"{who}: {refusal.reason}", status_code=code_2_status(refusal.status_code))
        self.refusal = refusal
        self.by_peer = by_peer


class _Handshake:
    _rules: dict

    def __init__(self, config: HandshakeConfig, state: HandshakeState) -> None:
        if not isinstance(config, HandshakeConfig):
            raise LocalUsageError("config must be a HandshakeConfig", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        self._config = config
        self._state = state
        self._peer: Optional[PeerInfo] = None
        self._refusal: Optional[m.Refuse] = None
        self._refused_by_peer = False

    @property
    def state(self) -> HandshakeState:
        return self._state

    @property
    def finished(self) -> bool:
        """ESTABLISHED or REFUSED: nothing more is exchanged."""
        return self._state in _FINAL

    @property
    def refused(self) -> bool:
        return self._state is HandshakeState.REFUSED

    @property
    def authenticated(self) -> bool:
        """Server side: the client proved the secret (or none is used); its link may be accepted."""
        return self._state is HandshakeState.AUTHENTICATED

    @property
    def config(self) -> HandshakeConfig:
        return self._config

    @property
    def peer(self) -> Optional[PeerInfo]:
        """The peer, once ESTABLISHED."""
        return self._peer

    @property
    def refusal(self) -> Optional[m.Refuse]:
        """The Refuse sent or received, once REFUSED."""
        return self._refusal

    @property
    def refused_by_peer(self) -> bool:
        return self._refused_by_peer

    def receive(self, msg: m.Message) -> list:
        """Feed one message from the peer; returns the messages to send back (maybe none)."""
        if self._state in _FINAL or self._state is HandshakeState.IDLE:
            raise InvalidStateError(f"handshake is {self._state.value}; it takes no message",
                                    status_code=LLMStatusCode.LLM_PROCESSING_LINK
                                    if self._state is HandshakeState.IDLE else LLMStatusCode.LLM_LINK_FAILED)
        handler = self._rules.get((self._state, type(msg)))
        if handler is None:
            if isinstance(msg, m.Refuse):
                return self._peer_refused(msg)
            return [self._refuse(_LINK_FAILED, f"unexpected {type(msg).__name__} in state {self._state.value}")]
        return handler(self, msg)

    def result(self) -> PeerInfo:
        """The PeerInfo if ESTABLISHED; raise HandshakeRefused if REFUSED; InvalidStateError otherwise."""
        if self._state is HandshakeState.ESTABLISHED:
            assert self._peer is not None
            return self._peer
        if self._state is HandshakeState.REFUSED:
            assert self._refusal is not None
            raise HandshakeRefused(self._refusal, by_peer=self._refused_by_peer)
        raise InvalidStateError(f"handshake still in progress ({self._state.value})",
                                status_code=LLMStatusCode.LLM_PROCESSING_LINK)

    def refuse(self, status_code: int | LLMStatusCode, reason: str) -> m.Refuse:
        """End the handshake from this side; returns the Refuse to send."""
        if self._state in _FINAL:
            raise InvalidStateError(f"handshake already {self._state.value}",
                                    status_code=LLMStatusCode.LLM_LINK_FAILED)
        code = status_code.value if isinstance(status_code, LLMStatusCode) else status_code
        return self._refuse(code, reason)

    def _refuse(self, code: int, reason: str) -> m.Refuse:
        self._refusal = m.Refuse(status_code=code, reason=reason)
        self._refused_by_peer = False
        self._state = HandshakeState.REFUSED
        return self._refusal

    def _peer_refused(self, msg: m.Refuse) -> list:
        self._refusal = msg
        self._refused_by_peer = True
        self._state = HandshakeState.REFUSED
        return []

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cluster_id={self._config.cluster_id} state={self._state.value}>"


class ClientHandshake(_Handshake):
    """The linking side.  ``start()`` gives the Hello; ``receive()`` handles the replies.

    :param expected_cluster_id: refuse a server that reports another cluster id.
    """

    def __init__(self, config: HandshakeConfig, *, expected_cluster_id: Optional[int] = None) -> None:
        super().__init__(config, HandshakeState.IDLE)
        self._expected_cluster_id = expected_cluster_id
        self._hello: Optional[m.Hello] = None
        self._challenge: Optional[m.AuthChallenge] = None
        self._client_mac = b""

    def start(self) -> m.Hello:
        if self._state is not HandshakeState.IDLE:
            raise InvalidStateError(f"start() in state {self._state.value}", status_code=LLMStatusCode.LLM_ALREADY_LINK)
        c = self._config
        self._hello = m.Hello(min_version=c.min_version, max_version=c.max_version, cluster_id=c.cluster_id,
                              incarnation=c.incarnation, role=c.role, transports=c.transports, host=c.host,
                              nonce=new_nonce())
        self._state = HandshakeState.HELLO_SENT
        return self._hello

    def _on_challenge(self, msg: m.AuthChallenge) -> list:
        secret = self._config.secret
        if secret is None:
            return [self._refuse(_LINK_FAILED, "peer requires authentication; no secret is configured")]
        assert self._hello is not None
        self._challenge = msg
        self._client_mac = _mac(secret, _CLIENT_LABEL, self._hello.nonce, msg.nonce, self._hello.incarnation,
                                msg.incarnation, encode_payload(self._hello))
        self._state = HandshakeState.AUTH_SENT
        return [m.AuthResponse(mac=self._client_mac)]

    def _on_welcome(self, msg: m.Welcome) -> list:
        hello = self._hello
        assert hello is not None
        secret = self._config.secret
        if secret is not None:
            if self._challenge is None:
                return [self._refuse(_LINK_FAILED, "peer did not authenticate; a secret is required")]
            expected = _mac(secret, _SERVER_LABEL, hello.nonce, self._challenge.nonce, hello.incarnation,
                            self._challenge.incarnation, encode_payload(hello), self._client_mac,
                            encode_payload(msgspec.structs.replace(msg, proof=b"")))
            if not hmac.compare_digest(expected, msg.proof):
                return [self._refuse(_LINK_FAILED, "peer failed authentication")]
            if msg.incarnation != self._challenge.incarnation:
                return [self._refuse(_LINK_FAILED, "peer incarnation changed during the handshake")]
        elif msg.proof:
            return [self._refuse(_LINK_FAILED, "unexpected authentication proof")]
        if not hello.min_version <= msg.version <= hello.max_version:
            return [self._refuse(_LINK_FAILED, f"peer chose protocol version {msg.version}, "
                                               f"outside {hello.min_version}..{hello.max_version}")]
        offered = {t.name: t for t in hello.transports}
        if msg.transport.name not in offered:
            return [self._refuse(_LINK_FAILED, f"peer chose transport {msg.transport.name!r}, which was not offered")]
        if self._expected_cluster_id is not None and msg.cluster_id != self._expected_cluster_id:
            return [self._refuse(LLMStatusCode.LLM_LINK_FAILED.value,
                                 f"peer is cluster {msg.cluster_id}, expected {self._expected_cluster_id}")]
        frame_key = None
        if secret is not None and self._challenge is not None:
            frame_key = _mac(secret, _FRAME_KEY_LABEL, hello.nonce, self._challenge.nonce, hello.incarnation,
                             self._challenge.incarnation, self._client_mac, msg.proof)
        self._peer = PeerInfo(cluster_id=msg.cluster_id, incarnation=msg.incarnation, role=msg.role, host=msg.host,
                              version=msg.version, transport=msg.transport, offered=(msg.transport,),
                              authenticated=secret is not None, frame_key=frame_key)
        self._state = HandshakeState.ESTABLISHED
        return []

    _rules = {
        (HandshakeState.HELLO_SENT, m.AuthChallenge): _on_challenge,
        (HandshakeState.HELLO_SENT, m.Welcome): _on_welcome,
        (HandshakeState.HELLO_SENT, m.Refuse): _Handshake._peer_refused,
        (HandshakeState.AUTH_SENT, m.Welcome): _on_welcome,
        (HandshakeState.AUTH_SENT, m.Refuse): _Handshake._peer_refused,
    }


class ServerHandshake(_Handshake):
    """The listening side.  After AUTHENTICATED the host calls :meth:`accept` or :meth:`refuse`.

    ``hello`` (the client's verified Hello) and ``version`` (negotiated) are available from
    AUTHENTICATED on, so the host can apply its policies (link limits, duplicates, transport
    selection) before it answers.
    """

    def __init__(self, config: HandshakeConfig) -> None:
        super().__init__(config, HandshakeState.AWAIT_HELLO)
        self._hello: Optional[m.Hello] = None
        self._nonce = b""
        self._client_mac = b""
        self._version = 0

    @property
    def hello(self) -> Optional[m.Hello]:
        """The client's Hello, once authenticated (None before: nothing unverified leaks out)."""
        return self._hello if self._state in (HandshakeState.AUTHENTICATED, HandshakeState.ESTABLISHED) else None

    @property
    def version(self) -> int:
        return self._version

    def _on_hello(self, msg: m.Hello) -> list:
        self._hello = msg
        if self._config.secret is not None:
            self._nonce = new_nonce()
            self._state = HandshakeState.CHALLENGED
            return [m.AuthChallenge(nonce=self._nonce, incarnation=self._config.incarnation)]
        return self._negotiate()

    def _on_auth_response(self, msg: m.AuthResponse) -> list:
        hello = self._hello
        secret = self._config.secret
        assert hello is not None and secret is not None
        expected = _mac(secret, _CLIENT_LABEL, hello.nonce, self._nonce, hello.incarnation,
                        self._config.incarnation, encode_payload(hello))
        if not hmac.compare_digest(expected, msg.mac):
            return [self._refuse(_LINK_FAILED, "authentication failed")]
        self._client_mac = msg.mac
        return self._negotiate()

    def _negotiate(self) -> list:
        hello = self._hello
        assert hello is not None
        c = self._config
        version = min(hello.max_version, c.max_version)
        if version < max(hello.min_version, c.min_version):
            return [self._refuse(_LINK_FAILED, f"no common protocol version: peer offers "
                                               f"{hello.min_version}..{hello.max_version}, "
                                               f"this side supports {c.min_version}..{c.max_version}")]
        self._version = version
        self._state = HandshakeState.AUTHENTICATED
        return []

    def accept(self, transport: m.TransportOffer) -> m.Welcome:
        """Accept the client with ``transport`` (a name it offered, and *this* side's descriptor)."""
        if self._state is not HandshakeState.AUTHENTICATED:
            raise InvalidStateError(f"accept() in state {self._state.value}",
                                    status_code=LLMStatusCode.LLM_PROCESSING_LINK)
        if not isinstance(transport, m.TransportOffer):
            raise LocalUsageError("transport must be a TransportOffer", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        hello = self._hello
        assert hello is not None
        offered = {t.name: t for t in hello.transports}
        if transport.name not in offered:
            raise LocalUsageError(f"transport {transport.name!r} was not offered by the peer "
                                  f"(offered: {sorted(offered)})", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        c = self._config
        welcome = m.Welcome(version=self._version, cluster_id=c.cluster_id, incarnation=c.incarnation, role=c.role,
                            transport=transport, host=c.host)
        secret = c.secret
        authenticated = secret is not None
        if secret is not None:
            proof = _mac(secret, _SERVER_LABEL, hello.nonce, self._nonce, hello.incarnation, c.incarnation,
                         encode_payload(hello), self._client_mac, encode_payload(welcome))
            welcome = msgspec.structs.replace(welcome, proof=proof)
        frame_key = None
        if secret is not None:
            frame_key = _mac(secret, _FRAME_KEY_LABEL, hello.nonce, self._nonce, hello.incarnation, c.incarnation,
                             self._client_mac, welcome.proof)
        self._peer = PeerInfo(cluster_id=hello.cluster_id, incarnation=hello.incarnation, role=hello.role,
                              host=hello.host, version=self._version, transport=offered[transport.name],
                              offered=hello.transports, authenticated=authenticated, frame_key=frame_key)
        self._state = HandshakeState.ESTABLISHED
        return welcome

    _rules = {
        (HandshakeState.AWAIT_HELLO, m.Hello): _on_hello,
        (HandshakeState.CHALLENGED, m.AuthResponse): _on_auth_response,
        (HandshakeState.AWAIT_HELLO, m.Refuse): _Handshake._peer_refused,
        (HandshakeState.CHALLENGED, m.Refuse): _Handshake._peer_refused,
    }


CLIENT_RULES = {k: v.__name__ for k, v in ClientHandshake._rules.items()}
SERVER_RULES = {k: v.__name__ for k, v in ServerHandshake._rules.items()}
