#!/usr/bin/env bash
# Issue 16 A/B, second round: llmdd bench --quick (tcp, shm) of the two trees of run.sh in ABBA order
# (before after after before before after), so that a load drift falls on both trees alike.
set -u
OUT=${1:-/tmp/h16_out}; mkdir -p $OUT; cd /tmp
i=0
for w in before after after before before after; do
  i=$((i + 1))
  d=/tmp/h16_$w; PP=$d:$(ls -d $d/plugins/*/src | tr '\n' ':')
  echo "$(date -u +%H:%M:%S) $w slot $i load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/log3.txt
  PYTHONPATH=$PP timeout 900 /work/main/.venv/bin/llmdd bench --quick --transport tcp --transport shm --quiet --out $OUT/abba_${w}_$i >> $OUT/log3.txt 2>&1
done
echo done >> $OUT/log3.txt
