"""The whole link protocol on the simulation: handshake, tables, requests, keepalive, unlink, failures.

Two (or three) link managers are built as the composition root builds them, each on a
:class:`llmdd.testing._linksim.SimLoop` of one :class:`llmdd.testing._linksim.World`: one thread, a fake clock, in-memory
sockets (no process, no thread, no wall-clock wait).  Every message crosses the real codec
(frames, bounds, the handshake's MACs) and every decision is the link manager's own code; the
data channel is the shm transport in this process (its endpoints only map each other's tables).

Every trigger of the LINK machine is reached here, each by the scenario that causes it in
production, and each scenario checks the states of both sides and the fake time at which things
happened: keepalive and deadline behaviour is exact (a peer that goes silent is lost at the first
keepalive tick after ``peer_timeout`` has passed, an unanswered unlink fails at its deadline).
The run is deterministic: the same scenario gives the same event trace, time stamps included.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import pytest

import llmdd_shm
from llmdd import CacheDesc, DataType, LLMClusterInfo, LLMRole, LLMStatusCode
from llmdd._base.options import EngineOptions
from llmdd._base.profiles import PROFILES
from llmdd._control.manager import LinkManager
from llmdd._data.engine import TransferEngine
from llmdd._extension.manager import Hooks, make_plugin_manager
from llmdd._lifecycle.events import TransitionEvent
from llmdd._lifecycle.machines import Lifecycle
from llmdd._lifecycle.tables import LINK_TRANSITIONS, LinkState, Machine
from llmdd._memory.manager import MemoryManager
from llmdd._protocol import messages as m
from llmdd._protocol.port import RequestOp
from llmdd._base.status import LLMException

from llmdd.testing._linksim import SimLoop, World

pytestmark = pytest.mark.timeout(60)

S = LLMStatusCode
L = LinkState

KEEPALIVE_S = 1.0
PEER_TIMEOUT_S = 5.0
HANDSHAKE_S = 3.0


class Engine:
    """One engine's control plane (and the data plane it serves) on the simulation."""

    def __init__(self, world: World, cluster_id: int, role: LLMRole, *, listen: bool = False,
                 options: Optional[dict] = None) -> None:
        self.world = world
        self.cluster_id = cluster_id
        raw = {"llmdd.transport": "shm", "llmdd.keepalive_interval_ms": str(int(KEEPALIVE_S * 1000)),
               "llmdd.peer_timeout_ms": str(int(PEER_TIMEOUT_S * 1000)),
               "llmdd.handshake_timeout_ms": str(int(HANDSHAKE_S * 1000)), **(options or {})}
        self.options = EngineOptions.parse(raw, role)
        self.events: list[tuple[float, Any, str, LinkState, LinkState]] = []
        self.on_trigger: dict[str, Callable[[], None]] = {}
        pm = make_plugin_manager(autoload=False)
        pm.register(llmdd_shm, name="shm")
        hooks = Hooks(pm)
        self.memory = MemoryManager.from_options(self.options.raw, caches=Lifecycle(Machine.CACHE))
        self.loop: SimLoop = world.loop(f"e{cluster_id}")
        self.lm = LinkManager(cluster_id=cluster_id, role=lambda: role, options=self.options, hooks=hooks,
                              links=Lifecycle(Machine.LINK, self._record), memory=self.memory,
                              profile=PROFILES["generic"], loop=self.loop)
        self.te = TransferEngine(port=self.lm, memory=self.memory, tasks=Lifecycle(Machine.TASK), hooks=hooks,
                                 options=self.options, profile=PROFILES["generic"])
        self.lm.bind_data_service(self.te)
        self.address: Optional[tuple[str, int]] = self.lm.listen("127.0.0.1", 0) if listen else None
        self.closed = False

    def _record(self, event: TransitionEvent) -> None:
        self.events.append((self.world.now, event.id, event.trigger, event.source, event.dest))
        action = self.on_trigger.pop(event.trigger, None)
        if action is not None:   # a fault injected at an exact point of the protocol
            action()

    def at(self, trigger: str, action: Callable[[], None]) -> None:
        """Run ``action`` once, the moment this engine's link fires ``trigger``."""
        self.on_trigger[trigger] = action

    def trace(self) -> list[tuple[float, Any, str, str, str]]:
        return [(t, key, trig, src.value, dst.value) for t, key, trig, src, dst in self.events]

    def triggers(self, peer: Optional[int] = None) -> list[str]:
        return [t for _, key, t, _, _ in self.events if peer is None or key == peer]

    def state(self, peer: int) -> Optional[LinkState]:
        link = self.lm.get(peer)
        return None if link is None else link.state

    def cluster(self, server: "Engine") -> LLMClusterInfo:
        assert server.address is not None
        info = LLMClusterInfo()
        info.remote_cluster_id = server.cluster_id
        info.append_remote_ip_info(server.address[0], server.address[1])
        return info

    def link(self, server: "Engine", timeout_ms: int = 2000) -> LLMStatusCode:
        status, codes = self.lm.link_clusters([self.cluster(server)], timeout_ms)
        assert codes == [status]
        return status

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.lm.close()
            self.te.close()
            self.memory.close()


