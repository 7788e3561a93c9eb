"""The payloads of the ucx transport's descriptors (endpoint and region), at version :data:`VERSION`."""

from __future__ import annotations

import msgspec

from llmdd.abc import EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import decode_payload

VERSION = 1


class EndpointFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a ucx :class:`~llmdd.abc.EndpointDescriptor` (version :data:`VERSION`)."""

    agent: str
    metadata: bytes          # the NIXL agent's connection metadata (no region key)
    host: str = ""
    hostname: str = ""
    pid: int = 0


class RegionFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a ucx :class:`~llmdd.abc.RegionDescriptor` (version :data:`VERSION`)."""

    agent: str
    region_id: int
    addr: int
    size: int
    dev_id: int = 0
    mem: str = "DRAM"
    gen: int = 0
    remote_accessible: bool = True
    metadata: bytes = b""    # the NIXL partial metadata with this region's key (remote-accessible only)


def endpoint_fields(desc: EndpointDescriptor) -> EndpointFields:
    """The fields of a ucx endpoint descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="ucx", version=VERSION, type=EndpointFields)


def region_fields(desc: RegionDescriptor) -> RegionFields:
    """The fields of a ucx region descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="ucx", version=VERSION, type=RegionFields)
