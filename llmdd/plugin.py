"""What a plugin author needs: the ``hookimpl`` marker and the objects hooks receive.

A transport plugin is a module with one hook implementation, exposed through the
``llmdd`` entry-point group of its distribution::

    # pyproject.toml: [project.entry-points.llmdd] shm = "llmdd_shm"
    from llmdd.plugin import hookimpl

    @hookimpl
    def llmdd_register_transports(register):
        register(ShmTransport)

Every hook is specified in :mod:`llmdd.hookspecs`.
"""

from __future__ import annotations

import inspect
import re
import threading
import types
from typing import Any, Iterable, Mapping, Optional, final

import attrs
import pluggy

from llmdd._base.enums import LLMRole
from llmdd._base.log import get_logger
from llmdd._seam.abc import Transport, TransportInfo

__all__ = [
    "PROJECT",
    "hookimpl",
    "EngineConfig",
    "LinkInfo",
    "TransportCandidate",
    "TransportRegistry",
    "TransferTask",
]

#: The pluggy project name: hook prefix ``llmdd_`` and entry-point group ``llmdd``.
PROJECT = "llmdd"

#: Marks a function or method as the implementation of an ``llmdd_*`` hook.
hookimpl = pluggy.HookimplMarker(PROJECT)

_log = get_logger("llmdd.plugin")

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def _readonly(mapping: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(mapping or {}))


@final
@attrs.frozen(kw_only=True)
class TransferTask:
    """The transfer task ``llmdd_run_transfer`` hands a plugin: a read-only view, never the engine's
    own task object (a plugin cannot drive its lifecycle).

    :ivar id: the task id (as in its ``llmdd_task_transition`` events' ``resource_id``).
    :ivar kind: what runs: ``"pull_cache"``, ``"pull_blocks"``, ``"push_blocks"``,
        ``"transfer_cache_async"``...
    :ivar peer: the peer engine's cluster id, or None.
    :ivar info: everything the task was created with (read-only; ``kind`` and ``peer`` included).
    """

    id: int
    kind: Optional[str] = None
    peer: Optional[int] = None
    info: Mapping[str, Any] = attrs.field(factory=dict, converter=_readonly)


@final
@attrs.frozen(kw_only=True)
class EngineConfig:
    """What ``llmdd_configure`` receives: the engine's identity and its options.

    ``options`` is the engine's option mapping as ``init`` completed it
    (read-only); ``role`` is the engine's ``LLMRole``.
    """

    cluster_id: int = attrs.field(validator=attrs.validators.instance_of(int))
    role: LLMRole
    options: Mapping[str, str] = attrs.field(factory=dict, converter=_readonly)


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@final
@attrs.frozen(kw_only=True)
class LinkInfo:
    """The link ``llmdd_select_transport`` chooses a transport for.

    :ivar local_cluster_id: this engine's cluster id.
    :ivar peer_cluster_id: the peer engine's cluster id.
    :ivar same_host: the peer runs on this host (same-host transports may serve it).
    :ivar forced: the transport name forced by option (``llmdd.transport``, or ``llm.TransferBackend``), or None.
    :ivar peer_transports: the names of the transports the peer offered in the handshake.
    """

    local_cluster_id: int = attrs.field(validator=attrs.validators.instance_of(int))
    peer_cluster_id: int = attrs.field(validator=attrs.validators.instance_of(int))
    same_host: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    forced: Optional[str] = attrs.field(default=None,
                                        validator=attrs.validators.optional(attrs.validators.instance_of(str)))
    peer_transports: tuple[str, ...] = attrs.field(
        default=(), converter=_str_tuple,
        validator=attrs.validators.deep_iterable(attrs.validators.instance_of(str)))


@final
@attrs.frozen(kw_only=True)
class TransportCandidate:
    """A transport available on both ends of a link, as the selection hook sees it.

    ``priority`` and ``same_host_only`` come from the transport class, ``info``
    from its ``probe()``.
    """

    name: str
    priority: int
    same_host_only: bool
    info: TransportInfo


def _preference(cls: type[Transport]) -> tuple[int, str]:
    return (-int(cls.priority), cls.name)


