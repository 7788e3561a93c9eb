"""The small in-band control protocol the ucx endpoints speak over NIXL notifications.

NIXL moves bytes one-sided: the owner of a region is not involved in a READ or WRITE. What the
owner needs from its peers -- "stop touching region R before I deregister it", "I am closing"
-- travels as NIXL notifications (UCX active messages on the same UCX connection as the data,
no side channel). A message is ``MAGIC | kind u8 | token u64 | payload``:

======== ===================================== =============================================
kind     sent by -> to                         payload / meaning
======== ===================================== =============================================
HELLO    initiator -> owner at ``connect``      initiator's NIXL metadata, so the owner can
                                                answer and later send DRAIN/BYE
WELCOME  owner -> initiator                     the owner is alive and counts it as a client
DRAIN    owner -> clients at ``deregister``     ``region u32, generation u64``: refuse new ops
                                                naming it, fail and drain batches touching it
DRAINED  client -> owner                        done: no request of the client touches it
BYE      owner -> clients at ``close``          the owner goes away: fail (PeerGone), drain
BYE_ACK  client -> owner                        drained
GOODBYE  initiator -> owner at channel close    forget one client reference
GOODBYE_ACK owner -> initiator                  forgotten
======== ===================================== =============================================
"""

from __future__ import annotations

import struct
from typing import Optional

MAGIC = b"LDUX"
_HDR = struct.Struct("<4sBQ")
_REGION = struct.Struct("<IQ")

HELLO, WELCOME, DRAIN, DRAINED, BYE, BYE_ACK, GOODBYE, GOODBYE_ACK = range(1, 9)
ACK_OF = {DRAIN: DRAINED, BYE: BYE_ACK, GOODBYE: GOODBYE_ACK, HELLO: WELCOME}
MAX_PAYLOAD = 1 << 20


def pack(kind: int, token: int, payload: bytes = b"") -> bytes:
    return _HDR.pack(MAGIC, kind, token) + payload


def unpack(msg: bytes) -> Optional[tuple[int, int, bytes]]:
    """``(kind, token, payload)`` or ``None`` for anything that is not ours (never raises)."""
    if len(msg) < _HDR.size or len(msg) > _HDR.size + MAX_PAYLOAD:
        return None
    magic, kind, token = _HDR.unpack_from(msg)
    if magic != MAGIC or not HELLO <= kind <= GOODBYE_ACK:
        return None
    return kind, token, bytes(msg[_HDR.size:])


def pack_region(region_id: int, gen: int) -> bytes:
    return _REGION.pack(region_id, gen)


def unpack_region(payload: bytes) -> Optional[tuple[int, int]]:
    if len(payload) != _REGION.size:
        return None
    return _REGION.unpack(payload)