@pytest.fixture
def world():
    w = World()
    engines: list[Engine] = []
    w.engines = engines   # type: ignore[attr-defined]
    yield w
    for e in engines:
        e.close()
    w.settle()
    assert w.failures == [], f"a loop callback or pool task raised: {w.failures}"


def make(world: World, cluster_id: int, role: LLMRole = LLMRole.PROMPT, **kw: Any) -> Engine:
    e = Engine(world, cluster_id, role, **kw)
    world.engines.append(e)   # type: ignore[attr-defined]
    return e


def linked_pair(world: World) -> tuple[Engine, Engine]:
    server = make(world, 2, LLMRole.PROMPT, listen=True)
    client = make(world, 1, LLMRole.DECODER)
    assert client.link(server) is S.LLM_SUCCESS
    world.settle()
    assert client.state(2) is L.LINKED and server.state(1) is L.LINKED
    return client, server


def ends(world: World) -> tuple[Any, Any]:
    """The last control connection made: (client end, server end)."""
    return world.connections[-1]


def register_cache(engine: Engine, rng: np.random.Generator, tensors: int = 2) -> tuple[Any, list]:
    """A cache of seeded random tensors registered with the engine's memory (announced to peers)."""
    bufs = [rng.integers(0, 256, size=4096, dtype=np.uint8) for _ in range(tensors)]
    desc = CacheDesc(num_tensors=tensors, data_type=DataType.DT_UINT8, shape=[4096])
    rec = engine.memory.register_cache(desc, [int(b.ctypes.data) for b in bufs], remote_accessible=True,
                                       is_blocks=False)
    return rec, bufs


# ---------------------------------------------------------------------------------------------- link up


def scenario_link_up(world: World) -> tuple[Engine, Engine]:
    """A decoder links to a prompt engine that registered a cache before; then registers another."""
    rng = np.random.default_rng(20261202)
    server = make(world, 2, listen=True)
    rec, bufs = register_cache(server, rng)
    world.settle()
    client = make(world, 1, LLMRole.DECODER)
    t0 = world.now
    assert client.link(server) is S.LLM_SUCCESS
    world.settle()
    assert world.now == t0   # no timer had to fire: the whole setup is one instant of the fake clock
    world.keep = (rec, bufs)   # type: ignore[attr-defined]
    return client, server


