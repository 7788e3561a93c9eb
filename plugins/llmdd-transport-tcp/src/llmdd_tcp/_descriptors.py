"""The payloads of the tcp transport's endpoint and region descriptors (version :data:`VERSION`)."""

from __future__ import annotations

import msgspec
from llmdd.abc import EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import decode_payload

from ._wire import VERSION


class EndpointFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a tcp :class:`~llmdd.abc.EndpointDescriptor` (version :data:`VERSION`); the
    data capability travels beside it, in the descriptor's ``capability``."""

    host: str
    port: int
    endpoint_id: bytes
    auth: bool = False
    tls: bool = False
    pid: int = 0
    hostname: str = ""


class RegionFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a tcp :class:`~llmdd.abc.RegionDescriptor` (version :data:`VERSION`)."""

    endpoint_id: bytes
    region_id: int
    size: int
    remote_accessible: bool


def endpoint_fields(desc: EndpointDescriptor) -> EndpointFields:
    """The fields of a tcp endpoint descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="tcp", version=VERSION, type=EndpointFields)


def region_fields(desc: RegionDescriptor) -> RegionFields:
    """The fields of a tcp region descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="tcp", version=VERSION, type=RegionFields)
