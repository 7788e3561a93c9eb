"""Unit tests of the sans-io control protocol: messages, codec, handshake, descriptor tables."""

from __future__ import annotations

import random
import struct
import zlib

import msgspec
import pytest
from msgspec.structs import asdict, force_setattr, replace

from llmdd._base.enums import LLMRole, Placement
from llmdd._protocol import handshake as hs, messages as m, tables as tb
from llmdd._protocol.codec import (
    FLAG_CRC32,
    HEADER_SIZE,
    MAGIC,
    MESSAGE_TYPES,
    NEED_DATA,
    PEER_CLOSED,
    Connection,
    LocalProtocolError,
    WIRE_VERSION,
    ProtocolError,
    decode_payload,
    encode_frame,
    encode_payload,
)
from llmdd._protocol.handshake import (
    ClientHandshake,
    HandshakeConfig,
    HandshakeRefused,
    HandshakeState,
    ServerHandshake,
)
from llmdd._protocol.tables import DescriptorTables, TableAnnouncer, TableUpdateError
from llmdd._base.status import (
    InvalidStateError,
    LLMException,
    LLMStatusCode,
    LocalUsageError,
    RemoteError,
    TransportError,
)

INC_A = bytes(range(16))
INC_B = bytes(range(16, 32))
HOST = m.HostIdentity(boot_id="b", machine_id="mid", uid=1000, pid=42, namespaces={"ipc": "ipc:[1]", "mnt": "mnt:[2]"})
TCP = m.TransportOffer(name="tcp", descriptor=m.TransportDescriptor(transport="tcp", version=2, payload=b"127.0.0.1:26000"))
SHM = m.TransportOffer(name="shm", descriptor=m.TransportDescriptor(transport="shm", version=1, payload=b"llmdd-1\x00\x01"))
REGION = m.RegionDescriptor(region_id=7, cache_id=3, addr=0x7F00_0000_0000, size=1 << 20, placement=Placement.DEVICE,
                            remote_accessible=True,
                            transports=(m.TransportDescriptor(transport="tcp", version=2, payload=b"\x05"),
                                        m.TransportDescriptor(transport="shm", version=1, payload=b"seg\x00")))
KEY_REQ = m.KeyRef.for_req(req_id=11, model_id=0)
KEY_BLOCKS = m.KeyRef.for_blocks(model_id=2**63 + 5)
CACHE = m.CacheEntry(cache_id=3, addrs=(0x7F00_0000_0000, 0x7F00_0008_0000), tensor_size=1 << 19, shape=(4, 16, 128),
                     data_type=1, placement=Placement.DEVICE, is_blocks=False)

SAMPLES = {
    m.Hello: m.Hello(min_version=1, max_version=2, cluster_id=2**64 - 1, incarnation=INC_A, role=LLMRole.DECODER,
                     transports=(TCP, SHM), host=HOST, nonce=b"n" * 32),
    m.AuthChallenge: m.AuthChallenge(nonce=b"s" * 32, incarnation=INC_B),
    m.AuthResponse: m.AuthResponse(mac=b"m" * 32),
    m.Welcome: m.Welcome(version=1, cluster_id=1, incarnation=INC_B, role=LLMRole.PROMPT, transport=TCP, host=HOST,
                         proof=b"p" * 32),
    m.Refuse: m.Refuse(status_code=LLMStatusCode.LLM_LINK_FAILED.value, reason="authentication failed"),
    m.RegionsUpdate: m.RegionsUpdate(version=3, full=False, added=(REGION,), removed=(1, 2)),
    m.CacheTableUpdate: m.CacheTableUpdate(
        version=9, caches_added=(CACHE,), caches_removed=(-1, 4),
        keys_added=(m.KeyEntry(key=KEY_REQ, cache_id=3, batch_index=1), m.KeyEntry(key=KEY_BLOCKS, cache_id=3)),
        keys_removed=(m.KeyRef.for_prefix(prefix_id=5, model_id=-7),)),
    m.Keepalive: m.Keepalive(seq=1, sent_at_ns=123456789),
    m.KeepaliveAck: m.KeepaliveAck(seq=1, echo_sent_at_ns=123456789, sent_at_ns=987654321),
    m.UnlinkRequest: m.UnlinkRequest(request_id=5, force=True, reason="shutting down"),
    m.UnlinkAck: m.UnlinkAck(request_id=5, status_code=0),
    m.ReadDone: m.ReadDone(entries=(
        m.ReadDoneEntry(cache_id=3, key=KEY_REQ),
        m.ReadDoneEntry(cache_id=4, block_bounds=(0, 4, 10, 11)),
    )),
    m.KeyConsumed: m.KeyConsumed(key=KEY_REQ, cache_id=3, tensor_spans=(m.Span(start=0, stop=8),)),
    m.ReleaseKey: m.ReleaseKey(id=2**64 - 1, model_id=7),
    m.PushDone: m.PushDone(entries=(
        m.TransferDone(cache_id=3, block_spans=(m.Span(start=0, stop=4),), tensors=m.Span(start=0, stop=2)),
        m.TransferDone(cache_id=4, failed=True, status=LLMStatusCode.LLM_TIMEOUT.value),
    )),
    m.TaggedDone: m.TaggedDone(request_id=9, push=False, entry=m.TransferDone(
        cache_id=3, block_spans=(m.Span(start=1, stop=2),), tag="req-1".encode(), tag_str=True)),
    m.TransferRequest: m.TransferRequest(request_id=77, op="pull", args={"ops": [[1, 2, 3], [4, 5, 6]], "x": 1.5}),
    m.TransferReply: m.TransferReply(request_id=77, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST.value,
                                     result={"missing": [3], "ok": False, "none": None}),
    m.Error: m.Error(status_code=-1, message="boom", fatal=True),
}


def feed(conn: Connection, data: bytes) -> list:
    conn.receive_data(data)
    out = []
    while True:
        msg = conn.next_message()
        if msg is NEED_DATA or msg is PEER_CLOSED:
            return out
        out.append(msg)


# --------------------------------------------------------------------------- messages / codec

def test_samples_cover_every_message_class():
    assert set(SAMPLES) == set(m.MESSAGE_CLASSES) == set(MESSAGE_TYPES)
    assert len(set(MESSAGE_TYPES.values())) == len(MESSAGE_TYPES)


