"""Property tests of the control-plane codec: round trips, arbitrary splitting, hostile bytes."""

from __future__ import annotations

import struct
import tracemalloc

import msgspec
from hypothesis import given, settings, strategies as st

from llmdd._base.enums import LLMRole, Placement
from llmdd._protocol import messages as m
from llmdd._protocol.codec import (
    HEADER_SIZE,
    MESSAGE_TYPES,
    NEED_DATA,
    PEER_CLOSED,
    WIRE_VERSION,
    Connection,
    ProtocolError,
    decode_payload,
    encode_frame,
    encode_payload,
)

FAST = settings(max_examples=300)

u8 = st.integers(0, m.U8_MAX)
u16 = st.integers(0, m.U16_MAX)
u32 = st.integers(0, m.U32_MAX)
u64 = st.integers(0, m.U64_MAX)
i64 = st.integers(m.I64_MIN, m.I64_MAX)
any64 = st.integers(m.I64_MIN, m.U64_MAX)
text = st.text(max_size=12)
incarnation = st.binary(min_size=16, max_size=16)
nonce = st.binary(min_size=m.NONCE_MIN_SIZE, max_size=m.NONCE_MAX_SIZE)
small = dict(max_size=3)

scalars = (st.none() | st.booleans() | any64 | st.floats(allow_nan=False) | text | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                      max_leaves=8)
descriptors = st.dictionaries(text, values, max_size=4)

hosts = st.builds(m.HostIdentity, boot_id=text, machine_id=text, uid=i64, pid=i64,
                  namespaces=st.dictionaries(text, text, max_size=3))
tnames = st.text(min_size=1, max_size=12)
payloads = st.binary(max_size=64)
capabilities = st.none() | st.binary(min_size=16, max_size=64)
tdescs = st.builds(m.TransportDescriptor, transport=tnames, version=u32, payload=payloads)
offers = (st.builds(lambda n, v, p, c: m.TransportOffer(name=n, descriptor=m.TransportDescriptor(transport=n, version=v,
                                                                                                payload=p),
                                                        capability=c), tnames, u32, payloads, capabilities)
          | st.builds(lambda n: m.TransportOffer(name=n, deferred=True), tnames))
roles = st.sampled_from(list(LLMRole))
placements = st.sampled_from(list(Placement))
regions = st.builds(m.RegionDescriptor, region_id=u32, cache_id=i64, addr=u64, size=u64, placement=placements,
                    remote_accessible=st.booleans(),
                    transports=st.lists(tdescs, max_size=3, unique_by=lambda d: d.transport).map(tuple))
keyrefs = st.one_of(
    st.builds(m.KeyRef.for_req, u64, any64),
    st.builds(m.KeyRef.for_prefix, u64, any64),
    st.builds(m.KeyRef.for_blocks, any64),
)
spans = st.tuples(u64, u64).map(sorted).map(lambda se: m.Span(start=se[0], stop=se[1]))
caches = st.builds(m.CacheEntry, cache_id=i64, addrs=st.lists(u64, **small), tensor_size=u64,
                   shape=st.lists(i64, max_size=4), data_type=u16, placement=placements, is_blocks=st.booleans())


@st.composite
def transfer_done(draw, tagged=False):
    tag = draw(st.binary(max_size=m.MAX_TAG_BYTES) if tagged else st.none() | st.binary(max_size=m.MAX_TAG_BYTES))
    return m.TransferDone(cache_id=draw(i64), block_spans=draw(st.lists(spans, **small).map(tuple)),
                          tensors=draw(st.none() | spans), failed=draw(st.booleans()), status=draw(u32),
                          tag=tag, tag_str=tag is not None and draw(st.booleans()))


version_pairs = st.tuples(u16, u16).map(sorted)

