"""What two shm endpoints agree on (version :data:`VERSION`): the payloads of their endpoint and region
descriptors, and the layout of an endpoint's control segment (header, one slot per remote-accessible
region with its state and generation) with the kinds of remote memory."""

from __future__ import annotations

import ctypes

import msgspec

from llmdd.abc import EndpointDescriptor, RegionDescriptor
from llmdd.lowlevel import decode_payload
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none

from . import _seg

VERSION = 1
CTL_MAGIC = 0x314D48534444_4C4C  # "LLDDSHM1"-ish tag in the header's first word
PROBE_MAGIC = 0x6C6C6D6464534850
MAX_SLOTS = 1 << 14
_HDR_WORDS = 8                      # magic, version, state, pid, id_lo, id_hi, nslots, reserved
_SLOTS_OFF = 4096
CTL_SIZE = _SLOTS_OFF + MAX_SLOTS * 16
CTL_OPEN, CTL_CLOSED = 1, 2
SLOT_FREE, SLOT_LIVE, SLOT_DYING = 0, 1, 2
KIND_SHM, KIND_CMA = 0, 1


class EndpointFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a shm :class:`~llmdd.abc.EndpointDescriptor` (version :data:`VERSION`)."""

    endpoint_id: bytes
    pid: int
    uid: int
    ctl: str                 # the control segment's name
    probe_addr: int          # an 8-byte word that cross-memory attach reads to check it reached the peer
    user_regions: int = 0    # remote-accessible regions without a backing segment (they need CMA)
    cma: bool = False
    boot_id: str = ""
    machine_id: str = ""
    pidns: int = 0
    ipcns: int = 0


class RegionFields(msgspec.Struct, frozen=True, kw_only=True):
    """The payload of a shm :class:`~llmdd.abc.RegionDescriptor` (version :data:`VERSION`)."""

    endpoint_id: bytes
    region_id: int
    size: int
    remote_accessible: bool
    kind: str = ""           # "shm" (a backing segment), "cma" (the owner's memory) or "" (not accessible)
    slot: int = -1
    gen: int = 0
    shm_name: str = ""
    shm_offset: int = 0
    pid: int = 0
    addr: int = 0


def endpoint_fields(desc: EndpointDescriptor) -> EndpointFields:
    """The fields of a shm endpoint descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="shm", version=VERSION, type=EndpointFields)


def region_fields(desc: RegionDescriptor) -> RegionFields:
    """The fields of a shm region descriptor (:class:`Refused` for another's, a newer or a malformed one)."""
    return decode_payload(desc, transport="shm", version=VERSION, type=RegionFields)


class CtlView:
    """numpy views of a mapped control segment (owner's or a peer's mapping)."""

    __slots__ = ("mapping", "hdr", "slots")

    def __init__(self, mapping: _seg.Mapping) -> None:
        self.mapping = mapping
        self.hdr = np.ctypeslib.as_array((ctypes.c_uint64 * _HDR_WORDS).from_address(mapping.addr))
        self.slots = np.ctypeslib.as_array(
            (ctypes.c_uint32 * (MAX_SLOTS * 4)).from_address(mapping.addr + _SLOTS_OFF)).reshape(MAX_SLOTS, 4)


def id_words(endpoint_id: bytes) -> tuple[int, int]:
    return int.from_bytes(endpoint_id[:8], "little"), int.from_bytes(endpoint_id[8:16], "little")
