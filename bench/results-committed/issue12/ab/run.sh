#!/usr/bin/env bash
# Issue 12 A/B: c000823 (before the hardening) vs 6349204 (bounded peer input, no upcalls under locks,
# crash leftovers, typed outcomes landed), interleaved; latency path + llmdd bench --quick.
set -u
OUT=${1:-/tmp/h12_out}; mkdir -p $OUT; cd /tmp
for i in 1 2 3; do for w in before after; do
  d=/tmp/h12_$w; PP=$d:$(ls -d $d/plugins/*/src | tr '\n' ':')
  echo "$(date -u +%H:%M:%S) $w $i load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/log.txt
  PYTHONPATH=$PP timeout 600 /work/main/.venv/bin/python $d/bench/latency_path.py --transport shm --transport tcp --bulk --runs 3 --n 500 --json $OUT/lat_${w}_$i.json >> $OUT/log.txt 2>&1
  PYTHONPATH=$PP timeout 900 /work/main/.venv/bin/llmdd bench --quick --transport tcp --transport shm --quiet --out $OUT/quick_${w}_$i >> $OUT/log.txt 2>&1
done; done
echo done >> $OUT/log.txt
