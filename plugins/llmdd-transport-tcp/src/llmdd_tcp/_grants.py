"""Data-port grants: a capability's public handle and MAC key, and the owner's record of what one link
may do on its data port (its regions, while alive; the streams it opened)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Union

from llmdd.lowlevel import Refused
from llmdd.lowlevel import lazy_numpy as np  # numpy at its first use: an idle engine needs none


def mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def grant_handle(cap: bytes) -> bytes:
    """The public name of a grant: it tells the owner which grant a stream claims, not the capability."""
    return hashlib.sha256(b"llmdd-tcp-handle" + cap).digest()[:16]


def cap_key(cap: bytes, secret: Union[bytes, None]) -> bytes:
    """The MAC key of a data connection: the capability, bound to the shared secret when there is one."""
    return cap if secret is None else mac(secret, b"llmdd-tcp-key", cap)


class Grant:
    """What one link (``link_id``) may do on this endpoint's data port, while ``alive``."""

    __slots__ = ("link_id", "handle", "key", "regions", "region_ids", "sorted_ids", "alive", "busy", "conns")

    def __init__(self, link_id: int, cap: bytes, secret: Union[bytes, None],
                 regions: Union[frozenset, None]) -> None:
        self.link_id = link_id
        self.handle = grant_handle(cap)
        self.key = cap_key(cap, secret)
        self.alive = True
        self.busy = 0
        self.conns: set = set()
        self.set_regions(regions)

    def set_regions(self, regions: Union[frozenset, None]) -> None:
        self.regions = regions
        # as the C path takes them: sorted wire ids (an id no request can name is left out)
        self.sorted_ids = None if regions is None else sorted(r for r in regions if 0 <= r < 1 << 32)
        self.region_ids = None if regions is None else np.array(self.sorted_ids, dtype=np.int64)

    def __repr__(self) -> str:   # never the key
        return f"<tcp grant link={self.link_id} alive={self.alive} regions={self.regions!r}>"

    def check(self, ids: np.ndarray) -> None:
        """Raise :class:`Refused` unless every region id of ``ids`` is in the grant."""
        if self.regions is None or not len(ids):
            return
        if len(ids) <= 8:
            for r in ids.tolist():
                if r not in self.regions:
                    raise Refused(f"remote region {r} is not granted to this link")
            return
        inside = np.isin(ids.astype(np.int64, copy=False), self.region_ids)
        if not inside.all():
            raise Refused(f"remote region {int(ids[np.argmin(inside)])} is not granted to this link")
