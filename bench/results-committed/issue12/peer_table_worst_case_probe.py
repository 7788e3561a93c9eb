"""Issue 12: the most a linked peer can make this side hold in its tables, at every per-peer cap at once
(MAX_PEER_REGIONS with MAX_PEER_DESCRIPTOR_BYTES of descriptors, MAX_PEER_CACHES with MAX_PEER_CACHE_ADDRS
addresses, MAX_PEER_KEYS).  Run: .venv/bin/python bench/results-committed/issue12/peer_table_worst_case_probe.py"""
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.tables import (DescriptorTables, MAX_PEER_REGIONS, MAX_PEER_CACHES, MAX_PEER_KEYS,
    MAX_PEER_CACHE_ADDRS, MAX_PEER_DESCRIPTOR_BYTES)
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
t = DescriptorTables(); r0 = rss()
per = MAX_PEER_DESCRIPTOR_BYTES // MAX_PEER_REGIONS - 16      # bytes of descriptor per region, filling the budget
regions = tuple(m.RegionDescriptor(region_id=i, cache_id=-1, addr=2**40 + i * 4096, size=4096,
                                   transports=(m.TransportDescriptor(transport="x", payload=b"d" * per),)) for i in range(MAX_PEER_REGIONS))
t.apply(m.RegionsUpdate(version=1, full=True, added=regions)); del regions
print("regions", MAX_PEER_REGIONS, "descriptor bytes each", per, "RSS +%.0f MiB" % (rss() - r0))
per_cache = MAX_PEER_CACHE_ADDRS // MAX_PEER_CACHES
caches = tuple(m.CacheEntry(cache_id=c, addrs=tuple(2**40 + (c * per_cache + j) * 4096 for j in range(per_cache)),
                            tensor_size=4096, shape=(1,)) for c in range(MAX_PEER_CACHES))
keys = tuple(m.KeyEntry(key=m.KeyRef.for_req(k, 0), cache_id=k % MAX_PEER_CACHES) for k in range(MAX_PEER_KEYS))
t.apply(m.CacheTableUpdate(version=1, full=True, caches_added=caches, keys_added=keys)); del caches, keys
print("caches", MAX_PEER_CACHES, "addrs", MAX_PEER_CACHE_ADDRS, "keys", MAX_PEER_KEYS, "RSS +%.0f MiB" % (rss() - r0))
