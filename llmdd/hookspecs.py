"""Every hook of llmdd, grouped by the phase in which it is called.

A plugin implements any of these with the marker from :mod:`llmdd.plugin`::

    from llmdd.plugin import hookimpl

    @hookimpl
    def llmdd_link_transition(event):
        ...

Rules the host keeps (see ``docs/architecture.md``):

* every name starts with ``llmdd_``; the plugin manager refuses marked
  implementations whose hook name does not;
* no hook is ever called per block or per chunk: hooks fire at state
  transitions and task boundaries only;
* notification hooks (``llmdd_*_transition``) receive one frozen
  :class:`~llmdd.events.TransitionEvent`; an implementation that raises is
  logged (``llmdd.hook.failed``) and cannot stop the engine nor the other
  subscribers; they take no wrappers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from llmdd._lifecycle.events import TransitionEvent
    from llmdd.plugin import EngineConfig, LinkInfo, TransportCandidate, TransportRegistry

__all__ = [
    "llmdd_addhooks",
    "llmdd_configure",
    "llmdd_register_transports",
    "llmdd_select_transport",
    "llmdd_run_transfer",
    "llmdd_control_message",
    "llmdd_engine_transition",
    "llmdd_link_transition",
    "llmdd_comm_group_transition",
    "llmdd_cache_transition",
    "llmdd_task_transition",
    "llmdd_listener_transition",
]

_spec = pluggy.HookspecMarker("llmdd")


# -------------------------------------------------------------------------
# Initialization: plugin manager and engine configuration
# -------------------------------------------------------------------------


@_spec(historic=True)
def llmdd_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add new hook specifications of a plugin (``pluginmanager.add_hookspecs(module)``).

    :param pluginmanager: the engine's plugin manager.

    Called once when a plugin is registered (historic: plugins registered later
    receive it at registration), before any engine exists.  The result is not used.

    .. versionadded:: 0.1
    """


@_spec(historic=True)
def llmdd_configure(config: EngineConfig) -> None:
    """The engine was configured by ``LLMDataDist.init``.

    :param config: the engine's options mapping (read-only), cluster id and role
        (:class:`llmdd.plugin.EngineConfig`).

    Called at each ``init``, while the engine goes from ``CREATED`` or
    ``FINALIZED`` to ``INITIALIZED`` (historic: a plugin registered later
    receives every earlier call).  The result is not used.

    .. versionadded:: 0.1
    """


# -------------------------------------------------------------------------
# Transports: registration and choice per link
# -------------------------------------------------------------------------


@_spec
def llmdd_register_transports(register: TransportRegistry) -> None:
    """Contribute transport classes: call ``register(MyTransport)`` for each.

    :param register: the engine's :class:`llmdd.plugin.TransportRegistry`; call it
        with a :class:`llmdd.abc.Transport` subclass (a class, not an instance).

    Called once per engine at ``init``, before any link exists.  The result is
    not used.  An implementation that raises is logged and its transports are
    missing; the engine keeps running with the others.

    .. versionadded:: 0.1
    """


@_spec(firstresult=True)
def llmdd_select_transport(link: LinkInfo, candidates: tuple[TransportCandidate, ...]) -> str | None:
    """Choose the transport of one link.

    :param link: who links with whom (:class:`llmdd.plugin.LinkInfo`): cluster
        ids, whether the peer is on this host, the transport forced by option
        (``llmdd.transport`` or ``llm.TransferBackend``) if any, and the transports the peer offers.
    :param candidates: the transports available on both sides, most preferred
        first (highest ``priority``).
    :return: the name of one of ``candidates``, or ``None`` to let the next
        implementation decide.  When every implementation returns ``None`` the
        link fails with ``LLM_LINK_FAILED``.

    Called while the link is ``LINKING``, once per link.  The first non-``None``
    result is used.  The built-in policy is ``trylast``; override it with
    ``@hookimpl(tryfirst=True)``.

    .. versionadded:: 0.1
    """


# -------------------------------------------------------------------------
# Transfers: one call per task (never per block)
# -------------------------------------------------------------------------


