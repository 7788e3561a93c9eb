#!/bin/bash
OUT=/work/wt-tcp/bench/results-committed/issue21/tcp-quick-20261202T1210Z
COMMIT=$(cd /work/wt-tcp && git rev-parse --short HEAD)
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then T=/tmp/base-tcp; else T=/work/wt-tcp; fi
    source /work/wtenv.sh $T
    echo "== run $i $side ($T) $(date -u +%H:%M:%S) uptime: $(uptime)" >> $OUT/latency_path.txt
    timeout 300 $PY bench/latency_path.py --transport tcp --n 2000 --kv-mib 64 >> $OUT/latency_path.txt 2>&1
    echo "== run $i $side ($T) $(date -u +%H:%M:%S) uptime: $(uptime)" >> $OUT/small_latency.txt
    timeout 300 $PY /work/wt-tcp/bench/small_latency.py --transport tcp --n 2000 --kv-mib 64 --json $OUT/small_latency-$side-$i.json >> $OUT/small_latency.txt 2>&1
  done
done
echo done >> $OUT/latency_path.txt
