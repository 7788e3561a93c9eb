"""Frame MACs of the control codec (issue 14, item 3): after an authenticated handshake every frame
carries HMAC-SHA256(direction key, seq | header | payload); modified, replayed, reordered, unsigned
or wrong-direction frames are a ProtocolError."""

from __future__ import annotations

import secrets

import pytest

from llmdd._protocol import messages as m
from llmdd._protocol.codec import FLAG_MAC, NEED_DATA, Connection, ProtocolError

pytestmark = pytest.mark.timeout(30)


def _pair(key: bytes = b"k" * 32):
    client, server = Connection(), Connection()
    client.enable_frame_mac(key, client=True)
    server.enable_frame_mac(key, client=False)
    return client, server


def _msgs(n: int) -> list:
    return [m.Keepalive(seq=i + 1, sent_at_ns=1000 * (i + 1)) for i in range(n)]


def _feed(conn: Connection, data: bytes):
    conn.receive_data(data)
    return conn.next_message()


def test_macd_frames_round_trip_both_ways_in_order():
    c, s = _pair(secrets.token_bytes(32))
    for msg in _msgs(5):
        frame = c.send(msg)
        assert frame[4] == FLAG_MAC and len(frame) > 32
        assert _feed(s, frame) == msg
        back = m.KeepaliveAck(seq=msg.seq, echo_sent_at_ns=msg.sent_at_ns, sent_at_ns=7)
        assert _feed(c, s.send(back)) == back


@pytest.mark.parametrize("where", ["payload", "mac"])
def test_a_modified_frame_is_refused(where):
    c, s = _pair()
    frame = bytearray(c.send(_msgs(1)[0]))
    frame[10 if where == "payload" else len(frame) - 1] ^= 0x01
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s, bytes(frame))


def test_a_frame_whose_type_was_rewritten_is_refused():
    c, s = _pair()
    # the MAC covers the header: a rewritten type code fails the MAC before the payload is decoded
    frame = bytearray(c.send(m.KeepaliveAck(seq=1, echo_sent_at_ns=2, sent_at_ns=3)))
    control = bytes(frame)
    frame[3] = 0x20   # Keepalive's code
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s, bytes(frame))
    # control: the unmodified frame is accepted by a fresh receiver in the same state
    _, s2 = _pair()
    assert _feed(s2, control) == m.KeepaliveAck(seq=1, echo_sent_at_ns=2, sent_at_ns=3)


def test_a_replayed_frame_is_refused():
    c, s = _pair()
    first = c.send(_msgs(1)[0])
    assert _feed(s, first) == _msgs(1)[0]
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s, first)


def test_reordered_frames_are_refused():
    c, s = _pair()
    a, b = (c.send(x) for x in _msgs(2))
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s, b + a)


def test_a_dropped_frame_breaks_the_sequence():
    c, s = _pair()
    frames = [c.send(x) for x in _msgs(3)]
    assert _feed(s, frames[0]) == _msgs(3)[0]
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s, frames[2])


def test_unsigned_reflected_and_other_key_frames_are_refused():
    c, s = _pair()
    plain = Connection().send(_msgs(1)[0])            # CRC32 only
    with pytest.raises(ProtocolError, match="required MAC"):
        _feed(s, plain)
    c2, s2 = _pair()
    reflected = s2.send(_msgs(1)[0])                 # the server's own frame sent back to it
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s2, reflected)
    c3, s3 = _pair(b"another key, the same length....")
    with pytest.raises(ProtocolError, match="MAC"):
        _feed(s3, c.send(_msgs(1)[0]))


def test_a_macd_frame_before_macs_were_agreed_is_refused_and_partial_frames_wait():
    c, s = _pair()
    frame = c.send(_msgs(1)[0])
    with pytest.raises(ProtocolError, match="before frame MACs"):
        _feed(Connection(), frame)
    s.receive_data(frame[:-5])
    assert s.next_message() is NEED_DATA
    assert _feed(s, frame[-5:]) == _msgs(1)[0]
