"""The protocol of llmdd, below both planes: the wire, sans-io (messages and their bounds, ``wire``;
framing codec; handshake; descriptor tables), and ``port``, the typed port between the control plane
and the data plane (``ControlPort``, ``DataService``, ``LinkView``).

Nothing in this package touches a socket or a clock: the link manager moves bytes, these modules
decide what the bytes mean (h11 style).  See ``codec`` for the frame format and ``handshake`` for the
theory of operation, ``tables`` for what a link's peers announce, ``port`` for how the planes meet.
"""

from llmdd._protocol.codec import (
    DEFAULT_MAX_FRAME_SIZE as DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA as NEED_DATA,
    PEER_CLOSED as PEER_CLOSED,
    Connection as Connection,
    LocalProtocolError as LocalProtocolError,
    ProtocolError as ProtocolError,
)
from llmdd._protocol.handshake import (
    PRE_AUTH_MAX_FRAME_SIZE as PRE_AUTH_MAX_FRAME_SIZE,
    PROTOCOL_VERSION as PROTOCOL_VERSION,
    ClientHandshake as ClientHandshake,
    HandshakeConfig as HandshakeConfig,
    HandshakeRefused as HandshakeRefused,
    HandshakeState as HandshakeState,
    PeerInfo as PeerInfo,
    ServerHandshake as ServerHandshake,
)
from llmdd._protocol.tables import (
    DescriptorTables as DescriptorTables,
    TableAnnouncer as TableAnnouncer,
    TableUpdateError as TableUpdateError,
)
from llmdd._protocol.messages import *  # noqa: F401,F403  (every message class; see messages.__all__)
from llmdd._protocol.messages import __all__ as _messages_all

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "NEED_DATA",
    "PEER_CLOSED",
    "Connection",
    "LocalProtocolError",
    "ProtocolError",
    "PRE_AUTH_MAX_FRAME_SIZE",
    "PROTOCOL_VERSION",
    "ClientHandshake",
    "DescriptorTables",
    "HandshakeConfig",
    "HandshakeRefused",
    "HandshakeState",
    "PeerInfo",
    "ServerHandshake",
    "TableAnnouncer",
    "TableUpdateError",
    *_messages_all,
]
