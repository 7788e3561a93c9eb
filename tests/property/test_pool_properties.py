"""PagePool against a reference model: random allocate/free sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmdd._memory.backend import HostBackend
from llmdd._memory.pool import PagePool
from llmdd._base.status import LLMException, LLMStatusCode

PAGES = 32
SHIFT = 10

ops_strategy = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(0, 12 << SHIFT)),
              st.tuples(st.just("free"), st.integers(0, 10_000))),
    min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy)
def test_pool_matches_reference_model(ops):
    pool = PagePool(PAGES << SHIFT, SHIFT, HostBackend())
    live: dict[int, int] = {}  # addr -> pages (reference model)
    try:
        for kind, arg in ops:
            if kind == "alloc":
                pages = max(1, -(-arg >> SHIFT))
                used = sum(live.values())
                try:
                    addr = pool.allocate(arg)
                except LLMException as exc:
                    assert exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
                    # refused only if no free run of that size exists
                    assert pool.statistics().largest_free_run < pages
                    assert PAGES - used >= 0
                else:
                    start = (addr - pool.base) >> SHIFT
                    assert (addr - pool.base) % (1 << SHIFT) == 0
                    assert 0 <= start and start + pages <= PAGES
                    for a, n in live.items():  # no overlap with any live allocation
                        s = (a - pool.base) >> SHIFT
                        assert start + pages <= s or s + n <= start
                    live[addr] = pages
            elif live:
                addr = sorted(live)[arg % len(live)]
                pool.free(addr)
                del live[addr]
            pool.check_consistency()
            stats = pool.statistics()
            assert stats.used_pages == sum(live.values())
            assert stats.free_pages == PAGES - stats.used_pages
            assert stats.allocations == len(live)
        for addr in list(live):
            pool.free(addr)
        pool.check_consistency()
        stats = pool.statistics()
        assert stats.used_pages == 0 and stats.free_runs == 1 and stats.largest_free_run == PAGES
    finally:
        pool.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 4 << SHIFT), min_size=1, max_size=40))
def test_best_fit_never_refuses_when_a_run_fits(sizes):
    pool = PagePool(PAGES << SHIFT, SHIFT, HostBackend())
    try:
        addrs = []
        for n in sizes:
            try:
                addrs.append(pool.allocate(n))
            except LLMException:
                assert pool.statistics().largest_free_run < max(1, -(-n >> SHIFT))
            if len(addrs) > 3:
                pool.free(addrs.pop(1))
        pool.check_consistency()
    finally:
        pool.close()