def test_link_comes_up_on_both_sides_with_the_peers_tables(world):
    client, server = scenario_link_up(world)
    rec, bufs = world.keep

    assert client.triggers(2) == ["link", "handshake_succeeded"]
    assert server.triggers(1) == ["accept", "handshake_succeeded"]
    c_link, s_link = client.lm.get(2), server.lm.get(1)
    assert c_link.is_client and not s_link.is_client
    assert c_link.transport == s_link.transport == "shm"
    assert c_link.channel is not None and s_link.channel is not None
    # the server's cache crossed in the tables, with its addresses and shape
    entry = c_link.tables.caches[rec.cache_id]
    assert list(entry.addrs) == [int(b.ctypes.data) for b in bufs]
    assert tuple(entry.shape) == (4096,)
    assert c_link.tables.regions, "the server's registered regions are in the client's tables"
    # control: the client registered nothing, so the server learned no cache of it
    assert s_link.tables.caches == {}


def test_a_table_change_after_linking_reaches_the_peer_as_regions_updated(world):
    client, server = scenario_link_up(world)
    before = dict(client.lm.get(2).tables.regions)
    rec2, bufs2 = register_cache(server, np.random.default_rng(7))
    world.settle()

    link = client.lm.get(2)
    assert client.triggers(2)[-1] == "regions_updated"
    assert set(link.tables.regions) > set(before)
    assert list(link.tables.caches[rec2.cache_id].addrs) == [int(b.ctypes.data) for b in bufs2]
    assert client.state(2) is L.LINKED
    del bufs2


def test_a_handshake_refused_for_a_wrong_secret_makes_no_link_on_either_side(world):
    server = make(world, 2, listen=True, options={"llmdd.auth_secret": "server-secret-0123456789"})
    client = make(world, 1, LLMRole.DECODER, options={"llmdd.auth_secret": "client-secret-9876543210"})

    assert client.link(server) is S.LLM_LINK_FAILED
    world.settle()

    assert client.events == [] and server.events == []
    assert client.lm.get(2) is None and server.lm.get(1) is None
    assert client.lm.link_failures()[2]["status"] == "LLM_LINK_FAILED"
    # control: the same secret on both sides links
    other = make(world, 3, LLMRole.DECODER, options={"llmdd.auth_secret": "server-secret-0123456789"})
    assert other.link(server) is S.LLM_SUCCESS


def test_a_server_that_never_answers_fails_link_clusters_exactly_at_its_deadline(world):
    server = make(world, 2, listen=True)
    client = make(world, 1, LLMRole.DECODER)
    t0 = world.now
    # the server's loop reads nothing from the moment the connection exists
    real_connect = world.connect

    def connect_frozen(address, timeout):
        sock = real_connect(address, timeout)
        world.connections[-1][1].frozen = True
        return sock

    world.connect = connect_frozen   # type: ignore[method-assign]
    assert client.link(server, timeout_ms=2000) is S.LLM_LINK_FAILED
    assert world.now == t0 + 2.0
    assert "timed out" in client.lm.link_failures()[2]["error"]
    # the server's own handshake deadline drops the silent connection at accept + handshake timeout
    assert server.lm.statistics() == {}
    world.run(HANDSHAKE_S)
    (client_end, server_end) = ends(world)
    assert server_end.closed
    assert client.events == [] and server.events == []


def test_nobody_listening_fails_at_once_with_connection_refused(world):
    server = make(world, 2, listen=True)
    server.lm.listeners.stop_listening()
    world.settle()
    client = make(world, 1, LLMRole.DECODER)
    t0 = world.now
    assert client.link(server) is S.LLM_LINK_FAILED
    assert "refused" in client.lm.link_failures()[2]["error"].lower()
    assert world.now == t0


# ---------------------------------------------------------------------------------------------- setup failures


def setup_with_fault(world: World, fault: str, timeout_ms: int) -> tuple[Engine, Engine]:
    """A decoder links to a prompt engine; the moment the decoder's link exists (``link`` fired),
    its end of the control connection gets ``fault``; link_clusters must fail."""
    server = make(world, 2, listen=True)
    client = make(world, 1, LLMRole.DECODER)
    t0 = world.now
    client.at("link", lambda: setattr(ends(world)[0], fault, True))
    assert client.link(server, timeout_ms=timeout_ms) is S.LLM_LINK_FAILED
    world.settle()
    world.t0 = t0   # type: ignore[attr-defined]
    return client, server


