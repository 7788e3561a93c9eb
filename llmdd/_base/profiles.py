"""Chip-family profiles: the limits of spec section 12, enforced when a profile is selected.

Select one with the option ``llmdd.chip_profile`` (``generic`` by default, ``atlas_a2``,
``atlas_a3``, ``ascend_950``).  The generic profile enforces no vendor limit beyond the
contract's own rules; it documents what it allows in ``describe()``.
"""

from __future__ import annotations

from typing import Mapping, Optional, TypedDict

import attrs

from llmdd._base.enums import Placement
from llmdd._base.status import LLMException, LLMStatusCode

__all__ = ["ChipProfile", "PROFILES", "profile_from_options", "OPT_CHIP_PROFILE"]

OPT_CHIP_PROFILE = "llmdd.chip_profile"

GiB = 1 << 30
TiB = 1 << 40


@attrs.frozen(kw_only=True)
class ChipProfile:
    name: str
    description: str
    max_registered_addrs: Optional[int] = None       # across register_cache + register_blocks_cache
    device_alignment: Optional[int] = None           # first address alignment for device memory (HCCS)
    max_device_memory: Optional[int] = None          # registered device memory
    max_host_memory: Optional[int] = None            # registered host memory
    max_host_pool: Optional[int] = None              # host_mem_pool_cfg memory_size
    max_links: Optional[int] = None                  # comm-domain links per card
    host_remote_cache: bool = True                   # host memory may be a remote cache
    unsupported_apis: frozenset = frozenset()
    require_cache_manager: bool = False              # enable_cache_manager / remote-accessible cannot be False

    def require_api(self, api: str) -> None:
        if api in self.unsupported_apis:
            raise LLMException(f"{api} is not supported on {self.description}.",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)

    def describe(self) -> dict:
        return {f.name: getattr(self, f.name) for f in attrs.fields(ChipProfile)}


class _Limits(TypedDict):
    """The limits the Atlas A2 and A3 profiles share (keyword arguments of :class:`ChipProfile`)."""

    max_registered_addrs: int
    device_alignment: int
    max_device_memory: int
    max_host_memory: int
    max_host_pool: int
    max_links: int


_A2_A3_COMMON = _Limits(
    max_registered_addrs=240,
    device_alignment=2 * 1024 * 1024,
    max_device_memory=50 * GiB,
    max_host_memory=20 * GiB,
    max_host_pool=20 * GiB,
    max_links=512,
)

PROFILES: dict[str, ChipProfile] = {
    "generic": ChipProfile(
        name="generic",
        description="the generic profile (no vendor limit: any number of registrations, any alignment, "
                    "host and device memory as remote caches, every API)"),
    "atlas_a2": ChipProfile(name="atlas_a2", description="Atlas A2 (910B)", **_A2_A3_COMMON),
    "atlas_a3": ChipProfile(name="atlas_a3", description="Atlas A3 (910_93)", host_remote_cache=False,
                            **_A2_A3_COMMON),
    "ascend_950": ChipProfile(
        name="ascend_950", description="Ascend 950PR/950DT",
        unsupported_apis=frozenset({"link", "unlink", "query_register_mem_status", "remap_registered_memory"}),
        require_cache_manager=True),
}


def profile_from_options(options: Mapping[str, str]) -> ChipProfile:
    name = options.get(OPT_CHIP_PROFILE) or "generic"
    profile = PROFILES.get(name)
    if profile is None:
        raise LLMException(f"{OPT_CHIP_PROFILE} must be one of {sorted(PROFILES)}, got {name!r}.",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    if profile.require_cache_manager:
        for key in ("llm.EnableCacheManager", "llm.EnableRemoteCacheAccessible"):
            if options.get(key) == "0":
                raise LLMException(f"{key} cannot be False on {profile.description}.",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if options.get("llm.LocalCommRes") and options.get("llm.TransferBackend") != "hixl":
            raise LLMException(f"transfer_backend='hixl' is required with a non-empty local_comm_res on "
                               f"{profile.description}.", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return profile


def check_registration(profile: ChipProfile, records, desc, addrs, *, remote_accessible: bool) -> None:
    """The profile's limits on ``register_cache`` / ``register_blocks_cache`` (before anything changes)."""
    invalid = LLMStatusCode.LLM_PARAM_INVALID
    if profile.max_registered_addrs is not None:
        used = sum(len(r.addrs) for r in records if not r.owned)
        if used + len(addrs) > profile.max_registered_addrs:
            raise LLMException(
                f"{profile.description} allows at most {profile.max_registered_addrs} registered addresses in "
                f"total; {used} are registered and {len(addrs)} more were asked.", status_code=invalid)
    if desc.placement == Placement.DEVICE and profile.device_alignment:
        first = addrs[0]
        if first % profile.device_alignment:
            raise LLMException(
                f"{profile.description}: device memory for intra-node transfers must start "
                f"{profile.device_alignment >> 20} MB aligned, got address {first:#x}.", status_code=invalid)
    if desc.placement == Placement.HOST and remote_accessible and not profile.host_remote_cache:
        raise LLMException(f"{profile.description}: host memory cannot be a remote cache.", status_code=invalid)
    cap = profile.max_device_memory if desc.placement == Placement.DEVICE else profile.max_host_memory
    if cap is not None:
        used = sum(r.tensor_size * len(r.addrs) for r in records if not r.owned and r.placement == desc.placement)
        new = desc.size * len(addrs)
        if used + new > cap:
            raise LLMException(
                f"{profile.description} allows at most {cap >> 30} GB of registered {desc.placement.name.lower()} "
                f"memory; {used} bytes are registered and {new} more were asked.",
                status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)


def check_pool_options(profile: ChipProfile, host_pool_bytes: Optional[int]) -> None:
    if profile.max_host_pool is not None and host_pool_bytes is not None and host_pool_bytes > profile.max_host_pool:
        raise LLMException(f"{profile.description}: host_mem_pool_cfg memory_size {host_pool_bytes} exceeds "
                           f"{profile.max_host_pool >> 30} GB.", status_code=LLMStatusCode.LLM_PARAM_INVALID)
