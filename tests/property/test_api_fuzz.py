"""Hostile arguments at the public API, hostile bytes at the listeners (reliability.md 3.4, S8).

One live engine in this test process (a decoder, linked to a prompt kept in a child process):

* hypothesis calls ``CacheManager`` and ``LLMDataDist`` methods and the value types' constructors
  and setters with random arguments (boundary and huge ints, numpy ints, wrong types, None, huge,
  negative and empty lists, real objects of the wrong kind).  Only ``TypeError``, ``ValueError``,
  ``AttributeError`` or ``LLMException`` may come out, and the engine still links and moves
  correct bytes afterwards;
* random bytes and mutated valid frames go to the prompt's control listener and to its tcp
  transport's data listener: the child stays alive, and a good client (this engine) still links
  and pulls correct bytes.
"""

from __future__ import annotations

import os
import socket
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event as _hyp_event, given, settings, strategies as st
from hypothesis.control import currently_in_test_context

HERE = os.path.dirname(os.path.abspath(__file__))
REL = os.path.join(os.path.dirname(HERE), "reliability")
if REL not in sys.path:
    sys.path.insert(0, REL)
import _rel_peers as R  # noqa: E402

from llmdd import (BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType,  # noqa: E402
                   LLMClusterInfo, LLMConfig, LLMException, LLMRole, MemInfo, Memtype, Placement,
                   TransferConfig, TransferWithCacheKeyConfig)
from llmdd._protocol import messages as m  # noqa: E402
from llmdd._protocol.codec import encode_frame  # noqa: E402
from llmdd._protocol.handshake import ClientHandshake, HandshakeConfig  # noqa: E402
from llmdd.testing._harness import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PROMPT, DECODER = 1, 2
NT, NB, BS = 2, 8, 1024
ALLOWED = (TypeError, ValueError, AttributeError, LLMException)
#: the contract's one RuntimeError: ``append_local_ip_info`` / ``append_remote_ip_info`` given a string that
#: is not an IPv4 address raise ``RuntimeError("Can not parse ip str:<ip>")``, as upstream's ``trans_str_ip``
IP_METHODS = ("append_local_ip_info", "append_remote_ip_info")
IP_ERROR = "Can not parse ip str:"


def event(text: str) -> None:
    """hypothesis' ``event`` inside a hypothesis test; nothing in the plain regression tests."""
    if currently_in_test_context():
        _hyp_event(text)


def _documented(fn, exc: BaseException) -> bool:
    """Is ``exc`` a documented outcome of calling ``fn``?"""
    if isinstance(exc, ALLOWED):
        return True
    return (isinstance(exc, RuntimeError) and getattr(fn, "__name__", "") in IP_METHODS
            and str(exc).startswith(IP_ERROR))
# no shrinking: a failing call sequence is reported as drawn (every call is logged by ``event``
# and the failing example is printed); shrinking through a live engine and a child costs minutes
SETTINGS = dict(deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate], suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                      HealthCheck.data_too_large])