def scenario_server_setup_deadline(world: World) -> tuple[Engine, Engine]:
    """The client's tables never reach the server (its sends are lost from the moment its link
    exists): the server's setup ends at its handshake deadline; the client sees the peer go."""
    return setup_with_fault(world, "cut", 5000)


def test_a_server_side_setup_fails_at_its_handshake_deadline_and_leaves_nothing(world):
    client, server = scenario_server_setup_deadline(world)
    t0 = world.t0

    assert server.trace() == [(t0, 1, "accept", "unlinked", "linking"),
                              (t0 + HANDSHAKE_S, 1, "handshake_failed", "linking", "failed"),
                              (t0 + HANDSHAKE_S, 1, "force_unlink", "failed", "closed")]
    # the client learned it when the server closed the connection: peer lost during its setup
    assert client.trace() == [(t0, 2, "link", "unlinked", "linking"),
                              (t0 + HANDSHAKE_S, 2, "peer_lost", "linking", "failed"),
                              (t0 + HANDSHAKE_S, 2, "force_unlink", "failed", "closed")]
    assert world.now == t0 + HANDSHAKE_S
    assert client.lm.get(2) is None and server.lm.get(1) is None


def scenario_client_setup_deadline(world: World) -> tuple[Engine, Engine]:
    """The server's tables never reach the client (its loop reads nothing once the handshake is
    done; the handshake itself is read by the blocking client): the client's link setup fails at
    the link_clusters deadline."""
    return setup_with_fault(world, "frozen", 2000)


def test_a_client_side_setup_fails_at_the_link_deadline(world):
    client, server = scenario_client_setup_deadline(world)
    t0 = world.t0

    assert client.trace() == [(t0, 2, "link", "unlinked", "linking"),
                              (t0 + 2.0, 2, "handshake_failed", "linking", "failed"),
                              (t0 + 2.0, 2, "force_unlink", "failed", "closed")]
    # the server had the client's tables and was LINKED; the client closing is a lost peer there
    assert server.triggers(1) == ["accept", "handshake_succeeded", "peer_lost"]
    assert server.events[-1][0] == t0 + 2.0
    assert server.state(1) is L.FAILED


# ---------------------------------------------------------------------------------------------- liveness


def test_a_linked_pair_stays_linked_with_keepalives_and_measures_their_round_trip(world):
    client, server = linked_pair(world)
    world.run(10 * PEER_TIMEOUT_S)

    assert client.state(2) is L.LINKED and server.state(1) is L.LINKED
    link = client.lm.get(2)
    assert link.rtt_s == 0.0            # an in-memory wire answers in no time
    assert link.liveness.seq == int(10 * PEER_TIMEOUT_S / KEEPALIVE_S)   # one keepalive per tick


def scenario_silent_peer(world: World) -> tuple[Engine, Engine]:
    """The network between a linked pair loses everything from now on, closing nothing."""
    client, server = linked_pair(world)
    c_end, s_end = ends(world)
    c_end.cut = s_end.cut = True
    world.t0 = world.now   # type: ignore[attr-defined]
    world.run(2 * PEER_TIMEOUT_S)
    return client, server


def test_a_silent_peer_is_lost_at_the_first_keepalive_tick_after_the_peer_timeout(world):
    client, server = scenario_silent_peer(world)
    t0 = world.t0
    # both engines tick every KEEPALIVE_S from their creation (at t0); the peer was last heard at
    # t0; the first tick at which the silence exceeds PEER_TIMEOUT_S is t0 + PEER_TIMEOUT_S + 1 tick
    lost_at = t0 + PEER_TIMEOUT_S + KEEPALIVE_S
    assert client.events[-1][:3] == (lost_at, 2, "peer_lost")
    assert server.events[-1][:3] == (lost_at, 1, "peer_lost")
    assert client.state(2) is L.FAILED and server.state(1) is L.FAILED
    assert "no message from peer 2" in client.lm.get(2).last_error


