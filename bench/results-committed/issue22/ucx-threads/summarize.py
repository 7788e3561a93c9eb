"""Print the ucx rows of the interleaved runs in this directory (before-N.json / after-N.json):
64 KiB / 16 KiB pulls and their process_vm_readv anchors, pushes, pull_cache, latency p50 (us)."""
import glob
import json
import os
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
for f in sorted(glob.glob(os.path.join(here, "*-[0-9].json"))):
    r = json.load(open(f))
    t, a = r["transports"]["ucx"], r["anchors"]

    def m(k):
        return t[k]["median"]
    print(os.path.basename(f)[:-5], "pull64 %.2f cma64 %.2f ratio %.2f | pull16 %.2f cma16 %.2f ratio %.2f | "
          "push64 %.2f push16 %.2f cache %.2f | latency p50 %.1f us" % (
              m("pull_blocks_64k"), a["cma_64k"]["median"], m("pull_blocks_64k") / a["cma_64k"]["median"],
              m("pull_blocks_16k"), a["cma_16k"]["median"], m("pull_blocks_16k") / a["cma_16k"]["median"],
              m("push_blocks_64k"), m("push_blocks_16k"), m("pull_cache"), t["latency_64k"]["p50"]))
