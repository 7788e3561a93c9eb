#!/bin/bash
# interleaved before (main c942258 sources) / after (hucx) runs of latency_path --push + raw NIXL
OUT=$1; mkdir -p $OUT
PY=/work/main/.venv/bin/python
BENCH=/work/wt-ucx/bench/latency_path.py
for i in 1 2 3; do
  for side in base after; do
    if [ $side = base ]; then src=/tmp/hucx/base; else src=/work/wt-ucx; fi
    PP="$src"; for d in "$src"/plugins/*/src; do PP="$PP:$d"; done
    echo "== $side run $i $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $src && PYTHONPATH=$PP $PY $BENCH --transport ucx --n 2000 --kv-mib 64 --push --json $OUT/$side-$i.json 2>&1 | grep -v "^anchors")
    (cd /work/wt-ucx && PYTHONPATH=$PP UCX_MODULES=^ib timeout 300 $PY bench/peers/nixl_peer.py --out $OUT/nixl-$side-$i --runs 1 --gib 0.0625 2>&1 | grep "one 64 KiB")
  done
done
