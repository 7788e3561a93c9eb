"""llmdd plugin ``faults``: fault injection around any transport, for tests and chaos drills.

* :class:`Fault` / :class:`FaultPlan`: what goes wrong, on which call, and what fired;
* :func:`wrap`: a transport class that runs another one under a plan;
* :class:`FaultInjector`: the plan as an ordinary pluggy plugin of one engine
  (``dd.add_plugin(FaultInjector(plan))`` before ``init``).

Installing the distribution changes nothing by itself: this module (the ``faults`` entry
point) implements hooks only when the environment variable ``LLMDD_FAULTS`` holds a plan
(JSON, or ``@path`` of a JSON file) when it is first imported; then every engine of the
process runs under that plan, forced onto every link (:func:`env_plan` returns it, and
``LLMDD_FAULTS_LOG`` names a file that receives one JSON line per firing).
See ``docs/fault-injection.md``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

from llmdd.plugin import hookimpl

from ._injector import FaultInjector
from ._plan import ACTIONS, ERRORS, OPS, POINTS, Fault, FaultPlan, Fired, current_peer, peer_scope
from ._wrapper import SCRATCH_REGION_ID, FaultyChannel, FaultyEndpoint, FaultyTransport, wrap

__all__ = [
    "ENV_PLAN",
    "ENV_LOG",
    "ENV_WRAP",
    "OPS",
    "ACTIONS",
    "POINTS",
    "ERRORS",
    "SCRATCH_REGION_ID",
    "Fault",
    "FaultPlan",
    "Fired",
    "FaultInjector",
    "FaultyTransport",
    "FaultyEndpoint",
    "FaultyChannel",
    "wrap",
    "peer_scope",
    "current_peer",
    "env_plan",
    "plan_from_env",
]

#: A plan as JSON, or ``@/path/plan.json``: activates the plugin for this process.
ENV_PLAN = "LLMDD_FAULTS"
#: A file that receives one JSON line per firing (append).
ENV_LOG = "LLMDD_FAULTS_LOG"
#: Comma-separated transport names to wrap (default ``tcp,shm``).
ENV_WRAP = "LLMDD_FAULTS_WRAP"


def plan_from_env(environ: Optional[dict] = None) -> Optional[FaultPlan]:
    """The plan ``LLMDD_FAULTS`` describes, or None when it is unset or empty."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_PLAN, "").strip()
    if not text:
        return None
    if text.startswith("@"):
        with open(text[1:], encoding="utf-8") as fh:
            text = fh.read()
    return FaultPlan.from_json(text, log_path=env.get(ENV_LOG) or None)


_ENV_INJECTOR: Optional[FaultInjector] = None
_plan = plan_from_env()
if _plan is not None:
    _wrap_names = [n.strip() for n in os.environ.get(ENV_WRAP, "tcp,shm").split(",") if n.strip()]
    _ENV_INJECTOR = _env_injector = FaultInjector(_plan, wrap=_wrap_names, force=True)

    @hookimpl(trylast=True)
    def llmdd_register_transports(register: Any) -> None:
        _env_injector.llmdd_register_transports(register)

    @hookimpl(tryfirst=True)
    def llmdd_select_transport(link: Any, candidates: Sequence[Any]) -> Optional[str]:
        return _env_injector.llmdd_select_transport(link, candidates)

    @hookimpl
    def llmdd_link_transition(event: Any) -> None:
        _env_injector.llmdd_link_transition(event)

    @hookimpl(wrapper=True)
    def llmdd_run_transfer(task: Any, run: Callable[[], Any]) -> Any:
        return (yield from _env_injector.llmdd_run_transfer(task, run))

    @hookimpl
    def llmdd_control_message(peer_cluster_id: int, message: str, direction: str) -> Optional[bool]:
        return _env_injector.llmdd_control_message(peer_cluster_id, message, direction)
del _plan


def env_plan() -> Optional[FaultPlan]:
    """The plan this process runs under through ``LLMDD_FAULTS`` (None when not set at import)."""
    return None if _ENV_INJECTOR is None else _ENV_INJECTOR.plan
