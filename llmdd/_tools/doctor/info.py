"""``llmdd info``: what this machine runs (versions, plugins, transports, profile, memory backends)."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import platform
from typing import TYPE_CHECKING, Any, Mapping, Optional

from llmdd._tools.doctor.report import _jsonable
from llmdd._tools.doctor.util import _VERSIONED, _version

if TYPE_CHECKING:
    import pluggy

    from llmdd.plugin import TransportRegistry


def _plugin_manager() -> tuple[pluggy.PluginManager, TransportRegistry]:
    from llmdd._extension.manager import Hooks, make_plugin_manager

    pm = make_plugin_manager()
    return pm, Hooks(pm).register_transports()


def _data_path(details: Mapping[str, Any]) -> Optional[str]:
    """The data path a transport reports as active (``details["data_path"]``: the shm plugin's
    C hot path or its pure-Python fallback, with the reason), or None when it reports none."""
    dp = details.get("data_path") if isinstance(details, Mapping) else None
    if not isinstance(dp, Mapping) or not dp.get("path"):
        return None
    return str(dp["path"]) + (f" ({dp['reason']})" if dp.get("reason") else "")


def collect_info(profile: str = "generic") -> dict:
    """Versions, plugins, transports (probed), the chip-family profile and the memory backends.

    JSON-able.  A plugin that cannot be loaded is reported under ``plugins_error`` (and no
    transport is listed), never raised.
    """
    import llmdd
    from llmdd._base.profiles import PROFILES
    from llmdd._extension.manager import ENV_DISABLE_AUTOLOAD, ENV_DISABLED_PLUGINS
    from llmdd._memory.backend import EmulatedDeviceBackend, HostBackend

    versions: dict[str, Optional[str]] = {"llmdd": _version("llmdd") or llmdd.__version__,
                                          "python": platform.python_version()}
    for dist in _VERSIONED:
        versions[dist] = _version(dist)
    info: dict[str, Any] = {"versions": versions,
                            "platform": f"{platform.system()} {platform.release()} {platform.machine()}"}

    entry_points: list[dict[str, Any]] = []
    for ep in sorted(metadata.entry_points(group="llmdd"), key=lambda e: e.name):
        ep_dist = getattr(ep, "dist", None)
        entry_points.append({"name": ep.name, "value": ep.value,
                             "distribution": ep_dist.metadata["Name"] if ep_dist is not None else None,
                             "version": ep_dist.version if ep_dist is not None else None})
    plugins_error = None
    loaded: list[str] = []
    transports: list[dict] = []
    try:
        pm, registry = _plugin_manager()
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        plugins_error = f"{type(exc).__name__}: {exc}"
    else:
        # a blocked name is listed with no plugin object
        loaded = sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None)
        for entry in entry_points:
            entry["loaded"] = entry["name"] in loaded
            entry["blocked"] = pm.is_blocked(entry["name"])
        for name in registry.names():
            cls = registry.get(name)
            probed = registry.probe(name)
            transports.append({"name": name, "available": bool(probed.available), "reason": probed.reason,
                               "priority": int(cls.priority), "same_host_only": bool(cls.same_host_only),
                               "class": f"{cls.__module__}.{cls.__qualname__}",
                               "data_path": _data_path(probed.details),
                               "details": _jsonable(dict(probed.details))})
    info["plugins"] = {"loaded": loaded, "entry_points": entry_points, "error": plugins_error,
                       "autoload_disabled": os.environ.get(ENV_DISABLE_AUTOLOAD, "") or None,
                       "disabled": os.environ.get(ENV_DISABLED_PLUGINS, "") or None}
    info["transports"] = transports

    chosen = PROFILES[profile]
    info["profile"] = _jsonable(chosen.describe())

    backends = []
    for backend in (HostBackend(), EmulatedDeviceBackend()):
        desc = dict(backend.describe())
        if desc.get("emulated"):
            desc["summary"] = ("device memory is host memory here: Placement.DEVICE is emulated with host "
                               "shared memory (no accelerator backend is in use)")
        else:
            desc["summary"] = "host DRAM in POSIX shared memory (same-host peers map it)"
        backends.append(_jsonable(desc))
    info["memory_backends"] = backends
    info["dev_shm"] = _dev_shm_stats()
    return info


def _dev_shm_stats(path: str = "/dev/shm") -> dict:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": path, "error": exc.strerror or str(exc)}
    return {"path": path, "size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