MESSAGES = {
    m.Hello: version_pairs.flatmap(lambda v: st.builds(
        m.Hello, min_version=st.just(v[0]), max_version=st.just(v[1]), cluster_id=u64, incarnation=incarnation,
        role=roles, transports=st.lists(offers, **small), host=hosts, nonce=nonce)),
    m.AuthChallenge: st.builds(m.AuthChallenge, nonce=nonce, incarnation=incarnation),
    m.AuthResponse: st.builds(m.AuthResponse, mac=st.binary(min_size=32, max_size=32)),
    m.Welcome: st.builds(m.Welcome, version=u16, cluster_id=u64, incarnation=incarnation, role=roles,
                         transport=offers, host=hosts,
                         proof=st.sampled_from([b"", b"\x00" * 32]) | st.binary(min_size=32, max_size=32)),
    m.Refuse: st.builds(m.Refuse, status_code=i64, reason=text),
    m.RegionsUpdate: st.builds(m.RegionsUpdate, version=u64, full=st.booleans(), added=st.lists(regions, **small),
                               removed=st.lists(u32, **small)),
    m.CacheTableUpdate: st.builds(
        m.CacheTableUpdate, version=u64, full=st.booleans(), caches_added=st.lists(caches, **small),
        caches_removed=st.lists(i64, **small),
        keys_added=st.lists(st.builds(m.KeyEntry, key=keyrefs, cache_id=i64, batch_index=u32), **small),
        keys_removed=st.lists(keyrefs, **small)),
    m.Keepalive: st.builds(m.Keepalive, seq=u64, sent_at_ns=u64),
    m.KeepaliveAck: st.builds(m.KeepaliveAck, seq=u64, echo_sent_at_ns=u64, sent_at_ns=u64),
    m.UnlinkRequest: st.builds(m.UnlinkRequest, request_id=u64, force=st.booleans(), reason=text),
    m.UnlinkAck: st.builds(m.UnlinkAck, request_id=u64, status_code=i64),
    # the hot notice types keep what they are given (no construction conversion): build tuples
    m.ReadDone: st.builds(m.ReadDone, entries=st.lists(st.builds(
        m.ReadDoneEntry, cache_id=i64, key=st.none() | keyrefs,
        block_bounds=st.lists(u64, **small).map(tuple)), **small).map(tuple)),
    m.KeyConsumed: st.builds(m.KeyConsumed, key=keyrefs, cache_id=i64, tensor_spans=st.lists(spans, **small)),
    m.ReleaseKey: st.builds(m.ReleaseKey, id=u64, model_id=u64),
    m.PushDone: st.builds(m.PushDone, entries=st.lists(transfer_done(), **small)),
    m.TaggedDone: st.builds(m.TaggedDone, request_id=u64, push=st.booleans(), entry=transfer_done(tagged=True)),
    m.TransferRequest: st.builds(m.TransferRequest, request_id=u64, op=text, args=descriptors),
    m.TransferReply: st.builds(m.TransferReply, request_id=u64, status_code=i64, result=descriptors),
    m.Error: st.builds(m.Error, status_code=i64, message=text, fatal=st.booleans()),
}
assert set(MESSAGES) == set(m.MESSAGE_CLASSES)
any_message = st.one_of(*MESSAGES.values())


def drain(conn: Connection) -> tuple[list, object]:
    """Collect messages until NEED_DATA / PEER_CLOSED / ProtocolError; never anything else."""
    out: list = []
    while True:
        try:
            msg = conn.next_message()
        except ProtocolError as exc:
            return out, exc
        if msg is NEED_DATA or msg is PEER_CLOSED:
            return out, msg
        assert type(msg) in MESSAGE_TYPES
        out.append(msg)


@FAST
@given(any_message, st.booleans())
def test_round_trip(msg, checksum):
    frame = encode_frame(msg, checksum=checksum)
    conn = Connection()
    conn.receive_data(frame)
    got, end = drain(conn)
    assert got == [msg] and end is NEED_DATA
    payload = encode_payload(msg)
    assert encode_payload(decode_payload(MESSAGE_TYPES[type(msg)], payload)) == payload  # canonical


@FAST
@given(st.lists(any_message, min_size=1, max_size=6), st.data())
def test_random_splitting_gives_same_messages(msgs, data):
    stream = Connection().send_many(msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    conn = Connection()
    got: list = []
    prev = 0
    for cut in cuts + [len(stream)]:
        if cut == prev:
            continue  # b"" would mean EOF
        conn.receive_data(stream[prev:cut])
        prev = cut
        more, end = drain(conn)
        assert end is NEED_DATA
        got += more
    conn.receive_data(b"")
    more, end = drain(conn)
    assert got + more == msgs and end is PEER_CLOSED


#: what decoding hostile bytes may allocate at its peak beyond the bytes themselves: the connection, one
#: decoded frame's objects, the error; a declared count or length is never allocated ahead of its bytes
HOSTILE_PEAK = 256 * 1024


def _check_hostile(data: bytes, *, max_frame_size: int = 1 << 20, eof: bool = True) -> None:
    """The codec on hostile bytes: it ends in NEED_DATA, PEER_CLOSED or one sticky ProtocolError, and
    its peak allocation is bounded by the input (tracemalloc, a count of bytes: no clock; a loop over a
    declared count would hit the test's own timeout)."""
    tracemalloc.start()
    try:
        _hostile(data, max_frame_size=max_frame_size, eof=eof)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= HOSTILE_PEAK + 4 * len(data), (peak, len(data))


def _hostile(data: bytes, *, max_frame_size: int, eof: bool) -> None:
    conn = Connection(max_frame_size=max_frame_size)
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    _, end = drain(conn)
    assert end is NEED_DATA or end is PEER_CLOSED or isinstance(end, ProtocolError)
    if isinstance(end, ProtocolError):
        try:
            conn.next_message()
        except ProtocolError as again:
            assert again is end
        else:
            raise AssertionError("a dead connection answered")


@FAST
@given(st.binary(max_size=512), st.booleans())
def test_random_bytes(data, eof):
    _check_hostile(data, eof=eof)


@FAST
@given(st.sampled_from(sorted(MESSAGE_TYPES.values())), st.binary(max_size=256))
def test_random_payload_behind_a_valid_header(code, payload):
    header = b"LD" + bytes([WIRE_VERSION, code, 0]) + struct.pack(">I", len(payload))
    _check_hostile(header + payload)


# any MessagePack value (maps with str or int keys, ext types, big and negative ints, floats, bytes)
mp_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
              | st.binary(max_size=8) | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=4)))