def test_a_peer_that_reads_nothing_is_lost_by_its_backed_up_output(world):
    server = make(world, 2, listen=True, options={"llmdd.peer_timeout_ms": "60000"})
    client = make(world, 1, LLMRole.DECODER)
    assert client.link(server) is S.LLM_SUCCESS
    world.settle()
    t0 = world.now
    c_end, s_end = ends(world)
    s_end.frozen = True          # the server's loop reads nothing more ...
    s_end.capacity = 0           # ... and its receive buffer is full: the client's output backs up
    world.run(3 * PEER_TIMEOUT_S)

    # the client keeps hearing the server's keepalives, so only its unread output can end the link:
    # its first keepalive (tick t0+1) stalls; the first tick more than PEER_TIMEOUT_S later ends it
    first_stall = t0 + KEEPALIVE_S
    assert client.events[-1][:3] == (first_stall + PEER_TIMEOUT_S + KEEPALIVE_S, 2, "peer_lost")
    assert "has read nothing" in client.lm.get(2).last_error


# ---------------------------------------------------------------------------------------------- teardown


def unlinked_pair(world: World, force: bool) -> tuple[Engine, Engine]:
    """A linked pair whose client unlinks (answered LLM_SUCCESS), everything after it run."""
    client, server = linked_pair(world)
    assert client.lm.unlink_clusters([client.cluster(server)], 1000, force)[0] is S.LLM_SUCCESS
    world.settle()
    return client, server


def scenario_unlink(world: World) -> tuple[Engine, Engine]:
    return unlinked_pair(world, force=False)


def test_an_unlink_is_acknowledged_and_closes_both_sides(world):
    client, server = scenario_unlink(world)
    assert client.triggers(2) == ["link", "handshake_succeeded", "unlink", "unlink_succeeded"]
    assert server.triggers(1) == ["accept", "handshake_succeeded", "peer_unlinked"]
    assert client.lm.get(2) is None and server.lm.get(1) is None
    assert client.state(2) is None


def scenario_unlink_unanswered(world: World) -> tuple[Engine, Engine]:
    client, server = linked_pair(world)
    ends(world)[0].cut = True   # the unlink request is lost on the way
    world.t0 = world.now   # type: ignore[attr-defined]
    status, codes = client.lm.unlink_clusters([client.cluster(server)], 1500, False)
    world.status = status   # type: ignore[attr-defined]
    return client, server


def test_an_unanswered_unlink_fails_exactly_at_its_deadline(world):
    client, server = scenario_unlink_unanswered(world)
    t0 = world.t0
    assert world.status is S.LLM_NOTIFY_PROMPT_UNLINK_FAILED
    assert client.trace()[-3:] == [(t0, 2, "unlink", "linked", "unlinking"),
                                   (t0 + 1.5, 2, "unlink_failed", "unlinking", "failed"),
                                   (t0 + 1.5, 2, "force_unlink", "failed", "closed")]
    assert client.lm.get(2) is None
    # the server heard nothing yet: it is still linked until its own liveness says otherwise
    assert server.state(1) is L.LINKED


def scenario_force_unlink(world: World) -> tuple[Engine, Engine]:
    return unlinked_pair(world, force=True)


def test_a_force_unlink_closes_here_at_once_and_the_peer_sees_it_lost(world):
    client, server = scenario_force_unlink(world)
    assert client.triggers(2)[-1] == "force_unlink" and client.lm.get(2) is None
    assert server.triggers(1)[-1] == "peer_lost" and server.state(1) is L.FAILED
    assert "closed the control connection" in server.lm.get(1).last_error


def scenario_finalize(world: World) -> tuple[Engine, Engine]:
    client, server = linked_pair(world)
    client.close()
    world.settle()
    return client, server


def test_finalize_closes_every_link_and_the_peer_sees_it_lost(world):
    client, server = scenario_finalize(world)
    assert client.triggers(2)[-1] == "finalize"
    assert client.events[-1][3:] == (L.LINKED, L.CLOSED)
    assert server.triggers(1)[-1] == "peer_lost"
    assert client.loop.closed


