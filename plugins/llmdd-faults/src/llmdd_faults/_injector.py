"""``FaultInjector``: the fault plan as an ordinary pluggy plugin of one engine."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from llmdd.lowlevel import get_logger
from llmdd.plugin import LinkInfo, TransportCandidate, TransportRegistry, hookimpl

from ._plan import Fault, FaultPlan, _set_current_peer
from ._wrapper import FaultyTransport, wrap

__all__ = ["FaultInjector"]

_log = get_logger("llmdd.faults")

_LINK_MACHINE = "link"


class FaultInjector:
    """Registers wrapped transports and applies ``plan`` to the links and tasks it targets.

    :param plan: a :class:`FaultPlan` or a sequence of :class:`Fault`.
    :param wrap: the names of the transports to wrap (those not registered are skipped).
    :param force: register the wrapped classes *under the inner names* (``replace=True``),
        so that every link uses them whichever side chooses the transport and whether or
        not the peer runs this plugin (the wire is the inner transport's).  With
        ``force=False`` they are registered as ``faults-<name>`` next to the inner ones and
        ``llmdd_select_transport`` chooses them for links the plan targets, which needs the
        peer to offer them too (it runs an injector as well).

    Register it before the engine's ``init`` builds its transport registry.
    """

    def __init__(self, plan: Union[FaultPlan, Sequence[Fault]], *, wrap: Iterable[str] = ("tcp", "shm"),
                 force: bool = True) -> None:
        self.plan = plan if isinstance(plan, FaultPlan) else FaultPlan(plan)
        self.wrap = tuple(wrap)
        self.force = bool(force)
        #: Wrapped classes this injector registered, by the name they were registered under.
        self.classes: dict[str, type[FaultyTransport]] = {}

    @property
    def fired(self) -> list:
        """``plan.fired``: which faults fired, on which op and peer, when."""
        return self.plan.fired

    def targets(self, peer: Optional[int]) -> bool:
        """True when some fault of the plan may act on the transports of links with ``peer``."""
        return any(f.op not in ("task", "control") and (f.peer is None or f.peer == peer) for f in self.plan.faults)

    # ------------------------------------------------------------------ hooks
    @hookimpl(trylast=True)
    def llmdd_register_transports(self, register: TransportRegistry) -> None:
        # trylast: every other plugin registered its classes before this runs
        for name in self.wrap:
            if name not in register:
                _log.debug("llmdd.faults.not_wrapped", transport=name, reason="not registered")
                continue
            inner = register.get(name)
            cls = wrap(inner, self.plan, name=name if self.force else None)
            register(cls, replace=True)
            self.classes[cls.name] = cls

    @hookimpl(tryfirst=True)
    def llmdd_select_transport(self, link: LinkInfo, candidates: Sequence[TransportCandidate]) -> Optional[str]:
        _set_current_peer(link.peer_cluster_id)  # the accept thread connects the channel next
        if self.force or not self.targets(link.peer_cluster_id):
            return None  # forced: the wrapped classes already carry the plain names
        ours = [c for c in candidates if c.name in self.classes]
        if link.forced:
            wanted = f"faults-{link.forced}"
            return wanted if any(c.name == wanted for c in ours) else None
        if link.same_host:
            for c in ours:
                if c.same_host_only:
                    return c.name
        for c in ours:
            if not c.same_host_only:
                return c.name
        return None

    @hookimpl
    def llmdd_link_transition(self, event: Any) -> None:
        # link events fire on the thread that connects the channel right after: name the peer
        peer = event.info.get("peer", event.id)
        if isinstance(peer, int):
            _set_current_peer(peer)

    @hookimpl
    def llmdd_control_message(self, peer_cluster_id: int, message: str, direction: str) -> Optional[bool]:
        if direction != "received" or not self._has_control:
            return None
        return True if self.plan.match("control", peer_cluster_id, message) else None

    @property
    def _has_control(self) -> bool:
        return any(f.op == "control" for f in self.plan.faults)

    @hookimpl(wrapper=True)
    def llmdd_run_transfer(self, task: Any, run: Callable[[], Any]) -> Any:
        peer = getattr(task, "peer", None)   # a llmdd.plugin.TransferTask
        for f in self.plan.match("task", peer if isinstance(peer, int) else None):
            _apply_task_fault(self.plan, f)
        return (yield)

    def __repr__(self) -> str:
        return f"<FaultInjector {self.plan!r} wrap={list(self.wrap)} force={self.force}>"


def _apply_task_fault(plan: FaultPlan, f: Fault) -> None:
    if f.action == "delay":
        plan.block(time.monotonic() + f.delay, aborted=lambda: False)
    elif f.action == "fail":
        raise f.error_type(f"task failed (fault {f.label})")
    elif f.action in ("kill_peer", "stall_peer"):
        plan.signal_peer(f, None)
