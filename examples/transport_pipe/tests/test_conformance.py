"""The example transport against llmdd.testing's conformance suite (every check), and registered
through llmdd's plugin hook as an installed distribution's entry point would register it."""

from __future__ import annotations

import functools
import os
import sys

import pytest

try:
    import llmdd_pipe
except ImportError:   # not installed (pip install -e examples/transport_pipe): run it from the tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import llmdd_pipe

from llmdd.testing import CONFORMANCE_CHECKS, run_check
from llmdd_pipe import PipeTransport


def make_pair():
    t = PipeTransport({})
    return t.open_endpoint(), t.open_endpoint()


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS, ids=lambda c: c.__name__)
def test_conformance(check):
    run_check(check, make_pair, transport=functools.partial(PipeTransport, {}))


def _engine(state, role, cluster, listen=None):
    """In a peer process: an engine with the pipe transport registered and forced."""
    import llmdd_pipe as plugin
    from llmdd import LLMConfig, LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole[role], cluster)
    dd.add_plugin(plugin, name="llmdd_pipe")      # before init; an installed entry point does the same
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    if listen:
        cfg.listen_ip_info = listen
    dd.init({**cfg.generate_options(), "llmdd.transport": "pipe"})
    state["dd"] = dd


def _serve(state, seed):
    import numpy as np
    from llmdd import BlocksCacheKey, CacheDesc, DataType

    kv = np.random.default_rng(seed).integers(0, 256, (2, 8 * 4096), dtype=np.uint8)
    state["kv"] = kv
    state["dd"].cache_manager.register_blocks_cache(CacheDesc(2, [8, 4096], DataType.DT_UINT8),
                                                    [int(kv[0].ctypes.data), int(kv[1].ctypes.data)],
                                                    BlocksCacheKey(1, 0))


def _pull(state, port, src, dst_blocks):
    import numpy as np
    from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMStatusCode

    dd = state["dd"]
    dst = np.zeros((2, 8 * 4096), dtype=np.uint8)
    cache = dd.cache_manager.register_blocks_cache(CacheDesc(2, [8, 4096], DataType.DT_UINT8),
                                                   [int(dst[0].ctypes.data), int(dst[1].ctypes.data)])
    server = LLMClusterInfo()
    server.remote_cluster_id = 1
    server.append_local_ip_info("127.0.0.1", 0)
    server.append_remote_ip_info("127.0.0.1", port)
    ret, rets = dd.link_clusters([server], 5000)
    assert ret == LLMStatusCode.LLM_SUCCESS, rets
    transport = dd.statistics()["links"][1]["transport"]
    dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src, dst_blocks)
    dd.unlink_clusters([server], 5000, force=True)
    return transport, dst.tobytes()


def _finalize(state):
    state.pop("dd").finalize()


def test_two_engines_pull_over_it():
    """Registered on two engines in two processes as its entry point would register it (``add_plugin``
    is the same hook, for one engine) and forced with ``llmdd.transport``: a pull lands byte for byte."""
    import numpy as np

    from llmdd.testing import free_port, peers

    port = free_port()
    with peers("prompt", "decoder") as cluster:
        p, d = cluster["prompt"], cluster["decoder"]
        p.call(_engine, "PROMPT", 1, f"127.0.0.1:{port}")
        d.call(_engine, "DECODER", 2)
        p.call(_serve, 17)
        transport, raw = d.call(_pull, port, [0, 1, 5], [2, 3, 4])
        assert transport == "pipe"
        got = np.frombuffer(raw, dtype=np.uint8).reshape(2, 8, 4096)
        want = np.random.default_rng(17).integers(0, 256, (2, 8 * 4096), dtype=np.uint8).reshape(2, 8, 4096)
        assert np.array_equal(got[:, [2, 3, 4]], want[:, [0, 1, 5]])
        assert not got[:, [0, 1, 5, 6, 7]].any()   # control: blocks not pulled stay zero
        d.call(_finalize)
        p.call(_finalize)


def test_the_suite_fails_a_transport_that_breaks_its_rules(monkeypatch):
    """Controls: the authentication and foreign-descriptor checks really fail a transport that ignores
    the secret, or accepts another endpoint's descriptors."""
    checks = {c.__name__: c for c in CONFORMANCE_CHECKS}
    check_authentication, check_foreign_descriptor = checks["check_authentication"], checks["check_foreign_descriptor"]
    real_mac = llmdd_pipe._mac
    with monkeypatch.context() as m:
        m.setattr(llmdd_pipe, "_mac", lambda secret, eid, nonce: real_mac(None, eid, nonce))
        with pytest.raises(AssertionError, match="another secret moved data"):
            check_authentication(make_pair, functools.partial(PipeTransport, {}))

    def trusting(self, region_id, size, desc):   # no check that the descriptor is this peer's
        with self._lock:
            self._remote[int(region_id)] = int(size)
            self._table = llmdd_pipe.RegionTable(self._remote)

    with monkeypatch.context() as m:
        m.setattr(llmdd_pipe.PipeChannel, "add_remote_region", trusting)
        with pytest.raises(AssertionError, match="descriptor of a third endpoint was accepted"):
            check_foreign_descriptor(make_pair)


def test_the_suite_fails_a_transport_that_raises_a_refusal_or_reads_a_newer_descriptor(monkeypatch):
    """Controls for the seam's rules: a read() that raises its refusal (instead of reporting it through the
    completion) fails check_refusals; a transport that reads a descriptor of a newer version than it knows
    fails check_describe_and_connect."""
    checks = {c.__name__: c for c in CONFORMANCE_CHECKS}
    real_submit = llmdd_pipe.PipeChannel._submit

    def raising(self, kind, ops, deadline):
        c = real_submit(self, kind, ops, deadline)
        if c.done() and c.error is not None:
            raise c.error            # the old second path: refusals raised at submit
        return c

    with monkeypatch.context() as m:
        m.setattr(llmdd_pipe.PipeChannel, "_submit", raising)
        m.setattr(llmdd_pipe.PipeChannel, "read", lambda self, ops, *, deadline: self._submit(1, ops, deadline))
        with pytest.raises(AssertionError, match="reports every refusal"):
            checks["check_refusals"](make_pair)
    with monkeypatch.context() as m:
        real_decode = llmdd_pipe.decode_payload   # reads whatever version a peer sends
        m.setattr(llmdd_pipe, "decode_payload",
                  lambda desc, *, transport, version, type: real_decode(desc, transport=transport, version=2**32 - 1,
                                                                         type=type))
        with pytest.raises(AssertionError, match="newer version was accepted"):
            checks["check_describe_and_connect"](make_pair)


def test_the_docs_show_this_source():
    """docs/writing-a-transport.md shows the whole module; the block and the file stay identical."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = open(os.path.join(root, "src", "llmdd_pipe", "__init__.py"), encoding="utf-8").read()
    page = open(os.path.join(root, "..", "..", "docs", "writing-a-transport.md"), encoding="utf-8").read()
    assert "```python\n" + source + "```\n" in page
    toml = open(os.path.join(root, "pyproject.toml"), encoding="utf-8").read()
    assert "```toml\n" + toml + "```\n" in page