class World:
    """The test process's engine (``state`` as the peer helpers use it) and the prompt child."""

    def __init__(self) -> None:
        self.cluster = Cluster(env={"LLMDD_AUTH_SECRET": None, "LLMDD_FAULTS": None})
        (self.p,) = self.cluster.spawn("fuzz_p")
        self.port = self.p.call(R.setup, "PROMPT", PROMPT, listen=True)
        self.p.call(R.register_blocks, "src", NT, NB, BS, seed=1, key=(PROMPT, 0))
        self.data_port = self.p.call(R.tcp_data_endpoint)["port"]
        self.state: dict = {}
        R.setup(self.state, "DECODER", DECODER, mem_pool=1 << 20)
        R.register_blocks(self.state, "dst", NT, NB, BS)
        R.allocate(self.state, "pc", NT, [1, 4096])
        assert R.link(self.state, [(PROMPT, self.port)])["status"] == "LLM_SUCCESS"
        self.dd = self.state["dd"]
        self.cm = self.dd.cache_manager

    def works(self) -> None:
        """The engine links (relinking if the fuzz broke the link) and pulls correct bytes."""
        assert self.p.is_alive(), f"the prompt child died: exit code {self.p.exitcode}"
        if R.link_states(self.state).get(PROMPT) != "linked":
            R.unlink(self.state, [(PROMPT, self.port)], True)
            res = R.link(self.state, [(PROMPT, self.port)])
            assert res["status"] == "LLM_SUCCESS", res
        R.fill(self.state, "dst", R.POISON)
        job = ("pull_blocks", ("blocks", PROMPT, 0), "dst", list(range(NB)), list(range(NB)))
        status = R.transfer(self.state, *job)[0]
        if status == "LLM_KV_CACHE_NOT_EXIST":   # the fuzz unregistered dst (by a guessed id): legal
            R.register_blocks(self.state, "dst", NT, NB, BS)
            status = R.transfer(self.state, *job)[0]
        assert status == "LLM_SUCCESS", (status, R.stats(self.state)["links"])
        np.testing.assert_array_equal(R.snapshot(self.state, "dst"), R.pattern(PROMPT, 1, NT, NB * BS))

    def restore(self) -> None:
        """Bring back the engine's own caches when a call released them (legal, by a guessed id or
        the real object), so that later examples reach the planner and the transport again."""
        memory = self.dd._core.memory
        for name in ("dst", "pc"):
            rec = memory.get(self.state["caches"][name].cache_id)
            if rec is None or not rec.live:
                if name == "dst":
                    R.register_blocks(self.state, "dst", NT, NB, BS)
                else:
                    R.allocate(self.state, "pc", NT, [1, 4096])

    def close(self) -> None:
        R.finalize(self.state)
        self.cluster.close()


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


# --------------------------------------------------------------------------- argument strategies
BOUNDARY = [0, 1, -1, 2, 15, 16, 17, 240, 241, 512, 4096, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1,
            2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 2**64 + 1, 10**30]
ints = st.sampled_from(BOUNDARY) | st.integers()
np_ints = st.one_of(
    st.integers(-2**63, 2**63 - 1).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(-2**31, 2**31 - 1).map(np.int32),
    st.integers(0, 255).map(np.uint8),
)
scalars = st.one_of(st.none(), st.booleans(), ints, np_ints, st.floats(), st.text(max_size=6), st.binary(max_size=6),
                    st.sampled_from([LLMRole.PROMPT, LLMRole.DECODER, DataType.DT_UINT8, Placement.HOST,
                                     Memtype.MEM_TYPE_DEVICE, object(), range(0, 2), range(-1, 5), range(5, 2)]))
int_lists = st.one_of(st.lists(ints, max_size=6), st.lists(np_ints, max_size=4),
                      st.just(list(range(100_000))), st.just([-1] * 1000), st.just([]), st.tuples(ints, ints))
# value objects built with (mostly) valid fields, so calls get past the first type checks
valid_objects = st.one_of(
    st.builds(CacheKey, st.integers(0, 4), st.integers(0, 8), st.integers(0, 2)),
    st.builds(CacheKeyByIdAndIndex, st.integers(0, 4), st.integers(0, 8), st.integers(0, 2)),
    st.builds(BlocksCacheKey, st.integers(0, 4), st.integers(0, 2)),
    st.builds(CacheDesc, st.integers(1, 4), st.lists(st.integers(1, 64), min_size=1, max_size=3),
              st.just(DataType.DT_UINT8), st.sampled_from([Placement.DEVICE, Placement.HOST])),
    st.builds(MemInfo, st.just(Memtype.MEM_TYPE_DEVICE), st.integers(1, 2**40), st.integers(1, 2**20)),
)
values = st.deferred(lambda: st.one_of(
    scalars, int_lists, valid_objects,
    st.dictionaries(ints, st.one_of(ints, st.lists(ints, max_size=3)), max_size=3),
    st.lists(scalars, max_size=3),
    st.sampled_from(["dst", "pc"]),        # placeholders for the engine's own caches (see _materialize)
))


def _materialize(world: World, value):
    """Turn the "dst"/"pc" placeholders into the engine's real Cache objects (wrong kinds included)."""
    if isinstance(value, str) and value in ("dst", "pc"):
        return world.state["caches"][value]
    return value


CM_METHODS = ["register_cache", "register_blocks_cache", "unregister_cache", "allocate_cache",
              "allocate_blocks_cache", "deallocate_cache", "deallocate_blocks_cache", "remove_cache_key",
              "copy_cache", "copy_blocks", "swap_blocks", "remap_registered_memory", "pull_cache", "pull_blocks",
              "push_cache", "push_blocks", "transfer_cache_async"]