@pytest.mark.parametrize("cls", m.MESSAGE_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("checksum", [True, False])
def test_round_trip_every_message(cls, checksum):
    msg = SAMPLES[cls]
    tx, rx = Connection(checksum=checksum), Connection()
    data = tx.send(msg)
    assert feed(rx, data) == [msg]
    # canonical encoding: re-encoding the decoded message gives the same bytes
    assert encode_payload(decode_payload(MESSAGE_TYPES[cls], encode_payload(msg))) == encode_payload(msg)


def test_frame_layout():
    msg = SAMPLES[m.Keepalive]
    frame = encode_frame(msg, checksum=True)
    payload = b"\x92\x01\xce" + struct.pack(">I", 123456789)  # MessagePack [1, 123456789]
    header = MAGIC + bytes([3, 0x20, FLAG_CRC32]) + struct.pack(">I", len(payload))
    assert HEADER_SIZE == 9 and WIRE_VERSION == 3
    assert frame == header + payload + struct.pack(">I", zlib.crc32(header + payload))
    assert encode_frame(msg, checksum=False) == MAGIC + bytes([3, 0x20, 0]) + struct.pack(">I", 7) + payload


def test_descriptor_values_round_trip_types():
    desc = {"s": "é", "i": -(2**63), "u": 2**64 - 1, "b": b"\xff", "t": True, "f": False, "x": 0.25,
            "n": None, "l": [1, [2, {"k": "v"}]], "d": {"": {}}}
    msg = m.TransferRequest(request_id=0, op="", args=desc)
    out = feed(Connection(), encode_frame(msg))[0]
    assert out.args == desc
    assert type(out.args["t"]) is bool and type(out.args["i"]) is int


def test_tuples_in_descriptors_decode_as_lists():
    msg = m.TransferRequest(request_id=0, op="x", args={"t": (1, 2)})
    assert feed(Connection(), encode_frame(msg))[0].args == {"t": [1, 2]}


def test_need_data_and_incremental_feed():
    conn = Connection()
    data = encode_frame(SAMPLES[m.Hello])
    for i in range(len(data) - 1):
        conn.receive_data(data[i:i + 1])
        assert conn.next_message() is NEED_DATA
    conn.receive_data(data[-1:])
    assert conn.next_message() == SAMPLES[m.Hello]
    assert conn.next_message() is NEED_DATA
    conn.receive_data(b"")
    assert conn.next_message() is PEER_CLOSED
    assert conn.next_message() is PEER_CLOSED


def test_many_frames_in_one_chunk_and_statistics():
    msgs = list(SAMPLES.values()) * 3
    tx, rx = Connection(), Connection()
    data = tx.send_many(msgs)
    assert feed(rx, data) == msgs
    st = rx.statistics()
    assert st.frames_received == len(msgs) and st.bytes_received == len(data) and st.buffered == 0 and not st.dead
    assert tx.statistics().frames_sent == len(msgs)


def test_peer_closed_mid_frame_is_protocol_error():
    conn = Connection()
    data = encode_frame(SAMPLES[m.Keepalive])
    conn.receive_data(data[:5])
    conn.receive_data(b"")
    with pytest.raises(ProtocolError, match="middle of a frame header"):
        conn.next_message()
    conn2 = Connection()
    conn2.receive_data(data[:-1])
    conn2.receive_data(b"")
    with pytest.raises(ProtocolError, match="peer closed after"):
        conn2.next_message()


def test_protocol_error_is_a_transport_error_with_link_failed():
    err = ProtocolError("x")
    assert isinstance(err, TransportError) and isinstance(err, LLMException)
    assert err.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert LocalProtocolError("x").status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert isinstance(LocalProtocolError("x"), LocalUsageError)


def test_connection_is_dead_after_error():
    conn = Connection()
    conn.receive_data(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(ProtocolError, match="bad magic") as first:
        conn.next_message()
    assert conn.dead and conn.error is first.value
    with pytest.raises(ProtocolError) as again:
        conn.next_message()
    assert again.value is first.value
    with pytest.raises(ProtocolError):
        conn.receive_data(encode_frame(SAMPLES[m.Keepalive]))
    # sending stays possible (tell the peer why)
    assert conn.send(SAMPLES[m.Error])
    assert conn.statistics().dead


def test_bad_magic_rejected_on_first_byte():
    conn = Connection()
    conn.receive_data(b"\x16")  # a TLS ClientHello starts with 0x16 0x03
    with pytest.raises(ProtocolError, match="bad magic"):
        conn.next_message()


def _header(code=0x20, flags=0, length=16, version=WIRE_VERSION, magic=MAGIC) -> bytes:
    return magic + bytes([version, code, flags]) + struct.pack(">I", length)


@pytest.mark.parametrize("header, match", [
    (_header(version=1), "unsupported wire version 1"),   # a peer still on the v1 binary payloads
    (_header(version=2), "unsupported wire version 2"),   # a peer still sending ReadDone spans as Span arrays
    (_header(version=4), "wire version"),
    (_header(flags=0x80), "flags"),
    (_header(code=0x66), "unknown message type"),
    (_header(length=2**32 - 1), "exceeds the limit"),
])
def test_bad_header_rejected_before_payload(header, match):
    conn = Connection()
    conn.receive_data(header)  # no payload at all: the header alone must be enough to refuse
    with pytest.raises(ProtocolError, match=match):
        conn.next_message()


def test_max_frame_size_configurable():
    conn = Connection(max_frame_size=64)
    big = m.TransferRequest(request_id=1, op="x", args={"blob": b"x" * 100})
    with pytest.raises(LocalProtocolError):
        conn.send(big)
    conn.receive_data(encode_frame(big))
    with pytest.raises(ProtocolError, match="exceeds the limit of 64"):
        conn.next_message()
    conn2 = Connection(max_frame_size=64)
    conn2.max_frame_size = 4096
    assert feed(conn2, encode_frame(big)) == [big]
    with pytest.raises(LocalProtocolError):
        conn2.max_frame_size = 0
    with pytest.raises(LocalProtocolError):
        Connection(max_depth=1000)


def test_huge_declared_length_is_not_allocated():
    conn = Connection(max_frame_size=2**32 - 1)
    conn.receive_data(_header(length=2**32 - 2) + b"\x00" * 10)
    assert conn.next_message() is NEED_DATA  # waits; nothing sized by the header was allocated
    assert conn.statistics().buffered == HEADER_SIZE + 10


def test_crc_mismatch_and_required_checksum():
    data = bytearray(encode_frame(SAMPLES[m.Keepalive], checksum=True))
    data[HEADER_SIZE + 3] ^= 0x01
    conn = Connection()
    conn.receive_data(bytes(data))
    with pytest.raises(ProtocolError, match="CRC32"):
        conn.next_message()
    strict = Connection(require_checksum=True)
    strict.receive_data(encode_frame(SAMPLES[m.Keepalive], checksum=False))
    with pytest.raises(ProtocolError, match="required CRC32"):
        strict.next_message()


def _raw_frame(code: int, payload: bytes) -> bytes:
    return _header(code=code, length=len(payload)) + payload


_enc = msgspec.msgpack.encode


@pytest.mark.parametrize("code, payload, match", [
    (0x20, _enc([1, 2]) + b"\x00", "trailing"),
    (0x20, _enc([1, 2])[:-1], "truncated"),
    (0x20, _enc([1, 2, 3]), "at most length 2"),                      # an unknown trailing field
    (0x20, _enc([-1, 0]), ">= 0"),                                     # u64 field
    (0x20, _enc(["1", 0]), "Expected `int`"),
    (0x20, b"\xc0", "Expected `array`"),
    # non-canonical: 5 as a uint64, a default left out, a duplicate key, a float32
    (0x20, b"\x92\x01\xcf" + struct.pack(">Q", 5), "non-canonical"),
    (0x31, _enc([5]), "non-canonical"),
    (0x50, b"\x93\x00\xa0\x82\xa1k\xc0\xa1k\xc0", "non-canonical"),
    (0x50, b"\x93\x00\xa0\x81\xa1k\xca" + struct.pack(">f", 1.5), "non-canonical"),
    # descriptor values: an extension type, a timestamp, a non-str key below the top level
    (0x50, b"\x93\x00\xa0\x81\xa1k\xd4\x05\x00", "descriptor values cannot be Ext"),
    (0x50, b"\x93\x00\xa0\x81\xa1k\xd6\xff\x00\x00\x00\x01", "descriptor values cannot be datetime"),
    (0x50, _enc([0, "", {"k": {1: 2}}]), "keys must be str"),
    (0x50, _enc([0, "", {1: 2}]), "Expected `str`"),
    # a count far larger than the bytes present (array32 / map32 / str32 headers)
    (0x50, b"\x93\x00\xa0\xdf" + struct.pack(">I", 1_000_000), "truncated"),
    (0x50, b"\xdd" + struct.pack(">I", 2**32 - 1), "truncated"),
    (0x50, b"\x93\x00\xdb" + struct.pack(">I", 2**32 - 1), "truncated"),
    # a list over its field cap (CacheEntry.shape: 64)
    (0x11, _enc([1, False, [[0, [], 0, [1] * 65, 0, 0, False]], [], [], []]), "length <= 64"),
    # invalid UTF-8 in op
    (0x50, b"\x93\x00\xa2\xff\xfe\x80", "malformed"),
    # a bool field holding 2 (Error.fatal)
    (0x7F, _enc([0, "", 2]), "Expected `bool`"),
    # enum out of range (KeyKind 9), the BLOCKS rule
    (0x41, _enc([[9, 0, 0], 3, []]), "Invalid enum value 9"),
    (0x41, _enc([[3, 0, 5], 3, []]), "BLOCKS key carries no"),
    # i64 field beyond its range (KeyConsumed.cache_id)
    (0x41, _enc([[1, 0, 0], 2**63, []]), "<= 9223372036854775807"),
    # nonce length outside its bounds (AuthChallenge with a 1-byte nonce)
    (0x02, _enc([b"x", b"i" * 16]), "length >= 16"),
    # a byte string longer than its field cap (AuthResponse mac of 1000 bytes)
    (0x03, _enc([b"m" * 1000]), "length <= 32"),
    # Hello whose versions are out of order (a cross-field rule)
    (0x01, _enc([2, 1, 0, b"i" * 16, 1, [], ["", "", -1, 0, {}], b"n" * 16]), "max_version 1 < min_version 2"),
])
def test_malformed_payloads(code, payload, match):
    conn = Connection(checksum=False)
    conn.receive_data(_raw_frame(code, payload))
    with pytest.raises(ProtocolError, match=match):
        conn.next_message()


def test_nesting_depth_bounded():
    nested: object = 1
    for _ in range(40):
        nested = [nested]
    with pytest.raises(ValueError, match="nesting"):  # refused at construction
        m.TransferRequest(request_id=0, op="x", args={"n": nested})
    bypassed = replace(SAMPLES[m.TransferRequest])
    force_setattr(bypassed, "args", {"n": nested})
    with pytest.raises(LocalProtocolError, match="nesting"):  # and by the encoder
        encode_frame(bypassed)
    # hand-built frames: 40 nested lists (past the limit of 16), and 200000 (past msgspec's recursion guard)
    for depth, match in ((40, "nesting deeper than 16"), (200_000, "malformed")):
        payload = b"\x93\x00\xa1x\x81\xa1n" + b"\x91" * depth + b"\x01"
        conn = Connection(checksum=False, max_frame_size=1 << 20)
        conn.receive_data(_raw_frame(0x50, payload))
        with pytest.raises(ProtocolError, match=match):
            conn.next_message()
    # 15 levels below the top-level dict (16 in all) is the limit itself: accepted
    nested = 1
    for _ in range(15):
        nested = [nested]
    ok = m.TransferRequest(request_id=0, op="x", args={"n": nested})
    assert feed(Connection(), encode_frame(ok)) == [ok]
    shallow = Connection(max_depth=2)
    shallow.receive_data(encode_frame(m.TransferRequest(request_id=0, op="x", args={"a": [[1]]})))
    with pytest.raises(ProtocolError, match="nesting"):
        shallow.next_message()


@pytest.mark.parametrize("args", [
    {"x": object()},
    {"x": 2**64},
    {"x": -(2**63) - 1},
    {1: "non-str key"},
    {"x": {2: 3}},
    {"x": "\ud800"},
])
def test_encode_rejects_unrepresentable_values(args):
    msg = replace(SAMPLES[m.TransferRequest])
    force_setattr(msg, "args", args)  # bypass the construction check to reach the encoder
    with pytest.raises(LocalProtocolError):
        Connection().send(msg)


def test_encode_rejects_non_messages():
    with pytest.raises(LocalProtocolError):
        Connection().send(HOST)
    with pytest.raises(LocalProtocolError):
        encode_payload("hello")


def test_receive_after_eof_is_caller_error():
    conn = Connection()
    conn.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"LD")


@pytest.mark.parametrize("build", [
    lambda: m.Keepalive(seq=-1, sent_at_ns=0),
    lambda: m.Keepalive(seq=True, sent_at_ns=0),
    lambda: m.Hello(min_version=2, max_version=1, cluster_id=0, incarnation=INC_A, role=1, nonce=b"n" * 32),
    lambda: m.Hello(min_version=1, max_version=1, cluster_id=0, incarnation=b"short", role=1, nonce=b"n" * 32),
    lambda: m.Hello(min_version=1, max_version=1, cluster_id=0, incarnation=INC_A, role=9, nonce=b"n" * 32),
    lambda: m.RegionDescriptor(region_id=2**32, cache_id=0, addr=0, size=0),
    lambda: m.KeyRef(kind=m.KeyKind.BLOCKS, id=3),
    lambda: m.KeyRef(kind=9),
    lambda: m.KeyEntry(key=m.KeyRef.for_req(1), cache_id=0, batch_index=-1),
    lambda: m.Welcome(version=1, cluster_id=0, incarnation=INC_A, role=1, transport=TCP, proof=b"x"),
    lambda: m.TransferRequest(request_id=0, op="x", args={1: 2}),
    lambda: m.CacheEntry(cache_id=0, addrs=(-1,), tensor_size=0, shape=()),
    lambda: m.CacheEntry(cache_id=0, addrs=(), tensor_size=0, shape=(1,) * 65),
    lambda: m.Refuse(status_code=0, reason="r" * (m.MAX_TEXT + 1)),
    lambda: m.TransferRequest(request_id=0, op="x", args={"x": {"y": object()}}),
    lambda: m.RegionsUpdate(version=0, added=(REGION, "not a region")),
    # typed transport descriptors: bounded payload, name and capability; a descriptor exactly when not deferred
    lambda: m.TransportDescriptor(transport="tcp", payload=b"p" * (m.MAX_DESCRIPTOR_PAYLOAD + 1)),
    lambda: m.TransportDescriptor(transport="", payload=b""),
    lambda: m.TransportDescriptor(transport="t" * 65, payload=b""),
    lambda: m.TransportDescriptor(transport="tcp", version=2**32, payload=b""),
    lambda: m.TransportOffer(name="tcp"),
    lambda: m.TransportOffer(name="tcp", deferred=True, descriptor=TCP.descriptor),
    lambda: m.TransportOffer(name="shm", descriptor=TCP.descriptor),
    lambda: m.TransportOffer(name="tcp", descriptor=TCP.descriptor, capability=b"short"),
    lambda: m.RegionDescriptor(region_id=1, cache_id=0, addr=0, size=0, transports=(TCP.descriptor, TCP.descriptor)),
])
def test_message_validators(build):
    with pytest.raises((ValueError, TypeError)):
        build()


def test_decoding_refuses_an_oversized_descriptor_payload_before_building_it():
    """The typed decoder bounds a peer's descriptor payload (MAX_DESCRIPTOR_PAYLOAD) while it parses; the
    control, one byte less, decodes."""
    at_cap = m.TransportOffer(name="tcp", descriptor=m.TransportDescriptor(
        transport="tcp", payload=b"p" * m.MAX_DESCRIPTOR_PAYLOAD))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(at_cap), type=m.TransportOffer) == at_cap
    over = msgspec.msgpack.encode(["tcp", ["tcp", 0, b"p" * (m.MAX_DESCRIPTOR_PAYLOAD + 1)], False, None])
    with pytest.raises(msgspec.ValidationError, match="length"):
        msgspec.msgpack.decode(over, type=m.TransportOffer)
    assert "secret" not in repr(m.TransportOffer(name="tcp", descriptor=TCP.descriptor, capability=b"secret" * 4))


