"""Issue 12: CPU time of applying one peer RegionsUpdate snapshot of MAX_PEER_REGIONS regions,
addresses ascending vs descending (the owner-side DescriptorTables).  Run:
.venv/bin/python bench/results-committed/issue12/region_index_probe.py"""
import time
from llmdd._control.protocol import messages as m
from llmdd._control.protocol.codec import encode_frame
from llmdd._control.protocol.tables import DescriptorTables, MAX_PEER_REGIONS
n = MAX_PEER_REGIONS
for order in ("asc", "desc"):
    addrs = range(n) if order == "asc" else range(n, 0, -1)
    regs = tuple(m.RegionDescriptor(region_id=i, cache_id=-1, addr=a * 4096, size=4096) for i, a in enumerate(addrs))
    u = m.RegionsUpdate(version=1, full=True, added=regs)
    print(order, "frame bytes", len(encode_frame(u, max_frame_size=2**32-1)))
    t = DescriptorTables()
    t0 = time.process_time(); t.apply(u); print(order, "apply cpu s", round(time.process_time() - t0, 3))
