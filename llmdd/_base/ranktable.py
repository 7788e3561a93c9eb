"""Rank tables (``link()``) and ``local_comm_res``: parsed and validated by version.

A rank table names the members of a comm group (``server_list[*].device[*]`` with
``device_id``, ``device_ip`` and ``rank_id``).  On a machine without NPUs llmdd maps a
member to a TCP address:

* a member whose ``device_ip`` is an address of this host (loopback included) is
  reached through a same-host rendezvous: every member listens on an ephemeral port
  on 127.0.0.1 and publishes it in a file named after the comm name, the rank table
  and its rank under ``$LLMDD_RENDEZVOUS_DIR`` (default: ``<tmp>/llmdd-rendezvous-<uid>``),
  with its pid and start time, so that the entry of a killed member is skipped as stale
  (:mod:`llmdd._control.comm_group`); no configuration is needed for members on one host;
* any other member is reached at ``device_ip:(LLMDD_COMM_BASE_PORT + device_id)``
  (default base port 26100), where that member listens while its ``link()`` runs.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from typing import Any

import attrs

from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["RankMember", "RankTable", "parse_rank_table", "LocalCommRes", "parse_local_comm_res"]

RANK_TABLE_VERSIONS = ("1.0", "1.2")
LOCAL_COMM_RES_VERSIONS = ("1.0", "1.2", "1.3")


def _invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _load_json(text: str, what: str) -> dict:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise _invalid(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _invalid(f"{what} must be a JSON object.")
    return doc


def _digits(value: Any, field: str, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.isdigit():
        number = int(value)
    else:
        raise _invalid(f"{what}: {field} must be a non-negative integer (or a string of digits), got {value!r}.")
    if number < 0 or number >= 2**31:
        raise _invalid(f"{what}: {field} is out of range: {number}.")
    return number


def _ip(value: Any, field: str, what: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except (ValueError, TypeError):
        raise _invalid(f"{what}: {field} must be an IP address, got {value!r}.") from None


@attrs.frozen
class RankMember:
    rank_id: int
    device_id: int
    device_ip: str
    server_id: str
    super_device_id: int | None = None


@attrs.frozen
class RankTable:
    version: str
    members: tuple[RankMember, ...]
    digest: str   # identifies this table for the rendezvous

    def member(self, rank_id: int) -> RankMember:
        for m in self.members:
            if m.rank_id == rank_id:
                return m
        raise _invalid(f"rank_table has no rank {rank_id}.")


def _parse_devices(doc: dict, what: str, *, need_rank: bool, need_ip: bool = True) -> list[RankMember]:
    """The members of ``server_list[*].device[*]``.  ``need_ip`` False (``local_comm_res``): a
    device without ``device_ip`` is taken, with ``device_ip`` "" (upstream's comm-res reader
    treats it as optional, as it does ``device_port``); a rank table needs it to reach a member."""
    servers = doc.get("server_list")
    if not isinstance(servers, list) or not servers:
        raise _invalid(f"{what}: server_list must be a non-empty list.")
    members: list[RankMember] = []
    for s_index, server in enumerate(servers):
        if not isinstance(server, dict):
            raise _invalid(f"{what}: server_list[{s_index}] must be an object.")
        devices = server.get("device")
        if not isinstance(devices, list) or not devices:
            raise _invalid(f"{what}: server_list[{s_index}].device must be a non-empty list.")
        server_id = str(server.get("server_id", ""))
        for d_index, dev in enumerate(devices):
            where = f"server_list[{s_index}].device[{d_index}]"
            if not isinstance(dev, dict):
                raise _invalid(f"{what}: {where} must be an object.")
            if "device_id" not in dev or (need_ip and "device_ip" not in dev):
                raise _invalid(f"{what}: {where} needs device_id" + (" and device_ip." if need_ip else "."))
            if need_rank and "rank_id" not in dev:
                raise _invalid(f"{what}: {where} needs rank_id.")
            rank = _digits(dev["rank_id"], f"{where}.rank_id", what) if need_rank else -1
            sdid = dev.get("super_device_id")
            members.append(RankMember(
                rank_id=rank,
                device_id=_digits(dev["device_id"], f"{where}.device_id", what),
                device_ip=_ip(dev["device_ip"], f"{where}.device_ip", what) if "device_ip" in dev else "",
                server_id=server_id,
                super_device_id=None if sdid is None else _digits(sdid, f"{where}.super_device_id", what),
            ))
    return members


def parse_rank_table(text: str) -> RankTable:
    """Parse and validate a rank table of version 1.0 or 1.2 (LLM_PARAM_INVALID otherwise)."""
    what = "rank_table"
    doc = _load_json(text, what)
    version = doc.get("version")
    if version not in RANK_TABLE_VERSIONS:
        raise _invalid(f"{what}: version must be one of {list(RANK_TABLE_VERSIONS)}, got {version!r}.")
    if "status" in doc and doc["status"] != "completed":
        raise _invalid(f"{what}: status must be 'completed', got {doc['status']!r}.")
    members = _parse_devices(doc, what, need_rank=True)
    if "server_count" in doc and _digits(doc["server_count"], "server_count", what) != len(doc["server_list"]):
        raise _invalid(f"{what}: server_count does not match server_list.")
    ranks = sorted(m.rank_id for m in members)
    if ranks != list(range(len(members))):
        raise _invalid(f"{what}: rank ids must be unique and cover 0..{len(members) - 1}, got {ranks}.")
    if version == "1.2" and "super_pod_list" in doc and not isinstance(doc["super_pod_list"], list):
        raise _invalid(f"{what}: super_pod_list must be a list.")
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    return RankTable(version=version, members=tuple(sorted(members, key=lambda m: m.rank_id)), digest=digest)


@attrs.frozen
class LocalCommRes:
    """``llm.LocalCommRes``: empty (resources generated automatically) or a versioned JSON."""

    version: str | None            # None for ""
    devices: tuple[RankMember, ...]
    raw: dict

    @property
    def auto(self) -> bool:
        return self.version is None


def parse_local_comm_res(text: str) -> LocalCommRes:
    """Validate ``local_comm_res`` by version: "" (auto), 1.0, 1.2 (rank-table subsets) or 1.3."""
    what = "local_comm_res"
    if text == "":
        return LocalCommRes(version=None, devices=(), raw={})
    doc = _load_json(text, what)
    version = doc.get("version")
    if version not in LOCAL_COMM_RES_VERSIONS:
        raise _invalid(f"{what}: version must be one of {list(LOCAL_COMM_RES_VERSIONS)}, got {version!r}.")
    if version == "1.0":
        # upstream's 1.0 reader takes version and server_list[*].device[*] (device_id, optional
        # device_ip / device_port) and ignores every other key: server_count, status, rank_id
        devices = _parse_devices(doc, what, need_rank=False, need_ip=False)
    elif version == "1.2":
        devices = _parse_devices(doc, what, need_rank=False, need_ip=False)
        if "super_pod_list" in doc and not isinstance(doc["super_pod_list"], list):
            raise _invalid(f"{what}: super_pod_list must be a list.")
    else:  # 1.3: HixlCS endpoint description; llmdd reads only the version, endpoints come from listen info
        devices = []
    return LocalCommRes(version=version, devices=tuple(devices), raw=doc)
