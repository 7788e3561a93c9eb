"""Prometheus metrics for llmdd: a hook subscriber, nothing on the data path.

Opt in either way: register a subscriber on an engine (``dd.add_plugin(MetricsSubscriber())``),
or set ``LLMDD_METRICS=1`` and the installed distribution (entry-point group ``llmdd``)
subscribes one process-wide instance to every engine.  Installed alone it costs nothing.
It turns lifecycle events into:

* ``llmdd_transfers_total{transport, kind, outcome}`` and
  ``llmdd_transfer_bytes_total{transport, kind, direction}``;
* ``llmdd_transfer_seconds{transport, kind}`` (histogram, from a task's start to its end);
* ``llmdd_transfer_failures_total{kind, status}`` (by upstream status code name);
* ``llmdd_links{transport, state}`` and ``llmdd_link_transitions_total{trigger}``;
* ``llmdd_caches{state}`` and ``llmdd_peer_reads_total`` / ``llmdd_peer_writes_total``.

**Bounded label sets.**  Every label takes its values from a fixed set (transport names,
transfer kinds, outcomes, states, triggers, status codes), so the number of series does not grow
with the number of peers.  A per-peer breakdown is opt-in: ``MetricsSubscriber(peer_labels=True)``
(or ``LLMDD_METRICS_PEER_LABELS=1`` for the entry-point instance) adds a ``peer`` label (the peer's
cluster id) to ``llmdd_transfers_total`` and ``llmdd_transfer_bytes_total``; with hundreds of
peers that is hundreds of series per label combination, which is why it is off by default.

**Registry.**  By default the series live in prometheus_client's default :data:`REGISTRY`, exposed
by ``prometheus_client.start_http_server(port)`` in the application.  A framework that exposes
its own registry (a worker process whose default registry nobody scrapes) passes it:
``dd.add_plugin(MetricsSubscriber(registry=framework_registry))``.  One subscriber per registry
(prometheus_client refuses a second set of the same metric names in one registry).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

from llmdd.plugin import hookimpl

__all__ = ["MetricsSubscriber", "REGISTRY"]

_TERMINAL = {"completed": "ok", "failed": "failed", "timed_out": "timeout", "cancelled": "cancelled"}


class MetricsSubscriber:
    """A pluggy plugin object: register it on an engine with ``LLMDataDist.add_plugin(subscriber)``.

    ``registry``: the prometheus_client registry the series are registered in (default: the
    process's default :data:`REGISTRY`).  ``peer_labels``: add the peer's cluster id as a
    ``peer`` label to the transfer counters (unbounded with the number of peers; off by default).
    """

    def __init__(self, registry: Optional[CollectorRegistry] = None, *, peer_labels: bool = False) -> None:
        # prometheus_client (about 2.3 MiB with http.server, wsgiref, email) comes in with the first
        # subscriber: the installed entry point without LLMDD_METRICS makes none and costs nothing
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = registry if registry is not None else REGISTRY
        self.registry = reg
        self.peer_labels = bool(peer_labels)
        peer = ["peer"] if self.peer_labels else []
        self.transfers = Counter("llmdd_transfers", "Transfer tasks by outcome",
                                 [*peer, "transport", "kind", "outcome"], registry=reg)
        self.bytes = Counter("llmdd_transfer_bytes", "Bytes moved by transfer tasks",
                             [*peer, "transport", "kind", "direction"], registry=reg)
        self.latency = Histogram("llmdd_transfer_seconds", "Transfer task duration", ["transport", "kind"],
                                 buckets=(50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                                          0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=reg)
        self.failures = Counter("llmdd_transfer_failures", "Failed transfers by status code", ["kind", "status"],
                                registry=reg)
        self.links = Gauge("llmdd_links", "Links per state", ["transport", "state"], registry=reg)
        self.link_transitions = Counter("llmdd_link_transitions", "Link transitions", ["trigger"], registry=reg)
        self.caches = Gauge("llmdd_caches", "Caches per state", ["state"], registry=reg)
        self.peer_reads = Counter("llmdd_peer_reads", "Peers finished reading a cache of this engine", registry=reg)
        self.peer_writes = Counter("llmdd_peer_writes", "Peers pushed into a cache of this engine", registry=reg)
        self._lock = threading.Lock()
        self._started: dict[Any, tuple[float, int, str]] = {}
        self._link_transport: dict[Any, str] = {}

    # ------------------------------------------------------------------ hooks
    @hookimpl
    def llmdd_link_transition(self, event) -> None:
        transport = event.info.get("transport") or self._link_transport.get(event.id, "")
        if transport:
            self._link_transport[event.id] = transport
        self.link_transitions.labels(event.trigger).inc()
        if event.source is not event.dest:
            self.links.labels(self._link_transport.get(event.id, ""), event.source.value).dec()
            if event.dest.value != "closed":
                self.links.labels(transport, event.dest.value).inc()
            else:
                self._link_transport.pop(event.id, None)

    @hookimpl
    def llmdd_task_transition(self, event) -> None:
        info = event.info
        kind = str(info.get("kind", "transfer"))
        dest = event.dest.value
        if event.trigger == "start" and event.source.value in ("created", "waiting"):
            with self._lock:
                first = self._started.get(event.id)
                self._started[event.id] = (first[0] if first else time.perf_counter(),
                                           int(info.get("bytes", 0)) + (first[1] if first else 0),
                                           str(info.get("peer", "")))
            return
        outcome = _TERMINAL.get(dest)
        if outcome is None:
            return
        with self._lock:
            started = self._started.pop(event.id, None)
        peer = str(info.get("peer", started[2] if started else ""))
        transport = self._link_transport.get(_as_int(peer), "")
        by_peer = (peer,) if self.peer_labels else ()
        self.transfers.labels(*by_peer, transport, kind, outcome).inc()
        if started is not None:
            self.latency.labels(transport, kind).observe(time.perf_counter() - started[0])
            if outcome == "ok" and started[1]:
                direction = "in" if kind.startswith("pull") else "out"
                self.bytes.labels(*by_peer, transport, kind, direction).inc(started[1])
        if outcome != "ok":
            status = getattr(event.error, "status_code", None)
            self.failures.labels(kind, getattr(status, "name", type(event.error).__name__)).inc()

    @hookimpl
    def llmdd_cache_transition(self, event) -> None:
        if event.trigger == "peer_read":
            self.peer_reads.inc()
        elif event.trigger == "peer_written":
            self.peer_writes.inc()
        if event.source is not event.dest:
            if event.source.value != "new":
                self.caches.labels(event.source.value).dec()
            if event.dest.value != "released":
                self.caches.labels(event.dest.value).inc()


def __getattr__(name: str) -> Any:   # REGISTRY: prometheus_client's default registry, imported when asked for
    if name == "REGISTRY":
        from prometheus_client import REGISTRY

        return REGISTRY
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as_int(text: str) -> Any:
    try:
        return int(text)
    except (TypeError, ValueError):
        return text


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


_ENTRY_POINT_SUBSCRIBER: Optional[MetricsSubscriber] = None


@hookimpl
def llmdd_addhooks(pluginmanager) -> None:
    """Entry-point load: subscribe one process-wide instance (default registry) to this engine
    when ``LLMDD_METRICS`` is set; ``LLMDD_METRICS_PEER_LABELS=1`` gives it the ``peer`` label."""
    global _ENTRY_POINT_SUBSCRIBER
    if not _env_flag("LLMDD_METRICS"):
        return
    if _ENTRY_POINT_SUBSCRIBER is None:
        _ENTRY_POINT_SUBSCRIBER = MetricsSubscriber(peer_labels=_env_flag("LLMDD_METRICS_PEER_LABELS"))
    if not pluginmanager.is_registered(_ENTRY_POINT_SUBSCRIBER):
        pluginmanager.register(_ENTRY_POINT_SUBSCRIBER, name="llmdd-metrics-subscriber")