def test_construction_converts_lists_and_enums():
    entry = m.CacheEntry(cache_id=1, addrs=[1, 2], tensor_size=3, shape=[4], placement=1)
    assert entry.addrs == (1, 2) and entry.shape == (4,) and entry.placement is Placement.DEVICE
    assert m.KeyRef(kind=2, id=5).kind is m.KeyKind.PREFIX
    hello = replace(SAMPLES[m.Hello], role=3, transports=[TCP])
    assert hello.role is LLMRole.MIX and hello.transports == (TCP,)
    assert hash(KEY_REQ) == hash(m.KeyRef.for_req(req_id=11)) and {KEY_REQ: 1}[m.KeyRef.for_req(11)] == 1


def test_hot_notice_types_leave_span_order_to_the_owner():
    """Span, ReadDoneEntry and ReadDone run no construction check (they are decoded by the thousand);
    the typed decoder still checks a peer's ranges and types, and a reversed span is refused by the
    owner's table check (llmdd._data.peer_input) before any work."""
    from llmdd._data.peer_input import PeerInputError, peer_bounds, peer_spans

    payload = _enc([[[7, None, [5, 1]]]])
    notice = decode_payload(MESSAGE_TYPES[m.ReadDone], payload)
    (entry,) = notice.entries
    assert entry.block_bounds == (5, 1) and entry.block_spans == (m.Span(start=5, stop=1),)
    with pytest.raises(PeerInputError, match=r"\[5, 1\) is outside"):
        peer_bounds(entry.block_bounds, "read_done blocks", 10)
    with pytest.raises(PeerInputError, match=r"\[5, 1\) is outside"):
        peer_spans(entry.block_spans, "read_done blocks", 10)
    odd = decode_payload(MESSAGE_TYPES[m.ReadDone], _enc([[[7, None, [1, 3, 4]]]])).entries[0]
    with pytest.raises(PeerInputError, match="odd number of span bounds"):
        peer_bounds(odd.block_bounds, "read_done blocks", 10)
    with pytest.raises(PeerInputError, match="3 spans exceed the 2"):
        peer_bounds((0, 1, 1, 2, 2, 3), "read_done blocks", 2)
    assert peer_bounds((0, 2, 5, 5, 7, 10), "read_done blocks", 10) == [[0, 2], [5, 5], [7, 10]]
    with pytest.raises(ProtocolError, match=">= 0"):
        decode_payload(MESSAGE_TYPES[m.ReadDone], _enc([[[7, None, [-1, 1]]]]))
    with pytest.raises(ProtocolError, match="Expected `int`"):
        decode_payload(MESSAGE_TYPES[m.ReadDone], _enc([[[7, None, [0, 1.5]]]]))
    with pytest.raises(ProtocolError, match="Expected `int`"):   # wire v2's Span arrays are refused
        decode_payload(MESSAGE_TYPES[m.ReadDone], _enc([[[7, None, [[0, 1]]]]]))


