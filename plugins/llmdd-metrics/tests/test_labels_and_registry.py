"""Bounded label sets by default, the peer label opt-in, and the registry a framework passes (issue 24).

The events come from llmdd's own lifecycle machines through a real plugin manager, as an engine
emits them: one link and one pull per peer, for many peers.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import Machine
from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd_metrics import MetricsSubscriber

pytestmark = pytest.mark.timeout(60)

PEERS = 300


def _drive(subscriber: MetricsSubscriber, peers: list[int], seed: int = 3) -> int:
    """One link and one pull per peer (seeded sizes; every 7th pull fails); returns the bytes pulled."""
    pm = make_plugin_manager(autoload=False, strict=True)
    pm.register(subscriber)
    hooks = Hooks(pm)
    links = Lifecycle(Machine.LINK, hooks.emitter(Machine.LINK))
    tasks = Lifecycle(Machine.TASK, hooks.emitter(Machine.TASK))
    rng = random.Random(seed)
    pulled = 0
    for n, peer in enumerate(peers):
        link = links.create(peer, peer=peer)
        link.fire("link")
        link.fire("handshake_succeeded", transport="tcp" if n % 2 else "shm")
        task = tasks.create(n, kind="pull_blocks", peer=peer)
        nbytes = rng.randrange(1, 1 << 20)
        task.fire("start", bytes=nbytes)
        if n % 7 == 0:
            task.fire("transfer_failed", error=RuntimeError("injected"))
        else:
            task.fire("transfer_succeeded")
            pulled += nbytes
    return pulled


def _series(registry: CollectorRegistry, metric: str) -> list[dict]:
    return [dict(s.labels) for m in registry.collect() for s in m.samples if s.name == metric]


def test_label_sets_stay_bounded_with_many_peers():
    registry = CollectorRegistry()
    sub = MetricsSubscriber(registry=registry)
    peers = random.Random(11).sample(range(1, 1 << 40), PEERS)
    pulled = _drive(sub, peers)
    for metric in ("llmdd_transfers_total", "llmdd_transfer_bytes_total"):
        series = _series(registry, metric)
        assert all("peer" not in labels for labels in series), series
    # two transports x one kind x {ok, failed}; bytes: two transports x one kind x one direction
    assert len(_series(registry, "llmdd_transfers_total")) == 4
    assert len(_series(registry, "llmdd_transfer_bytes_total")) == 2
    total = sum(registry.get_sample_value("llmdd_transfer_bytes_total",
                                          {"transport": t, "kind": "pull_blocks", "direction": "in"}) or 0
                for t in ("shm", "tcp"))
    assert total == pulled
    ok = sum(registry.get_sample_value("llmdd_transfers_total",
                                       {"transport": t, "kind": "pull_blocks", "outcome": "ok"}) or 0
             for t in ("shm", "tcp"))
    assert ok == PEERS - len(range(0, PEERS, 7))
    assert registry.get_sample_value("llmdd_links", {"transport": "tcp", "state": "linked"}) == PEERS // 2


def test_control_peer_labels_opt_in_grows_with_the_peers():
    registry = CollectorRegistry()
    peers = random.Random(11).sample(range(1, 1 << 40), PEERS)
    pulled = _drive(MetricsSubscriber(registry=registry, peer_labels=True), peers)
    series = _series(registry, "llmdd_transfers_total")
    assert len(series) == PEERS and {s["peer"] for s in series} == {str(p) for p in peers}
    bytes_series = _series(registry, "llmdd_transfer_bytes_total")
    assert len(bytes_series) == PEERS - len(range(0, PEERS, 7))
    assert sum(registry.get_sample_value("llmdd_transfer_bytes_total", labels) for labels in bytes_series) == pulled


def test_a_framework_registry_gets_the_series_and_the_default_registry_none():
    before = REGISTRY.get_sample_value("llmdd_transfers_total",
                                       {"transport": "shm", "kind": "pull_blocks", "outcome": "ok"})
    mine, theirs = CollectorRegistry(), CollectorRegistry()
    a, b = MetricsSubscriber(registry=mine), MetricsSubscriber(theirs)   # keyword or positional
    assert a.registry is mine and b.registry is theirs
    _drive(a, [5, 6, 7, 8])
    _drive(b, [9])
    labels = {"transport": "tcp", "kind": "pull_blocks", "outcome": "ok"}
    assert mine.get_sample_value("llmdd_transfers_total", labels) == 2      # peers 6 and 8 (odd n: tcp)
    assert theirs.get_sample_value("llmdd_transfers_total", labels) is None  # its one pull failed (n=0)
    assert theirs.get_sample_value("llmdd_transfers_total", dict(labels, transport="shm", outcome="failed")) == 1
    after = REGISTRY.get_sample_value("llmdd_transfers_total",
                                      {"transport": "shm", "kind": "pull_blocks", "outcome": "ok"})
    assert after == before   # nothing went to the process's default registry


def test_one_subscriber_per_registry():
    registry = CollectorRegistry()
    MetricsSubscriber(registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        MetricsSubscriber(registry=registry)


ENTRY_POINT = textwrap.dedent("""
    import llmdd_metrics
    from llmdd._extension.manager import make_plugin_manager
    pm = make_plugin_manager(autoload=True)
    sub = llmdd_metrics._ENTRY_POINT_SUBSCRIBER
    print("none" if sub is None else ("peer" if sub.peer_labels else "bounded"),
          "default" if sub is not None and sub.registry is llmdd_metrics.REGISTRY else "-")
""")


@pytest.mark.parametrize("env, expected", [
    ({}, "none -"),
    ({"LLMDD_METRICS": "1"}, "bounded default"),
    ({"LLMDD_METRICS": "1", "LLMDD_METRICS_PEER_LABELS": "1"}, "peer default"),
    ({"LLMDD_METRICS": "1", "LLMDD_METRICS_PEER_LABELS": "0"}, "bounded default"),
])
def test_entry_point_instance_is_bounded_unless_asked(env, expected):
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMDD_")}
    proc = subprocess.run([sys.executable, "-c", ENTRY_POINT], env={**base, **env}, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected
