"""Small helpers of the doctor: sizes, versions, this host's addresses."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import socket
from typing import Optional

MiB = 1 << 20
GiB = 1 << 30

#: size of the region each self-test registers, and of one op
SELF_TEST_BYTES = 64 * MiB
SELF_TEST_OP_BYTES = 1 * MiB

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

_VERSIONED = ("numpy", "attrs", "transitions", "pluggy", "structlog")
_CHILD_TIMEOUT_S = 30.0

def format_bytes(n: int) -> str:
    """``64 MiB``, ``1.5 GiB``, ``512 bytes``: binary units, short."""
    n = int(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``1048576``, ``64MiB``, ``64M``, ``2G``, ``512k`` (binary multiples) -> bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes, or a number with K, M, G or T)")
    number, unit = int(match.group(1)), match.group(2).lower()
    return number << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[unit]


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def local_ipv4_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces (loopback first), best effort."""
    found: list[str] = []
    try:
        import fcntl
        import struct

        siocgifaddr = 0x8915
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    res = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                ip = socket.inet_ntoa(res[20:24])
                if ip not in found:
                    found.append(ip)
    except (ImportError, OSError, AttributeError):
        pass
    try:
        for ip in socket.gethostbyname_ex(socket.gethostname())[2]:
            if ip not in found:
                found.append(ip)
    except OSError:
        pass
    if "127.0.0.1" not in found:
        found.append("127.0.0.1")
    return sorted(found, key=lambda ip: (not ip.startswith("127."), ip))