def test_read_done_entry_from_spans_round_trips():
    rng = random.Random(22)
    spans = tuple(m.Span(start=a, stop=a + rng.randrange(0, 9)) for a in sorted(rng.sample(range(1 << 40), 64)))
    entry = m.ReadDoneEntry.from_spans(cache_id=5, key=KEY_REQ, block_spans=spans)
    assert entry.block_bounds == tuple(x for s in spans for x in (s.start, s.stop))
    assert entry.block_spans == spans
    notice = m.ReadDone(entries=(entry,))
    assert decode_payload(MESSAGE_TYPES[m.ReadDone], encode_payload(notice)) == notice


def test_region_contains():
    assert REGION.contains(REGION.addr, REGION.size)
    assert REGION.contains(REGION.addr + 10, 0)
    assert not REGION.contains(REGION.addr + 1, REGION.size)
    assert not REGION.contains(REGION.addr - 1, 2)
    assert not REGION.contains(REGION.addr, -1)
    assert REGION.end == REGION.addr + REGION.size


def test_host_identity():
    me = m.HostIdentity.local()
    assert me.pid > 0
    other_proc = replace(me, pid=me.pid + 1)
    if me.boot_id:
        assert me.same_host(other_proc)
        assert me.same_ipc_domain(other_proc) == bool(me.namespaces.get("ipc") and me.namespaces.get("mnt"))
    assert not me.same_host(replace(me, boot_id="another-boot"))
    assert not m.HostIdentity().same_host(m.HostIdentity())  # unknown is never "same"
    assert not HOST.same_ipc_domain(replace(HOST, namespaces={"ipc": "ipc:[9]", "mnt": "mnt:[2]"}))
    assert not HOST.same_ipc_domain(replace(HOST, uid=0))
    assert HOST.same_ipc_domain(replace(HOST, pid=7))