def scenario_transfer_timed_out(world: World) -> tuple[Engine, Engine]:
    """The data plane reports a transfer past sync_kv_timeout through the port."""
    client, server = linked_pair(world)
    client.lm.transfer_timed_out(client.lm.get(2), TimeoutError("sync_kv_timeout passed"))
    world.settle()
    return client, server


def test_a_transfer_timeout_fails_the_link_with_llm_timeout(world):
    client, server = scenario_transfer_timed_out(world)
    link = client.lm.get(2)
    assert client.events[-1][2:] == ("transfer_timed_out", L.LINKED, L.FAILED)
    assert link.failure_status is S.LLM_TIMEOUT
    # the peer is told nothing: its side stays linked until this side unlinks or goes
    assert server.state(1) is L.LINKED


# ---------------------------------------------------------------------------------------------- coverage


#: each trigger of the LINK machine and the production scenario that fires it
SCENARIOS: dict[str, Callable[[World], tuple[Engine, Engine]]] = {
    "link": scenario_link_up,
    "accept": scenario_link_up,
    "handshake_succeeded": scenario_link_up,
    "handshake_failed": scenario_server_setup_deadline,
    "peer_lost": scenario_silent_peer,
    "transfer_timed_out": scenario_transfer_timed_out,
    "regions_updated": None,   # type: ignore[dict-item]   # filled below (needs a second registration)
    "unlink": scenario_unlink,
    "unlink_succeeded": scenario_unlink,
    "unlink_failed": scenario_unlink_unanswered,
    "peer_unlinked": scenario_unlink,
    "force_unlink": scenario_force_unlink,
    "finalize": scenario_finalize,
}


def scenario_regions_updated(world: World) -> tuple[Engine, Engine]:
    client, server = scenario_link_up(world)
    world.keep2 = register_cache(server, np.random.default_rng(11))   # type: ignore[attr-defined]
    world.settle()
    return client, server


SCENARIOS["regions_updated"] = scenario_regions_updated


def test_every_link_trigger_has_a_scenario():
    assert set(SCENARIOS) == {t["trigger"] for t in LINK_TRANSITIONS}


@pytest.mark.parametrize("trigger", sorted(SCENARIOS))
def test_every_link_trigger_is_reached_through_the_pump(world, trigger):
    client, server = SCENARIOS[trigger](world)
    fired = {(t, src, dst) for e in (client, server) for _, _, t, src, dst in e.events}
    allowed = {(t["trigger"], src, t["dest"]) for t in LINK_TRANSITIONS
               for src in (t["source"] if isinstance(t["source"], list) else [t["source"]])}
    assert any(t == trigger for t, _, _ in fired), f"{trigger} not fired: {sorted(fired)}"
    assert fired <= allowed, f"transitions outside the table: {fired - allowed}"


def test_the_simulation_is_deterministic():
    traces = []
    for _ in range(2):
        w = World()
        w.engines = []   # type: ignore[attr-defined]
        client, server = scenario_silent_peer(w)
        traces.append((client.trace(), server.trace(), w.steps))
        for e in w.engines:
            e.close()
        w.settle()
        assert w.failures == []
    assert traces[0] == traces[1]
    assert len(traces[0][0]) == 3   # link, handshake_succeeded, peer_lost


