"""Encoding a transport's descriptor payload (public in :mod:`llmdd.lowlevel`).

A descriptor's payload is the transport's own bytes; llmdd never reads them.  These two helpers are
what the built-in transports use: a ``msgspec.Struct`` of the transport's fields, MessagePack on the
wire, decoded with the struct's types checked (a missing, extra-typed or malformed field is a
:class:`~llmdd.lowlevel.Refused` with the reason, never a ``KeyError`` from deep inside a transport).
"""

from __future__ import annotations

from typing import Any, TypeVar, Union

import msgspec

from llmdd._seam.abc import EndpointDescriptor, RegionDescriptor
from llmdd._seam.errors import Refused

__all__ = ["encode_payload", "decode_payload"]

T = TypeVar("T")


def encode_payload(fields: Any) -> bytes:
    """``fields`` (a ``msgspec.Struct``, or plain data) as MessagePack bytes for a descriptor's payload."""
    return msgspec.msgpack.encode(fields)


def decode_payload(desc: Union[EndpointDescriptor, RegionDescriptor], *, transport: str, version: int,
                   type: type[T]) -> T:
    """The payload of ``desc`` decoded as ``type``, after :meth:`~EndpointDescriptor.payload_for` checked
    that it is ``transport``'s, of ``version`` or older; :class:`Refused` when anything does not fit."""
    if not isinstance(desc, (EndpointDescriptor, RegionDescriptor)):
        raise Refused(f"not a descriptor: {desc.__class__.__name__}")
    payload = desc.payload_for(transport, version)
    try:
        return msgspec.msgpack.decode(payload, type=type)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Refused(f"malformed {transport} descriptor: {exc}") from None