# --------------------------------------------------------------------------- handshake

def config(cluster_id=1, *, secret=None, versions=(1, 1), transports=(TCP, SHM), role=LLMRole.PROMPT, inc=None):
    return HandshakeConfig(cluster_id=cluster_id, role=role, incarnation=inc or hs.new_incarnation(), host=HOST,
                           transports=transports, secret=secret, min_version=versions[0], max_version=versions[1])


class Pair:
    """A client and a server handshake wired through two codec connections (bytes in between)."""

    def __init__(self, client: ClientHandshake, server: ServerHandshake) -> None:
        self.client, self.server = client, server
        self.c_conn = Connection(max_frame_size=hs.PRE_AUTH_MAX_FRAME_SIZE)
        self.s_conn = Connection(max_frame_size=hs.PRE_AUTH_MAX_FRAME_SIZE)
        self.to_client: list = []

    def run(self, accept_with=None) -> None:
        final = (HandshakeState.ESTABLISHED, HandshakeState.REFUSED)
        wire = self.c_conn.send(self.client.start())
        while wire:
            out = []
            for msg in feed(self.s_conn, wire):
                if self.server.state in final:
                    break  # e.g. the client's Refuse after the server accepted
                out += self.server.receive(msg)
            if self.server.state is HandshakeState.AUTHENTICATED and accept_with is not None:
                out.append(self.server.accept(accept_with))
            wire = b""
            for msg in feed(self.c_conn, self.s_conn.send_many(out)):
                self.to_client.append(msg)
                if self.client.state in final:
                    break
                wire += self.c_conn.send_many(self.client.receive(msg))


SERVER_TCP = m.TransportOffer(name="tcp", descriptor=m.TransportDescriptor(transport="tcp", version=2,
                                                                          payload=b"10.0.0.1:26000"))


def test_handshake_ok_without_secret():
    p = Pair(ClientHandshake(config(1, role=LLMRole.DECODER)), ServerHandshake(config(2)))
    p.run(accept_with=SERVER_TCP)
    assert p.client.state is p.server.state is HandshakeState.ESTABLISHED
    cp, sp = p.client.result(), p.server.result()
    assert cp.cluster_id == 2 and cp.incarnation == p.server.config.incarnation and cp.role is LLMRole.PROMPT
    assert cp.transport == SERVER_TCP and cp.version == 1 and not cp.authenticated and cp.host == HOST
    assert sp.cluster_id == 1 and sp.incarnation == p.client.config.incarnation and sp.role is LLMRole.DECODER
    assert sp.transport == TCP and sp.offered == (TCP, SHM) and not sp.authenticated
    assert p.server.hello.cluster_id == 1


def test_handshake_ok_with_secret_is_mutual():
    p = Pair(ClientHandshake(config(1, secret=b"s3cret")), ServerHandshake(config(2, secret="s3cret")))
    p.run(accept_with=SERVER_TCP)
    assert [type(x) for x in p.to_client] == [m.AuthChallenge, m.Welcome]
    assert p.client.result().authenticated and p.server.result().authenticated
    assert len(p.to_client[-1].proof) == 32


def test_highest_common_version_is_negotiated():
    p = Pair(ClientHandshake(config(1, versions=(1, 3))), ServerHandshake(config(2, versions=(2, 5))))
    p.run(accept_with=SERVER_TCP)
    assert p.client.result().version == p.server.result().version == 3


def test_version_mismatch_refused():
    p = Pair(ClientHandshake(config(1, versions=(3, 4))), ServerHandshake(config(2, versions=(1, 2))))
    p.run(accept_with=SERVER_TCP)
    assert p.server.state is p.client.state is HandshakeState.REFUSED
    assert p.client.refused_by_peer and "no common protocol version" in p.client.refusal.reason
    with pytest.raises(HandshakeRefused) as exc:
        p.client.result()
    assert exc.value.status_code is LLMStatusCode.LLM_LINK_FAILED and exc.value.by_peer
    assert isinstance(exc.value, RemoteError)


def test_wrong_secret_refused_and_client_learns_nothing():
    p = Pair(ClientHandshake(config(1, secret=b"wrong", versions=(7, 7))), ServerHandshake(config(2, secret=b"right")))
    p.run(accept_with=SERVER_TCP)
    assert p.server.state is HandshakeState.REFUSED and p.client.state is HandshakeState.REFUSED
    assert [type(x) for x in p.to_client] == [m.AuthChallenge, m.Refuse]
    refusal = p.to_client[-1]
    # authentication is checked before versions: nothing about the server's versions leaks
    assert refusal.reason == "authentication failed" and refusal.status_code == LLMStatusCode.LLM_LINK_FAILED.value
    challenge = p.to_client[0]
    assert set(asdict(challenge)) == {"nonce", "incarnation"}
    assert p.server.hello is None and p.server.peer is None and p.client.peer is None
    with pytest.raises(HandshakeRefused, match="authentication failed"):
        p.client.result()


def test_no_secret_presented_when_required():
    p = Pair(ClientHandshake(config(1)), ServerHandshake(config(2, secret=b"k")))
    p.run(accept_with=SERVER_TCP)
    assert p.client.state is HandshakeState.REFUSED and not p.client.refused_by_peer
    assert "requires authentication" in p.client.refusal.reason
    assert p.server.state is HandshakeState.REFUSED and p.server.refused_by_peer
    with pytest.raises(HandshakeRefused) as exc:
        p.server.result()
    assert exc.value.by_peer


def test_raw_client_skipping_auth_is_refused():
    server = ServerHandshake(config(2, secret=b"k"))
    hello = SAMPLES[m.Hello]
    assert isinstance(server.receive(hello)[0], m.AuthChallenge)
    out = server.receive(SAMPLES[m.RegionsUpdate])  # pretends to be linked
    assert isinstance(out[0], m.Refuse) and server.state is HandshakeState.REFUSED
    assert server.hello is None


def test_client_with_secret_refuses_unauthenticated_server():
    p = Pair(ClientHandshake(config(1, secret=b"k")), ServerHandshake(config(2)))
    p.run(accept_with=SERVER_TCP)
    # the server accepted (it needs no auth) but the client refuses the downgrade
    assert p.client.state is HandshakeState.REFUSED and "did not authenticate" in p.client.refusal.reason
    assert p.client.peer is None


