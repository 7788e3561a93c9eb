#!/usr/bin/env bash
# Issue 16 point 7, final A/B, tcp alone: `llmdd bench --quick --transport tcp` of the two trees of run.sh,
# 8 runs in ABBA order (before after after before before after after before).
set -u
OUT=${1:?out dir}; mkdir -p "$OUT"; cd /tmp
i=0
for w in before after after before before after after before; do
  i=$((i + 1))
  d=/tmp/h16_$w; PP=$d:$(ls -d $d/plugins/*/src | tr '\n' ':')
  echo "$(date -u +%H:%M:%S) tcp $w slot $i load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log_tcp.txt"
  PYTHONPATH=$PP timeout 600 /work/main/.venv/bin/llmdd bench --quick --transport tcp --quiet \
      --out "$OUT/tcp_${w}_$i" >> "$OUT/log_tcp.txt" 2>&1
done
echo "$(date -u +%H:%M:%S) done load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log_tcp.txt"