mp_values = st.recursive(mp_scalars, lambda inner: st.lists(inner, max_size=5)
                         | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4), max_leaves=20)


@FAST
@given(st.sampled_from(sorted(MESSAGE_TYPES.values())), mp_values)
def test_well_formed_msgpack_of_the_wrong_shape(code, value):
    """Valid MessagePack that is not (or only nearly) the message its header names: refused, quickly."""
    payload = msgspec.msgpack.encode(value)
    _check_hostile(b"LD" + bytes([WIRE_VERSION, code, 0]) + struct.pack(">I", len(payload)) + payload)


@FAST
@given(any_message, st.data())
def test_one_field_replaced_by_any_value(msg, data):
    """A real message with one top-level field swapped for an arbitrary MessagePack value: either
    it decodes to a message that passes every check (the value happened to fit) or ProtocolError."""
    fields = list(msgspec.structs.astuple(msg))
    i = data.draw(st.integers(0, len(fields) - 1))
    fields[i] = data.draw(mp_values)
    try:
        payload = msgspec.msgpack.encode(fields)
    except (TypeError, OverflowError, ValueError):
        return
    code = MESSAGE_TYPES[type(msg)]
    conn = Connection()
    conn.receive_data(b"LD" + bytes([WIRE_VERSION, code, 0]) + struct.pack(">I", len(payload)) + payload)
    got, end = drain(conn)
    if got:
        assert len(got) == 1 and type(got[0]) is type(msg) and end is NEED_DATA
        if type(msg) is not m.ReadDone:
            assert encode_payload(got[0]) == payload  # canonical, and it passes the encoder's own checks
    else:
        assert isinstance(end, ProtocolError)


@FAST
@given(st.lists(any_message, min_size=1, max_size=3), st.booleans(), st.data())
def test_mutated_frames(msgs, checksum, data):
    stream = bytearray(Connection(checksum=checksum).send_many(msgs))
    kind = data.draw(st.sampled_from(["flip", "truncate", "length", "insert", "delete", "splice"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(stream) - 1))
            stream[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        del stream[data.draw(st.integers(0, len(stream) - 1)):]
    elif kind == "length":  # rewrite the length field of the first frame
        stream[5:HEADER_SIZE] = struct.pack(">I", data.draw(st.integers(0, 2**32 - 1)))
    elif kind == "insert":
        i = data.draw(st.integers(0, len(stream)))
        stream[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    elif kind == "delete":
        i = data.draw(st.integers(0, len(stream) - 1))
        del stream[i:i + data.draw(st.integers(1, 8))]
    else:  # overwrite a window with random bytes
        i = data.draw(st.integers(0, len(stream) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        stream[i:i + len(chunk)] = chunk
    _check_hostile(bytes(stream), eof=data.draw(st.booleans()))
    _check_hostile(bytes(stream), max_frame_size=64, eof=True)


@settings(max_examples=30)
@given(st.integers(1, 2**32 - 1), st.integers(0, 0x7F))
def test_huge_counts_are_cheap(count, code):
    """A payload that declares a huge count is refused without allocating for it (the peak is bounded
    by the bytes given, _check_hostile): as the top-level array, as a map inside it, as a string length."""
    for payload in (b"\xdd" + struct.pack(">I", count) + b"\x00" * 8,
                    b"\x93\x00\xa0\xdf" + struct.pack(">I", count) + b"\xa1k\xc0" * 4,
                    b"\x93\x00\xdb" + struct.pack(">I", count) + b"x" * 8):
        _check_hostile(b"LD" + bytes([WIRE_VERSION, code, 0]) + struct.pack(">I", len(payload)) + payload)
