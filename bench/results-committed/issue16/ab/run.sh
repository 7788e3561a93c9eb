#!/usr/bin/env bash
# Issue 16 A/B (point 7): 4373b8f (before the house-I refactor) vs 4e43e41 (states in the tables,
# llmdd/_control split, the layer packages, EngineCore, doctor package), each a clean `git archive`
# with the shm extension built from its own source; interleaved; latency path + llmdd bench --quick.
#   git archive <commit> | tar -x -C /tmp/h16_<tree>; (cd plugins/llmdd-transport-shm && python setup.py build_ext --inplace)
set -u
OUT=${1:-/tmp/h16_out}; mkdir -p $OUT; cd /tmp
for i in 1 2 3; do for w in before after; do
  d=/tmp/h16_$w; PP=$d:$(ls -d $d/plugins/*/src | tr '\n' ':')
  echo "$(date -u +%H:%M:%S) $w $i load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/log.txt
  PYTHONPATH=$PP timeout 600 /work/main/.venv/bin/python $d/bench/latency_path.py --transport shm --transport tcp --bulk --runs 3 --n 500 --json $OUT/lat_${w}_$i.json >> $OUT/log.txt 2>&1
  PYTHONPATH=$PP timeout 900 /work/main/.venv/bin/llmdd bench --quick --transport tcp --transport shm --quiet --out $OUT/quick_${w}_$i >> $OUT/log.txt 2>&1
done; done
echo done >> $OUT/log.txt