def _authenticated_pair(secret=b"k"):
    client = ClientHandshake(config(1, secret=secret))
    server = ServerHandshake(config(2, secret=secret))
    hello = client.start()
    (challenge,) = server.receive(hello)
    (response,) = client.receive(challenge)
    assert server.receive(response) == []
    return client, server, hello, challenge, response


def test_replayed_auth_response_fails_on_new_connection():
    _, _, hello, _, response = _authenticated_pair()
    fresh = ServerHandshake(config(2, secret=b"k"))
    fresh.receive(hello)  # same Hello replayed, new server nonce
    (refusal,) = fresh.receive(response)
    assert isinstance(refusal, m.Refuse) and fresh.state is HandshakeState.REFUSED


def test_tampered_hello_fails_authentication():
    client = ClientHandshake(config(1, secret=b"k"))
    server = ServerHandshake(config(2, secret=b"k"))
    hello = client.start()
    forged = replace(hello, transports=(m.TransportOffer(name="tcp", descriptor=m.TransportDescriptor(transport="tcp", payload=b"evil")),))
    (challenge,) = server.receive(forged)
    (response,) = client.receive(challenge)
    (refusal,) = server.receive(response)
    assert isinstance(refusal, m.Refuse) and refusal.reason == "authentication failed"


def test_tampered_welcome_is_rejected_by_client():
    client, server, *_ = _authenticated_pair()
    welcome = server.accept(SERVER_TCP)
    forged = replace(welcome, cluster_id=99)
    (refusal,) = client.receive(forged)
    assert isinstance(refusal, m.Refuse) and "failed authentication" in refusal.reason
    assert client.state is HandshakeState.REFUSED


def test_server_host_policy_refusal_carries_its_code():
    client = ClientHandshake(config(1))
    server = ServerHandshake(config(2))
    assert server.receive(client.start()) == []
    assert server.state is HandshakeState.AUTHENTICATED
    refusal = server.refuse(LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT, "too many links")
    assert client.receive(refusal) == []
    with pytest.raises(HandshakeRefused) as exc:
        client.result()
    assert exc.value.status_code is LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    with pytest.raises(InvalidStateError):
        server.refuse(LLMStatusCode.LLM_LINK_FAILED, "again")


def test_accept_checks():
    server = ServerHandshake(config(2))
    with pytest.raises(InvalidStateError):
        server.accept(SERVER_TCP)
    server.receive(ClientHandshake(config(1, transports=(SHM,))).start())
    with pytest.raises(LocalUsageError, match="not offered"):
        server.accept(SERVER_TCP)
    with pytest.raises(LocalUsageError):
        server.accept("shm")
    assert server.state is HandshakeState.AUTHENTICATED
    server.accept(m.TransportOffer(name="shm", deferred=True))
    assert server.state is HandshakeState.ESTABLISHED


def test_client_rejects_unoffered_transport_and_wrong_cluster():
    client = ClientHandshake(config(1, transports=(SHM,)))
    client.start()
    bad = m.Welcome(version=1, cluster_id=2, incarnation=INC_B, role=1, transport=SERVER_TCP, host=HOST)
    (refusal,) = client.receive(bad)
    assert "not offered" in refusal.reason
    client2 = ClientHandshake(config(1), expected_cluster_id=5)
    client2.start()
    (refusal,) = client2.receive(bad)
    assert "expected 5" in refusal.reason
    client3 = ClientHandshake(config(1, versions=(1, 1)))
    client3.start()
    (refusal,) = client3.receive(replace(bad, version=4))
    assert "protocol version 4" in refusal.reason
    client4 = ClientHandshake(config(1))
    client4.start()
    (refusal,) = client4.receive(replace(bad, proof=b"p" * 32))
    assert "unexpected authentication proof" in refusal.reason


def test_client_call_order():
    client = ClientHandshake(config(1))
    with pytest.raises(InvalidStateError):
        client.receive(SAMPLES[m.Welcome])
    with pytest.raises(InvalidStateError):
        client.result()
    client.start()
    with pytest.raises(InvalidStateError):
        client.start()
    client.refuse(LLMStatusCode.LLM_LINK_FAILED, "timeout")
    with pytest.raises(InvalidStateError):
        client.receive(SAMPLES[m.Welcome])


def test_secret_never_in_repr():
    cfg = config(1, secret=b"top-secret-value")
    assert "top-secret" not in repr(cfg)
    assert "top-secret" not in repr(ClientHandshake(cfg))
    with pytest.raises(LocalUsageError):
        config(1, secret=b"")


def _client_in(state: HandshakeState) -> ClientHandshake:
    client = ClientHandshake(config(1, secret=b"k"))
    hello = client.start()
    if state is HandshakeState.AUTH_SENT:
        server = ServerHandshake(config(2, secret=b"k"))
        client.receive(server.receive(hello)[0])
    assert client.state is state
    return client


def _server_in(state: HandshakeState) -> ServerHandshake:
    secret = b"k" if state is HandshakeState.CHALLENGED else None
    server = ServerHandshake(config(2, secret=secret))
    if state is not HandshakeState.AWAIT_HELLO:
        server.receive(SAMPLES[m.Hello])
    assert server.state is state
    return server


CLIENT_STATES = [HandshakeState.HELLO_SENT, HandshakeState.AUTH_SENT]
SERVER_STATES = [HandshakeState.AWAIT_HELLO, HandshakeState.CHALLENGED, HandshakeState.AUTHENTICATED]


@pytest.mark.parametrize("state", CLIENT_STATES, ids=lambda s: s.value)
@pytest.mark.parametrize("cls", m.MESSAGE_CLASSES, ids=lambda c: c.__name__)
def test_client_table_every_pair(state, cls):
    client = _client_in(state)
    out = client.receive(SAMPLES[cls])
    if (state, cls) in hs.CLIENT_RULES:
        return  # legal pairs are covered by the path tests above
    if cls is m.Refuse:
        assert out == [] and client.refused_by_peer
    else:
        assert len(out) == 1 and isinstance(out[0], m.Refuse) and "unexpected" in out[0].reason
    assert client.state is HandshakeState.REFUSED and client.peer is None


@pytest.mark.parametrize("state", SERVER_STATES, ids=lambda s: s.value)
@pytest.mark.parametrize("cls", m.MESSAGE_CLASSES, ids=lambda c: c.__name__)
def test_server_table_every_pair(state, cls):
    server = _server_in(state)
    out = server.receive(SAMPLES[cls])
    if (state, cls) in hs.SERVER_RULES:
        return
    if cls is m.Refuse:
        assert out == [] and server.refused_by_peer
    else:
        assert len(out) == 1 and isinstance(out[0], m.Refuse) and "unexpected" in out[0].reason
        assert out[0].status_code == LLMStatusCode.LLM_LINK_FAILED.value
    assert server.state is HandshakeState.REFUSED and server.peer is None