def test_both_sides_unlinking_at_once_close_both_links_without_an_error(world):
    """Crossing unlinks: each side answers the other's request and its own unlink ends the link;
    both succeed (hicann/hixl ``hixl_transfer_engine.cc:186-219``: each side's unlink is its own)."""
    client, server = linked_pair(world)
    answers: dict[str, LLMStatusCode] = {}
    # the server's unlink starts the moment the client's link is UNLINKING (its request on the way)
    client.at("unlink", lambda: answers.setdefault(
        "server", server.lm.unlink_clusters([server_cluster(server, client)], 1000, False)[0]))
    answers["client"] = client.lm.unlink_clusters([client.cluster(server)], 1000, False)[0]
    world.settle()

    assert client.lm.get(2) is None and server.lm.get(1) is None
    assert world.failures == []
    assert client.trace()[-2:] == [(world.now, 2, "unlink", "linked", "unlinking"),
                                   (world.now, 2, "unlink_succeeded", "unlinking", "closed")]
    assert server.trace()[-2:] == [(world.now, 1, "unlink", "linked", "unlinking"),
                                   (world.now, 1, "unlink_succeeded", "unlinking", "closed")]
    assert answers == {"server": S.LLM_SUCCESS, "client": S.LLM_SUCCESS}


def mutual_pair(world: World) -> tuple[Engine, Engine]:
    """Both listen; the client links to the server, then the server links back (it claims the
    client's link: one link per pair, held by both sides)."""
    server = make(world, 2, LLMRole.PROMPT, listen=True)
    client = make(world, 1, LLMRole.DECODER, listen=True)
    assert client.link(server) is S.LLM_SUCCESS
    world.settle()
    assert server.link(client) is S.LLM_SUCCESS
    world.settle()
    assert client.state(2) is L.LINKED and server.state(1) is L.LINKED
    assert len(world.connections) == 1
    return client, server


def scenario_mutual_unlink_in_sequence(world: World) -> tuple[Engine, Engine]:
    """After a mutual link the client unlinks first: the server still holds the link, so it stays up
    (the client released it: ``unlink_kept``)."""
    client, server = mutual_pair(world)
    world.status = client.lm.unlink_clusters([client.cluster(server)], 1000, False)[0]   # type: ignore[attr-defined]
    world.settle()
    return client, server


def test_mutual_unlink_in_sequence_each_side_succeeds_and_the_link_ends_with_the_second(world):
    """hicann/hixl ``hixl_transfer_backend_sample.py`` 115-117 and 184-186: after a mutual link both
    sides' non-force unlinks succeed; each gives back only its own hold (``hixl_transfer_engine.cc:186-219``,
    ``comm_entity_manager.cc:33-61``)."""
    client, server = scenario_mutual_unlink_in_sequence(world)
    t0 = world.now
    assert world.status is S.LLM_SUCCESS
    assert client.trace()[-2:] == [(t0, 2, "unlink", "linked", "unlinking"),
                                   (t0, 2, "unlink_kept", "unlinking", "released")]
    assert client.state(2) is L.RELEASED and server.state(1) is L.LINKED
    assert server.triggers(1) == ["accept", "handshake_succeeded"]   # the server heard only a released hold
    assert client.lm.get(2).released and not server.lm.get(1).released
    # the client no longer uses it (as a call made after an unlink), and a repeated unlink says so
    with pytest.raises(Exception) as err:
        client.lm.require(2)
    assert err.value.status_code is S.LLM_NOT_YET_LINK
    assert client.lm.unlink_clusters([client.cluster(server)], 1000, False)[0] is S.LLM_NOT_YET_LINK
    server.lm.require(1)   # the server still does
    # the server's own unlink is the last hold: the link ends on both sides
    assert server.lm.unlink_clusters([server_cluster(server, client)], 1000, False)[0] is S.LLM_SUCCESS
    world.settle()
    assert client.lm.get(2) is None and server.lm.get(1) is None
    assert client.triggers(2)[-1] == "peer_unlinked" and server.triggers(1)[-1] == "unlink_succeeded"


def scenario_link_again_after_release(world: World) -> tuple[Engine, Engine]:
    """The client released a mutual link (the server kept it), then links again: it holds the kept
    link again (``hold``: RELEASED -> LINKED), without a new connection."""
    client, server = scenario_mutual_unlink_in_sequence(world)
    world.status = client.link(server)   # type: ignore[attr-defined]
    return client, server


