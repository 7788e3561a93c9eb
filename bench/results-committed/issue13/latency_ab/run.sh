#!/usr/bin/env bash
# usage: run.sh OUTDIR PAIRS tree1 tree2 ...   (trees are /tmp/ab_<name>)
set -u
OUT=$1; N=$2; shift 2; mkdir -p $OUT; cd /tmp
for i in $(seq 1 $N); do for w in "$@"; do
  d=/tmp/ab_$w; PP=$d:$(ls -d $d/plugins/*/src | tr '\n' ':')
  echo "$(date -u +%H:%M:%S) $w $i load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/log.txt
  PYTHONPATH=$PP timeout 600 /work/main/.venv/bin/python $d/bench/latency_path.py --transport tcp --runs 3 --n 500 --json $OUT/${w}_$i.json >> $OUT/log.txt 2>&1
done; done
echo done >> $OUT/log.txt