DD_METHODS = ["link_clusters", "unlink_clusters", "switch_role", "link", "unlink", "query_register_mem_status",
              "init"]


class _Ready:
    """A layer synchronizer that says every layer is ready at once."""

    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


from llmdd import LayerSynchronizer  # noqa: E402

LayerSynchronizer.register(_Ready)

def _safe(ctor):
    """``ctor`` for ``st.builds`` that yields None where the constructor refuses its arguments (the
    constructors themselves are fuzzed by the next test; here a refused object is just one more junk value)."""
    def build(*args):
        try:
            return ctor(*args)
        except ALLOWED:
            return None
    return build


# plausible values per parameter kind: a call mixes them with junk (``values``) so that it gets past
# the first type checks and reaches the deeper validation, the planner and the peer
small = st.sampled_from([-2, -1, 0, 1, 2, NB - 1, NB, NB + 1, 2**31, 2**63 - 1]) | st.integers(0, NB - 1)
blocks = st.lists(small, max_size=NB + 2) | st.just(list(range(NB)))
layer_ranges = st.sampled_from([None, range(0, 1), range(0, NT // 2), range(1, 2), range(0, 5), range(3, 1),
                                range(0, 2**40), range(0, 4, 2)])
keys = st.one_of(st.just(BlocksCacheKey(PROMPT, 0)), st.builds(_safe(BlocksCacheKey), small, small),
                 st.builds(_safe(CacheKeyByIdAndIndex), st.sampled_from([PROMPT, DECODER, 7]), small, small),
                 st.builds(_safe(CacheKey), st.sampled_from([PROMPT, DECODER]), small, small))
caches = st.sampled_from(["dst", "pc"])
descs = st.builds(_safe(CacheDesc), st.sampled_from([1, 2, NT, NT, 0, 2**31]),
                  st.sampled_from([[NB, BS], [NB, BS], [1, 4096], [2, 1024], [1, 1 << 40], [0, 16], [2**62, 2**62],
                                   [3]]),
                  st.just(DataType.DT_UINT8), st.sampled_from([Placement.DEVICE, Placement.HOST]))
addrs = st.lists(st.sampled_from([0, 1, 4096, 2**47, 2**64 - 1, -1]), min_size=0, max_size=3)
def mixed(good):
    """Mostly ``good`` (7 of 8 draws), else any junk value."""
    return st.integers(0, 7).flatmap(lambda i: values if i == 0 else good)



TEMPLATES = {
    "register_cache": [descs, addrs, st.lists(keys, max_size=2), st.booleans() | st.none()],
    "register_blocks_cache": [descs, addrs, keys | st.none(), st.booleans() | st.none()],
    "unregister_cache": [small],
    "allocate_cache": [descs, st.lists(keys, max_size=2)],
    "allocate_blocks_cache": [descs, keys | st.none()],
    "deallocate_cache": [caches],
    "deallocate_blocks_cache": [caches],
    "remove_cache_key": [keys],
    "copy_cache": [caches, caches, small, small, small, small | st.just(-1)],
    "copy_blocks": [caches, st.dictionaries(small, blocks, max_size=3)],
    "swap_blocks": [caches, caches, st.dictionaries(small, small, max_size=3)],
    "remap_registered_memory": [st.lists(st.builds(_safe(MemInfo), st.just(Memtype.MEM_TYPE_DEVICE), st.sampled_from(
        [1, 4096, 2**47]), st.sampled_from([1, 4096, 2**40])), max_size=2)],
    "pull_cache": [keys, caches, small, small | st.just(-1)],
    "pull_blocks": [keys, caches, blocks, blocks],
    "push_cache": [keys, caches, small, layer_ranges, layer_ranges, small | st.just(-1), st.sampled_from([1, 2, 0])],
    "push_blocks": [keys, caches, blocks, blocks, layer_ranges, layer_ranges, st.sampled_from([1, 2, 0])],
    "transfer_cache_async": [caches, st.just(_Ready()), st.lists(st.one_of(
        st.builds(_safe(TransferWithCacheKeyConfig), keys, layer_ranges, layer_ranges),
        st.builds(_safe(TransferConfig), st.just(PROMPT), addrs, st.sampled_from([0, 1, 1 << 20]))), max_size=2),
        st.none() | blocks, st.none() | blocks],
}
PULL_KWARGS = st.fixed_dictionaries({}, optional={"src_layer_range": layer_ranges, "dst_layer_range": layer_ranges,
                                                  "tensor_num_per_layer": st.sampled_from([0, 1, 2, 3, -1])})


def _cleanup(world: World, result) -> None:
    """What a call created by chance (a registration, an allocation, an async task) is undone at once."""
    from llmdd import Cache, CacheTask

    if isinstance(result, CacheTask):
        try:
            result.get_results(5000)
        except ALLOWED:
            pass
    elif isinstance(result, Cache) and result is not world.state["caches"]["dst"]:
        errors = []
        for undo in (world.cm.deallocate_cache, world.cm.deallocate_blocks_cache,
                     lambda c: world.cm.unregister_cache(c.cache_id)):
            try:
                undo(result)
                return
            except LLMException as exc:
                errors.append(str(exc))
        raise AssertionError(f"a cache the fuzz created cannot be released: {errors}")


def _call(world: World, fn, args: list, kwargs: dict | None = None) -> None:
    label = getattr(fn, "__name__", str(fn))
    try:
        result = fn(*args, **(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - only documented outcomes pass
        if not _documented(fn, exc):
            raise
        code = getattr(getattr(exc, "status_code", None), "name", "")
        event(f"{label}: {type(exc).__name__} {code} {str(exc)[:50]}")
        return
    event(f"{label}: returned")
    _cleanup(world, result)
    world.restore()


@settings(max_examples=500, **SETTINGS)
@given(data=st.data())
def test_cache_manager_with_plausible_and_hostile_arguments(world, data):
    name = data.draw(st.sampled_from(CM_METHODS), label="method")
    params = TEMPLATES[name]
    # usually every parameter; sometimes trailing defaults (or required ones) left out
    n = data.draw(st.sampled_from([len(params)] * 3 + list(range(len(params)))), label="nargs")
    args = [_materialize(world, data.draw(mixed(p))) for p in params[:n]]
    kwargs = data.draw(PULL_KWARGS) if name == "pull_blocks" and n >= 2 else {}
    _call(world, getattr(world.cm, name), args, kwargs)


@settings(max_examples=300, **SETTINGS)
@given(data=st.data())
def test_public_api_with_random_arguments_raises_only_documented_errors(world, data):
    target = data.draw(st.sampled_from(["cm", "dd", "dd", "value", "value"]), label="target")
    args = [_materialize(world, a) for a in data.draw(st.lists(values, max_size=5), label="args")]
    if target == "cm":
        fn = getattr(world.cm, data.draw(st.sampled_from(CM_METHODS), label="method"))
    elif target == "dd":
        name = data.draw(st.sampled_from(DD_METHODS), label="method")
        if name in ("link_clusters", "unlink_clusters") and data.draw(st.booleans()):
            # real cluster infos of other (absent) clusters with junk fields: never the linked prompt,
            # never a remote address (a blackholed one would only test the link timeout)
            info = LLMClusterInfo()
            try:
                info.remote_cluster_id = data.draw(ints.filter(lambda v: v != PROMPT))
                info.append_local_ip_info(data.draw(values), data.draw(values))
            except Exception as exc:  # noqa: BLE001 - only documented outcomes pass
                if not _documented(info.append_local_ip_info, exc):
                    raise
            args = [[info], *args[1:2]]
        fn = getattr(world.dd, name)
    else:
        ctor = data.draw(st.sampled_from([CacheDesc, CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey, MemInfo,
                                          TransferConfig, TransferWithCacheKeyConfig, "cluster", "config"]))
        if ctor == "cluster":
            obj = LLMClusterInfo()
            attr = data.draw(st.sampled_from(["remote_cluster_id", "remote_role_type", "append_local_ip_info",
                                              "append_remote_ip_info"]))
            if attr.startswith("append"):
                fn = getattr(obj, attr)
            else:
                def fn(*a, _o=obj, _n=attr):
                    setattr(_o, _n, *a[:1])
        elif ctor == "config":
            obj = LLMConfig()
            attr = data.draw(st.sampled_from(["device_id", "sync_kv_timeout", "mem_pool_cfg", "listen_ip_info",
                                              "link_total_time", "link_retry_count", "rdma_traffic_class",
                                              "enable_cache_manager", "ge_options", "buf_pool_cfg"]))

            def fn(*a, _o=obj, _n=attr):
                setattr(_o, _n, *a[:1])
                return _o.generate_options()
        else:
            fn = ctor
    _call(world, fn, args)


@pytest.mark.parametrize("method", IP_METHODS)
@pytest.mark.parametrize("ip", ["", "not-an-ip", "1.2.3.4.5", "::1", "256.0.0.1 "])
def test_regression_bad_ip_string_raises_the_contracts_runtime_error(world, method, ip):
    """The example that made the fuzz test fail for ~5% of seeds (hypothesis then replayed it from
    its database on every rerun): a string that is not an IPv4 address.  The contract's outcome is
    ``RuntimeError("Can not parse ip str:<ip>")``, which the fuzz now accepts from these two
    methods only; a RuntimeError from anything else still fails it (control below)."""
    fn = getattr(LLMClusterInfo(), method)
    with pytest.raises(RuntimeError, match=r"^Can not parse ip str:"):
        fn(ip, 0)
    _call(world, fn, [ip, 0])          # accepted as a documented outcome

    def other(*_a):
        raise RuntimeError(IP_ERROR + "x")
    with pytest.raises(RuntimeError):  # the same error from another callable is not documented
        _call(world, other, [])


@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_engine_still_works_between_api_fuzz_rounds(world, data):
    """Short fuzz rounds, each followed by a real link check and a verified pull."""
    for _ in range(10):
        name = data.draw(st.sampled_from(CM_METHODS))
        args = [_materialize(world, data.draw(mixed(p))) for p in TEMPLATES[name]]
        _call(world, getattr(world.cm, name), args)
    world.works()


# --------------------------------------------------------------------------- hostile bytes at the listeners
def _send(port: int, payload: bytes, *, read: bool = True) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.settimeout(0.3)
            try:
                s.sendall(payload)
                if read:
                    s.recv(4096)
            except OSError:
                pass
    except OSError:
        pass


def _hello_frame(cluster_id: int = 99) -> bytes:
    hs = ClientHandshake(HandshakeConfig(cluster_id=cluster_id, role=LLMRole.DECODER))
    return encode_frame(hs.start())


def _mutate(data: st.DataObject, frame: bytes) -> bytes:
    buf = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "double"]))
    if how == "truncate":
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    elif how == "extend":
        buf += data.draw(st.binary(max_size=64))
    elif how == "double":
        buf = buf + bytes(frame)
    return bytes(buf)


