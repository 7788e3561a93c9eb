"""The seam's typed descriptors (issue 17 point 1) and the control plane's conversions of them.

* a descriptor is frozen, bounded when built (payload at most MAX_PAYLOAD_BYTES, a transport name, a
  u32 version, a capability of 16..64 bytes) and refuses (Refused, with the reason) to hand its payload
  to another transport or to a reader of an older version; the control (the right transport, the same
  or an older version) gets the payload;
* decode_payload turns a malformed payload into Refused, never a decoder's exception;
* the wire form carries transport, version and payload unchanged; the capability travels as the offer's
  own field, and a link_descriptor request that does not make an offer is refused typed.
"""

from __future__ import annotations

import attrs
import msgspec
import numpy as np
import pytest

from llmdd._control import endpoints as E
from llmdd._protocol import messages as m
from llmdd.abc import MAX_PAYLOAD_BYTES, EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import MemRegion, Refused, SharedSegment, decode_payload, encode_payload

RNG = np.random.default_rng(20261202)


class Fields(msgspec.Struct, frozen=True):
    host: str
    port: int


def _payload(n: int) -> bytes:
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


def test_a_descriptor_hands_its_payload_only_to_its_transport_at_a_version_it_reads():
    payload = _payload(100)
    d = EndpointDescriptor(transport="acme", version=3, payload=payload)
    assert d.payload_for("acme", 3) == payload          # control: its own transport, its own version
    assert d.payload_for("acme", 7) == payload          # a newer reader reads an older payload
    with pytest.raises(Refused, match="'acme' descriptor given to the 'other'"):
        d.payload_for("other", 3)
    with pytest.raises(Refused, match="version 3 is newer"):
        d.payload_for("acme", 2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        d.payload = b""                                 # the point: it is frozen


@pytest.mark.parametrize("build, why", [
    (lambda: RegionDescriptor(transport="acme", version=1, payload=b"\0" * (MAX_PAYLOAD_BYTES + 1)), "exceeds"),
    (lambda: RegionDescriptor(transport="", version=1, payload=b""), "transport"),
    (lambda: RegionDescriptor(transport="a" * 65, version=1, payload=b""), "transport"),
    (lambda: RegionDescriptor(transport="acme", version=2**32, payload=b""), "version"),
    (lambda: RegionDescriptor(transport="acme", version=True, payload=b""), "version"),
    (lambda: RegionDescriptor(transport="acme", version=1, payload=bytearray(b"x")), "bytes"),
    (lambda: EndpointDescriptor(transport="acme", version=1, payload=b"", capability=b"short"), "capability"),
    (lambda: EndpointDescriptor(transport="acme", version=1, payload=b"", capability=b"c" * 65), "capability"),
])
def test_a_descriptor_is_bounded_when_built(build, why):
    with pytest.raises(Refused, match=why):
        build()


def test_the_largest_payload_builds_and_the_capability_never_shows():
    cap = _payload(32)
    d = EndpointDescriptor(transport="acme", version=1, payload=_payload(MAX_PAYLOAD_BYTES), capability=cap)
    assert len(d.payload) == MAX_PAYLOAD_BYTES
    assert cap.hex() not in repr(d) and repr(cap) not in repr(d) and "capability" not in repr(d)


def test_decode_payload_refuses_what_does_not_decode_to_the_transports_fields():
    good = EndpointDescriptor(transport="acme", version=1, payload=encode_payload(Fields("h", 5)))
    assert decode_payload(good, transport="acme", version=1, type=Fields) == Fields("h", 5)
    for bad in (b"\xc1", encode_payload({"host": "h"}), encode_payload(Fields("h", 5))[:-1],
                encode_payload({"host": 1, "port": 5})):
        with pytest.raises(Refused, match="malformed acme descriptor"):
            decode_payload(attrs.evolve(good, payload=bad), transport="acme", version=1, type=Fields)
    with pytest.raises(Refused, match="not a descriptor"):
        decode_payload({"host": "h", "port": 5}, transport="acme", version=1, type=Fields)


def test_mem_region_carries_a_typed_backing_not_shm_fields():
    r = MemRegion(region_id=1, addr=4096, size=64, remote_accessible=True, placement=0,
                  backing=SharedSegment(name="llmdd_seg", offset=128))
    assert r.backing == SharedSegment(name="llmdd_seg", offset=128)
    assert not hasattr(r, "shm_name") and not hasattr(r, "shm_offset")
    with pytest.raises(TypeError):
        MemRegion(region_id=1, addr=0, size=1, remote_accessible=True, placement=0, backing=("seg", 0))
    with pytest.raises(ValueError):
        SharedSegment(name="seg", offset=-1)


def test_the_wire_carries_descriptors_unchanged_and_the_capability_beside_them():
    payload = _payload(300)
    cap = _payload(32)
    ep_desc = EndpointDescriptor(transport="tcp", version=2, payload=payload, capability=cap)
    wire = E.to_wire(ep_desc)
    assert (wire.transport, wire.version, wire.payload) == ("tcp", 2, payload)
    offer = m.TransportOffer(name="tcp", descriptor=wire, capability=cap)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(offer), type=m.TransportOffer)
    assert E.endpoint_descriptor(back) == ep_desc
    assert E.endpoint_descriptor(m.TransportOffer(name="tcp", descriptor=wire)).capability is None
    with pytest.raises(Refused, match="deferred"):
        E.endpoint_descriptor(m.TransportOffer(name="tcp", deferred=True))
    region = m.RegionDescriptor(region_id=4, cache_id=-1, addr=0, size=64,
                                transports=(E.to_wire(RegionDescriptor(transport="shm", version=1, payload=payload)),))
    assert E.peer_region_descriptor(region, "shm") == RegionDescriptor(transport="shm", version=1, payload=payload)
    assert E.peer_region_descriptor(region, "tcp") is None


def test_a_link_descriptor_request_either_makes_an_offer_or_is_refused_typed():
    cap = _payload(32)
    offer = m.TransportOffer(name="tcp", descriptor=m.TransportDescriptor(transport="tcp", version=2,
                                                                          payload=_payload(40)), capability=cap)
    args = E.offer_args(offer)
    assert E.offer_from_args(args) == offer                      # control: what a correct client sends
    m.TransferRequest(request_id=1, op="link_descriptor", args=args)   # and the wire carries it
    hostile = [{}, {"name": "tcp", "descriptor": {"x": 1}}, dict(args, transport="shm"),
               dict(args, payload=b"\0" * (m.MAX_DESCRIPTOR_PAYLOAD + 1)), dict(args, version=-1),
               dict(args, capability=b"short"), dict(args, payload="text")]
    for bad in hostile:
        with pytest.raises((TypeError, ValueError)):
            E.offer_from_args(bad)
    with pytest.raises(ValueError, match="deferred"):
        E.offer_args(m.TransportOffer(name="tcp", deferred=True))