@final
class TransportRegistry:
    """The transport classes of one engine, by name.

    Plugins receive it as ``register`` in ``llmdd_register_transports`` and call
    it with a class.  A name belongs to one class: registering another class
    under a taken name raises :class:`ValueError` unless ``replace=True`` is
    passed, so shadowing another plugin's transport is always deliberate
    (pluggy's call order would otherwise decide silently).  Registering the same
    class again is a no-op.

    ``probe()`` of each class is called at most once per registry, on first
    need, and its result is cached.
    """

    def __init__(self) -> None:
        self._classes: dict[str, type[Transport]] = {}
        self._infos: dict[str, TransportInfo] = {}
        self._lock = threading.Lock()

    def __call__(self, transport_cls: type[Transport], *, replace: bool = False) -> type[Transport]:
        return self.register(transport_cls, replace=replace)

    def register(self, transport_cls: type[Transport], *, replace: bool = False) -> type[Transport]:
        """Add ``transport_cls``; return it (so this also works as a class decorator)."""
        _check_transport_class(transport_cls)
        name = transport_cls.name
        with self._lock:
            current = self._classes.get(name)
            if current is transport_cls:
                return transport_cls
            if current is not None and not replace:
                raise ValueError(
                    f"transport name {name!r} is already registered by {_qualname(current)}; "
                    f"pass replace=True to replace it with {_qualname(transport_cls)}")
            self._classes[name] = transport_cls
            self._infos.pop(name, None)
        _log.debug("llmdd.transport.registered", transport=name, cls=_qualname(transport_cls),
                   replaced=_qualname(current) if current is not None else None)
        return transport_cls

    def get(self, name: str) -> type[Transport]:
        """The class registered as ``name``; :class:`KeyError` naming the known ones otherwise."""
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(f"no transport named {name!r}; registered: {', '.join(self.names()) or 'none'}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __len__(self) -> int:
        return len(self._classes)

    def names(self) -> tuple[str, ...]:
        """Registered names, most preferred first (highest ``priority``, then name)."""
        with self._lock:
            classes = list(self._classes.values())
        return tuple(c.name for c in sorted(classes, key=_preference))

    def probe(self, name: str) -> TransportInfo:
        """``probe()`` of the transport ``name``, called once and cached; never raises for a bad probe."""
        info = self._infos.get(name)
        if info is not None:
            return info
        info = _safe_probe(self.get(name))
        with self._lock:
            return self._infos.setdefault(name, info)

    def infos(self) -> list[TransportInfo]:
        """Probe results of every registered transport, most preferred first."""
        return [self.probe(name) for name in self.names()]

    def available(self) -> list[TransportInfo]:
        """Probe results of the transports that can run here, most preferred first."""
        return [info for info in self.infos() if info.available]

    def candidates(self, peer_transports: Iterable[str] | None = None) -> tuple[TransportCandidate, ...]:
        """Transports available here (and, when given, offered by the peer), most preferred first."""
        offered = None if peer_transports is None else frozenset(peer_transports)
        out = []
        for info in self.available():
            if offered is not None and info.name not in offered:
                continue
            cls = self._classes[info.name]
            out.append(TransportCandidate(name=info.name, priority=int(cls.priority),
                                          same_host_only=bool(cls.same_host_only), info=info))
        return tuple(out)

    def __repr__(self) -> str:
        return f"<TransportRegistry {list(self.names())}>"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_transport_class(cls: object) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"register() takes a transport class, not {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TypeError(f"{_qualname(cls)}.name must be a non-empty name ([A-Za-z0-9_.-]), got {name!r}")
    for attr in ("probe", "open_endpoint"):
        if not callable(getattr(cls, attr, None)):
            raise TypeError(f"{_qualname(cls)} has no {attr}(); transports implement llmdd.abc.Transport")
    if isinstance(getattr(cls, "priority", None), bool) or not isinstance(getattr(cls, "priority", None), int):
        raise TypeError(f"{_qualname(cls)}.priority must be an int, got {getattr(cls, 'priority', None)!r}")
    if not isinstance(getattr(cls, "same_host_only", None), bool):
        raise TypeError(f"{_qualname(cls)}.same_host_only must be a bool")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TypeError(f"{_qualname(cls)} is abstract (missing: {missing})")


def _safe_probe(cls: type[Transport]) -> TransportInfo:
    try:
        info = cls.probe()
    except Exception as exc:  # noqa: BLE001 - a broken probe makes the transport unavailable
        _log.warning("llmdd.transport.probe_failed", transport=cls.name, error=repr(exc))
        return TransportInfo(name=cls.name, available=False, reason=f"probe() raised {exc!r}")
    if info is None:
        return TransportInfo(name=cls.name, available=False, reason="probe() returned None")
    if not isinstance(info, TransportInfo):
        return TransportInfo(name=cls.name, available=False,
                             reason=f"probe() returned {type(info).__name__}, not TransportInfo")
    if info.name != cls.name:
        info = attrs.evolve(info, name=cls.name)
    return info
