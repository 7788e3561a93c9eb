"""Issue 12: RSS a peer makes this side hold through CacheTableUpdate deltas, each adding one cache of
2^20 tensor addresses (one ~9 MB frame).  Before MAX_PEER_CACHE_ADDRS nothing bounded the total
(peer_cache_table_growth.txt); now each such update is refused (peer_cache_table_growth_after.txt).  Run:
.venv/bin/python bench/results-committed/issue12/peer_cache_table_growth_probe.py"""
import resource, os
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.codec import encode_frame
from llmdd._control.protocol.tables import DescriptorTables, TableUpdateError
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
t = DescriptorTables()
r0 = rss()
n = 1 << 20
for v in range(1, 6):
    addrs = tuple(range(2**40 + v * n, 2**40 + (v + 1) * n))
    c = m.CacheEntry(cache_id=v, addrs=addrs, tensor_size=1, shape=(1,))
    u = m.CacheTableUpdate(version=v, full=False, caches_added=(c,))
    if v == 1: print("frame bytes", len(encode_frame(u)))
    try:
        t.apply(u)
    except TableUpdateError as exc:   # the link carrying it fails
        print(v, "refused:", exc)
        u = m.CacheTableUpdate(version=v, full=False)   # keep the version sequence going
        t.apply(u)
    del addrs, c, u
    print(v, "RSS +%.0f MiB" % (rss() - r0))