def test_a_side_that_unlinked_links_again_without_a_new_connection(world):
    client, server = scenario_link_again_after_release(world)
    assert world.status is S.LLM_SUCCESS   # type: ignore[attr-defined]  # the client holds the kept link again
    assert client.trace()[-1] == (world.now, 2, "hold", "released", "linked")
    assert not client.lm.get(2).released and len(world.connections) == 1
    client.lm.require(2)
    # now the server's unlink leaves it to the client, and the client's ends it
    assert server.lm.unlink_clusters([server_cluster(server, client)], 1000, False)[0] is S.LLM_SUCCESS
    world.settle()
    assert server.lm.get(1).released and client.state(2) is L.LINKED
    assert client.lm.unlink_clusters([client.cluster(server)], 1000, False)[0] is S.LLM_SUCCESS
    world.settle()
    assert client.lm.get(2) is None and server.lm.get(1) is None


def test_mutual_unlinks_crossing_both_succeed(world):
    client, server = mutual_pair(world)
    answers: dict[str, LLMStatusCode] = {}
    client.at("unlink", lambda: answers.setdefault(
        "server", server.lm.unlink_clusters([server_cluster(server, client)], 1000, False)[0]))
    answers["client"] = client.lm.unlink_clusters([client.cluster(server)], 1000, False)[0]
    world.settle()
    assert answers == {"server": S.LLM_SUCCESS, "client": S.LLM_SUCCESS}
    assert client.lm.get(2) is None and server.lm.get(1) is None
    assert client.triggers(2)[-2:] == ["unlink", "unlink_succeeded"]
    assert server.triggers(1)[-2:] == ["unlink", "unlink_succeeded"]


def test_an_unlink_request_on_a_link_failed_here_closes_it_whatever_this_side_holds(world):
    """A side whose link failed (a transfer timed out) keeps no hold worth answering "kept": the
    peer's unlink ends the link on both sides (LLM_SUCCESS there), never a half-open pair."""
    client, server = mutual_pair(world)
    client.lm.transfer_timed_out(client.lm.get(2), TimeoutError("sync_kv_timeout passed"))
    world.settle()
    assert client.state(2) is L.FAILED and client.lm.get(2).holds
    assert server.lm.unlink_clusters([server_cluster(server, client)], 1000, False)[0] is S.LLM_SUCCESS
    world.settle()
    assert client.lm.get(2) is None and server.lm.get(1) is None
    assert client.triggers(2)[-1] == "peer_unlinked" and server.triggers(1)[-1] == "unlink_succeeded"


SCENARIOS["unlink_kept"] = scenario_mutual_unlink_in_sequence
SCENARIOS["hold"] = scenario_link_again_after_release


def server_cluster(server: Engine, client: Engine) -> LLMClusterInfo:
    """The server's cluster info for its peer (an unlink needs only the peer's cluster id)."""
    info = LLMClusterInfo()
    info.remote_cluster_id = client.cluster_id
    return info


def test_a_request_answered_with_an_unlink_ack_fails_with_the_contracts_status(world, monkeypatch):
    """A peer that answers a data-plane request with an ``UnlinkAck`` (its request id, the wrong
    message) gets the contract's LLM_LINK_FAILED, never an AttributeError from the reply's fields;
    the control: the same request answered properly succeeds."""
    client, server = linked_pair(world)
    link = client.lm.get(2)
    status, result = client.lm.request(link, RequestOp.ENGINE_INFO, {}, deadline=world.now + 2.0)
    assert status == S.LLM_SUCCESS.value and result   # the control: a proper TransferReply

    def reply_with_unlink_ack(lk, request_id, op, serve, *args):
        server.lm.exchange.notify(lk, m.UnlinkAck(request_id=request_id, status_code=S.LLM_SUCCESS.value))

    monkeypatch.setattr(server.lm.exchange, "_reply", reply_with_unlink_ack)
    with pytest.raises(LLMException) as caught:
        client.lm.request(link, RequestOp.ENGINE_INFO, {}, deadline=world.now + 2.0)
    assert caught.value.status_code is S.LLM_LINK_FAILED and "UnlinkAck" in str(caught.value)