def test_rule_tables_name_real_handlers():
    assert set(hs.CLIENT_RULES.values()) == {"_on_challenge", "_on_welcome", "_peer_refused"}
    assert set(hs.SERVER_RULES.values()) == {"_on_hello", "_on_auth_response", "_peer_refused"}


# --------------------------------------------------------------------------- descriptor tables

def region(rid, addr, size, cache_id=-1):
    return m.RegionDescriptor(region_id=rid, cache_id=cache_id, addr=addr, size=size)


def test_regions_versions_move_forward_only():
    t = DescriptorTables()
    t.apply(m.RegionsUpdate(version=1, added=(region(1, 0x1000, 0x1000),)))
    t.apply(m.RegionsUpdate(version=2, added=(region(2, 0x4000, 0x100),)))
    assert t.regions_version == 2 and set(t.regions) == {1, 2}
    for bad in (1, 2, 4):  # older, repeated, gap
        with pytest.raises(TableUpdateError):
            t.apply(m.RegionsUpdate(version=bad, added=(region(3, 0x9000, 1),)))
    assert t.regions_version == 2 and set(t.regions) == {1, 2}
    t.apply(m.RegionsUpdate(version=3, removed=(1,)))
    assert set(t.regions) == {2}
    with pytest.raises(TableUpdateError, match="unknown"):
        t.apply(m.RegionsUpdate(version=4, removed=(1,)))
    with pytest.raises(TableUpdateError, match="already announced"):
        t.apply(m.RegionsUpdate(version=4, added=(region(2, 0, 1),)))
    with pytest.raises(TableUpdateError, match="twice"):
        t.apply(m.RegionsUpdate(version=4, added=(region(5, 0, 1), region(5, 0, 1))))
    t.apply(m.RegionsUpdate(version=4, removed=(2,), added=(region(2, 0x8000, 0x10),)))  # replace
    assert t.region(2).addr == 0x8000
    # full snapshot: any newer version, replaces everything
    t.apply(m.RegionsUpdate(version=10, full=True, added=(region(9, 0x10, 0x10),)))
    assert set(t.regions) == {9} and t.regions_version == 10
    with pytest.raises(TableUpdateError, match="not newer"):
        t.apply(m.RegionsUpdate(version=10, full=True))
    with pytest.raises(TableUpdateError, match="removes nothing"):
        t.apply(m.RegionsUpdate(version=11, full=True, removed=(9,)))
    assert isinstance(TableUpdateError("x"), ProtocolError)


def test_find_region():
    t = DescriptorTables()
    t.apply(m.RegionsUpdate(version=1, added=(region(1, 0x1000, 0x1000), region(2, 0x4000, 0x100),
                                              region(3, 0x10_0000, 0x10_0000))))
    assert t.find_region(0x1000, 0x1000).region_id == 1
    assert t.find_region(0x1800, 0x10).region_id == 1
    assert t.find_region(0x1800, 0x1000) is None  # crosses the end
    assert t.find_region(0x3000, 1) is None
    assert t.find_region(0x40FF, 1).region_id == 2
    assert t.find_region(0x10_0000 + 5, 100).region_id == 3
    assert t.find_region(0, 1) is None
    assert t.find_region(2**64 - 1, 1) is None


def test_regression_region_snapshot_in_descending_address_order_indexes_in_one_pass(monkeypatch):
    """A peer's regions snapshot in descending address order made the owner insert each region into
    its sorted address index one by one: a memmove of the index per region, quadratic (1.8 s of CPU
    for the 131,072 regions one 2.2 MB frame may carry).  Large updates now index in one pass (no
    per-entry insertion or deletion); small ones still bisect.  The index matches a reference sort
    after every update (seeded random orders)."""
    import bisect
    import random

    rnd = random.Random(12)
    one_by_one = {"insort": 0}
    real_insort = bisect.insort

    def counting_insort(*a, **k):
        one_by_one["insort"] += 1
        return real_insort(*a, **k)

    monkeypatch.setattr(bisect, "insort", counting_insort)
    t = DescriptorTables()

    def check(ids):
        assert set(t.regions) == set(ids)
        assert t._by_addr == sorted((t.region(rid).addr, rid) for rid in ids)
        for rid in rnd.sample(sorted(ids), min(len(ids), 50)):
            assert t.find_region(t.region(rid).addr, 0x100).region_id == rid

    n = 4096
    snapshot = tuple(region(i, (n - i) * 0x1000, 0x100) for i in range(n))   # descending addresses
    t.apply(m.RegionsUpdate(version=1, full=True, added=snapshot))
    assert one_by_one["insort"] == 0
    check(range(n))
    removed = rnd.sample(range(n), 1000)
    added = tuple(region(n + i, rnd.randrange(1, 2**40) * 0x1000, 0x100) for i in range(1000))
    t.apply(m.RegionsUpdate(version=2, removed=tuple(removed), added=added))
    assert one_by_one["insort"] == 0
    ids = (set(range(n)) - set(removed)) | {n + i for i in range(1000)}
    check(ids)
    t.apply(m.RegionsUpdate(version=3, removed=(n,), added=(region(10**6, 0x10, 0x100),
                                                             region(10**6 + 1, 2**50, 0x100))))
    assert one_by_one["insort"] == 2                                          # small: bisect
    check((ids - {n}) | {10**6, 10**6 + 1})