@_spec(firstresult=True)
def llmdd_run_transfer(task: Any, run: Callable[[], Any]) -> Any:
    """Run one whole transfer task; ``run()`` moves its bytes.

    :param task: the task being run (its ``id``, kind, link and sizes).
    :param run: performs the transfer and returns its result; raises the
        transfer's error (a ``TransportError`` subclass).
    :return: the task's result; the first non-``None`` result is used.

    Called once per task as it enters ``RUNNING``.  The built-in implementation
    (``trylast``) returns ``run()``.  Use ``@hookimpl(wrapper=True)`` to time,
    trace, delay or fail whole tasks (``result = yield``); an implementation
    that returns a value without calling ``run()`` replaces the transfer.
    Exceptions propagate: they are the task's outcome.

    .. versionadded:: 0.1
    """


@_spec(firstresult=True)
def llmdd_control_message(peer_cluster_id: int, message: str, direction: str) -> bool | None:
    """A control message of an established link arrived (fault injection, tracing).

    :param peer_cluster_id: the link's peer.
    :param message: the message's type name, with the request's operation for a
        ``TransferRequest`` and ``TaggedDone`` (``"TaggedDone:read_done"``, ``"TransferReply"``, ``"Keepalive"``...).
    :param direction: ``"received"``.
    :return: ``True`` to drop the message (it is never handled, as if the network lost it);
        ``None`` to let it through.

    Called on the link's I/O loop thread for every received control message, only while at least
    one plugin implements it (the faults plugin's ``control`` op does): keep it fast and never block.

    .. versionadded:: 0.2
    """


# -------------------------------------------------------------------------
# Notifications: one call per lifecycle transition
# -------------------------------------------------------------------------


@_spec
def llmdd_engine_transition(event: TransitionEvent) -> None:
    """The engine changed state (``init``, ``switch_role``, ``finalize``).

    :param event: the transition; ``event.machine`` is ``Machine.ENGINE``.

    Called after the transition, in any engine state.  The result is not used;
    an implementation that raises is logged and ignored.

    .. versionadded:: 0.1
    """


@_spec
def llmdd_link_transition(event: TransitionEvent) -> None:
    """A link to one peer cluster changed state (up, down, failed, closed...).

    :param event: the transition; ``event.info`` carries ``peer`` and, where
        known, ``transport`` and ``reason``; ``event.error`` is set on failures.

    Called after the transition, on whichever thread observed it.  The result
    is not used; an implementation that raises is logged and ignored.

    .. versionadded:: 0.1
    """


@_spec
def llmdd_comm_group_transition(event: TransitionEvent) -> None:
    """A comm group built by rank-table ``link()`` changed state.

    :param event: the transition; ``event.info`` carries ``comm_id``, ``comm_name`` and ``members``.

    Called after the transition.  The result is not used; an implementation
    that raises is logged and ignored.

    .. versionadded:: 0.1
    """


@_spec
def llmdd_cache_transition(event: TransitionEvent) -> None:
    """A cache changed state, or a peer finished reading it (``peer_read``).

    :param event: the transition; ``event.info`` carries ``cache_id`` and, for
        ``peer_read``, the peer and the blocks it read.

    Called after the transition.  The result is not used; an implementation
    that raises is logged and ignored.

    .. versionadded:: 0.1
    """


@_spec
def llmdd_task_transition(event: TransitionEvent) -> None:
    """A transfer task changed state (started, layer done, completed, failed...).

    :param event: the transition; ``event.info`` carries ``bytes``, ``layer`` (per-layer steps)
        and ``peer`` where known; ``event.error`` is set on failures.

    Called after the transition, possibly on an I/O thread: keep it short.  The
    result is not used; an implementation that raises is logged and ignored.

    .. versionadded:: 0.1
    """


@_spec
def llmdd_listener_transition(event: TransitionEvent) -> None:
    """A listening socket of the engine failed or closed (the control port, a comm group's
    port, a transport's data port).

    :param event: the transition; ``event.id`` is ``"<kind>@<host>:<port>"``, ``event.info``
        carries ``kind`` and, on ``fail``, ``reason``; ``event.error`` is set on failures.

    Called after the transition, usually on the engine's I/O loop thread: keep it short.  The
    result is not used; an implementation that raises is logged and ignored.

    .. versionadded:: 0.2
    """