REQ = struct.Struct("<4sBBHIQ")
OP = struct.Struct("<IQQ")


def _data_request(region: int, offset: int, length: int) -> bytes:
    return REQ.pack(b"LDRQ", 1, 0, 0, 1, length) + OP.pack(region, offset, length)


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_control_listener_survives_random_and_mutated_frames(world, data):
    kind = data.draw(st.sampled_from(["random", "mutated", "valid_then_junk"]))
    if kind == "random":
        payload = data.draw(st.binary(min_size=1, max_size=512))
    elif kind == "mutated":
        payload = _mutate(data, _hello_frame())
    else:
        payload = _hello_frame() + data.draw(st.binary(min_size=1, max_size=64))
    _send(world.port, payload)
    assert world.p.is_alive()


@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_tcp_data_listener_survives_random_and_mutated_requests(world, data):
    region = data.draw(st.sampled_from([0, 1, 2, 2**32 - 1]))
    valid = _data_request(region, data.draw(st.sampled_from([0, 8, 2**64 - 1])),
                          data.draw(st.sampled_from([1, 16, 2**63])))
    kind = data.draw(st.sampled_from(["random", "mutated"]))
    payload = data.draw(st.binary(min_size=1, max_size=256)) if kind == "random" else _mutate(data, valid)
    _send(world.data_port, payload)
    assert world.p.is_alive()


def test_after_the_network_fuzz_a_good_client_links_and_pulls(world):
    # relink from scratch (the real handshake, tables and data channel) and pull verified bytes
    R.unlink(world.state, [(PROMPT, world.port)], True)
    world.works()
    assert R.link_states(world.state)[PROMPT] == "linked"
    assert world.p.call(R.is_up)