def test_cache_table_resolves_all_key_kinds():
    t = DescriptorTables()
    blocks = m.CacheEntry(cache_id=8, addrs=(0x2000,), tensor_size=4096, shape=(16, 256), is_blocks=True)
    prefix = m.KeyRef.for_prefix(prefix_id=1, model_id=0)
    t.apply(m.CacheTableUpdate(version=1, caches_added=(CACHE, blocks), keys_added=(
        m.KeyEntry(key=KEY_REQ, cache_id=3, batch_index=2), m.KeyEntry(key=prefix, cache_id=3),
        m.KeyEntry(key=KEY_BLOCKS, cache_id=8))))
    assert t.cache(3) == CACHE  # CacheKeyByIdAndIndex
    assert t.lookup_key(m.KeyRef.for_req(11)).batch_index == 2  # CacheKey(req_id)
    assert t.lookup_key(prefix).cache_id == 3  # CacheKey(prefix_id)
    assert t.lookup_key(m.KeyRef.for_blocks(2**63 + 5)).cache_id == 8  # BlocksCacheKey
    assert t.lookup_key(m.KeyRef.for_req(12)) is None
    # removing a key, then a cache drops the keys bound to it
    t.apply(m.CacheTableUpdate(version=2, keys_removed=(KEY_REQ,)))
    assert t.lookup_key(KEY_REQ) is None
    t.apply(m.CacheTableUpdate(version=3, caches_removed=(3,)))
    assert t.lookup_key(prefix) is None and t.cache(3) is None and t.lookup_key(KEY_BLOCKS) is not None
    with pytest.raises(TableUpdateError, match="unknown cache"):
        t.apply(m.CacheTableUpdate(version=4, keys_added=(m.KeyEntry(key=KEY_REQ, cache_id=3),)))
    with pytest.raises(TableUpdateError, match="already bound"):
        t.apply(m.CacheTableUpdate(version=4, keys_added=(m.KeyEntry(key=KEY_BLOCKS, cache_id=8),)))
    with pytest.raises(TableUpdateError, match="unknown"):
        t.apply(m.CacheTableUpdate(version=4, keys_removed=(KEY_REQ,)))
    with pytest.raises(TableUpdateError, match="stale or repeated"):
        t.apply(m.CacheTableUpdate(version=3))
    assert t.cache_table_version == 3 and set(t.caches) == {8} and set(t.keys) == {KEY_BLOCKS}
    t.apply(m.CacheTableUpdate(version=7, full=True, caches_added=(CACHE,)))
    assert set(t.caches) == {3} and not t.keys
    with pytest.raises(LocalUsageError):
        t.apply(SAMPLES[m.Keepalive])


def test_announcer_numbers_versions_and_refuses_bad_updates():
    ann = TableAnnouncer()
    peer = DescriptorTables()
    u1 = ann.regions_update(added=[region(1, 0, 10)])
    u2 = ann.regions_update(removed=[1])
    assert (u1.version, u2.version) == (1, 2)
    with pytest.raises(LocalUsageError):
        ann.regions_update(removed=[1])
    c1 = ann.cache_table_update(caches_added=[CACHE], keys_added=[m.KeyEntry(key=KEY_REQ, cache_id=3)])
    assert c1.version == 1
    with pytest.raises(LocalUsageError):
        ann.cache_table_update(keys_added=[m.KeyEntry(key=KEY_REQ, cache_id=99)])
    # the peer accepts exactly what the announcer built, through the wire
    tx, rx = Connection(), Connection()
    for msg in feed(rx, tx.send_many([u1, u2, c1])):
        peer.apply(msg)
    assert peer.regions_version == 2 and peer.cache_table_version == 1
    assert peer.lookup_key(KEY_REQ) == ann.announced.lookup_key(KEY_REQ)
    # a duplicated frame (replay) is rejected
    with pytest.raises(TableUpdateError):
        peer.apply(u2)


def _cache(cid, first, n):
    return m.CacheEntry(cache_id=cid, addrs=tuple(range(2**40 + first, 2**40 + first + n)), tensor_size=1, shape=(1,))


def test_regression_cache_table_deltas_of_2_pow_20_addresses_are_refused_before_they_are_held():
    """Each CacheTableUpdate delta adding one cache of 2**20 tensor addresses (a 9.4 MB frame) made the
    owner hold ~40 MiB more, without end (+200 MiB after 5).  A peer's caches may hold at most
    MAX_PEER_CACHE_ADDRS addresses in all (each is one of its tensor regions): such an update is a
    TableUpdateError (the link fails) and changes nothing; up to the cap is accepted (control), and
    removing a cache gives its addresses back."""
    t = DescriptorTables()
    with pytest.raises(TableUpdateError, match="tensor addresses"):
        t.apply(m.CacheTableUpdate(version=1, caches_added=(_cache(1, 0, 1 << 20),)))
    assert t.cache_table_version == 0 and t.cache(1) is None
    half = tb.MAX_PEER_CACHE_ADDRS // 2
    t.apply(m.CacheTableUpdate(version=1, caches_added=(_cache(1, 0, half),)))
    t.apply(m.CacheTableUpdate(version=2, caches_added=(_cache(2, half, half),)))       # exactly at the cap
    with pytest.raises(TableUpdateError, match="tensor addresses"):
        t.apply(m.CacheTableUpdate(version=3, caches_added=(_cache(3, 2 * half, 1),)))
    assert t.cache(3) is None and t.cache_table_version == 2
    t.apply(m.CacheTableUpdate(version=3, caches_removed=(1,), caches_added=(_cache(3, 2 * half, half),)))
    assert t.cache(1) is None and len(t.cache(3).addrs) == half
    t.apply(m.CacheTableUpdate(version=4, full=True, caches_added=(_cache(9, 0, tb.MAX_PEER_CACHE_ADDRS),)))
    assert [c for c in (1, 2, 3, 9) if t.cache(c) is not None] == [9]


def test_region_descriptors_are_held_within_a_per_region_and_a_per_peer_byte_budget():
    """A region's transport descriptor may not pass MAX_REGION_DESCRIPTOR_BYTES (encoded), nor a peer's
    descriptors together MAX_PEER_DESCRIPTOR_BYTES; a refused update changes nothing, a removal gives
    its bytes back, a snapshot starts the count again."""
    t = DescriptorTables()
    big = (m.TransportDescriptor(transport="x", payload=b"d" * tb.MAX_REGION_DESCRIPTOR_BYTES),)
    with pytest.raises(TableUpdateError, match="per region"):
        t.apply(m.RegionsUpdate(version=1, added=(m.RegionDescriptor(region_id=1, cache_id=-1, addr=0x1000, size=16,
                                                                      transports=big),)))
    assert t.regions_version == 0 and t.regions == {}
    per = tb.MAX_REGION_DESCRIPTOR_BYTES - 64
    n = tb.MAX_PEER_DESCRIPTOR_BYTES // (per + 8)
    full = tuple(m.RegionDescriptor(region_id=i, cache_id=-1, addr=0x1000 * (i + 1), size=16,
                                    transports=(m.TransportDescriptor(transport="x", payload=b"d" * per),))
                 for i in range(n))
    t.apply(m.RegionsUpdate(version=1, full=True, added=full))
    one_more = m.RegionDescriptor(region_id=n, cache_id=-1, addr=0x1000 * (n + 1), size=16,
                                  transports=(m.TransportDescriptor(transport="x", payload=b"d" * per),))
    with pytest.raises(TableUpdateError, match="bytes of region descriptors"):
        t.apply(m.RegionsUpdate(version=2, added=(one_more,)))
    assert len(t.regions) == n and t.regions_version == 1
    t.apply(m.RegionsUpdate(version=2, removed=(0,), added=(one_more,)))                 # a removal frees its bytes
    assert 0 not in t.regions and n in t.regions
    t.apply(m.RegionsUpdate(version=3, full=True, added=(one_more,)))                    # a snapshot counts anew
    t.apply(m.RegionsUpdate(version=4, added=full[1:]))
    assert len(t.regions) == n
