#!/usr/bin/env bash
# Issue 16 point 7, final A/B: `llmdd bench --quick --transport tcp --transport shm` of the tree before the
# house-I work (4373b8f) and of main after it (dc995d3: layers, EngineCore, states in the tables, the
# link manager and transfer engine split, the runtime seam; with issue 17's seam and data path), each a
# clean `git archive` in /tmp/h16_<tree> with its own shm extension built, run with main's .venv and
# PYTHONPATH=<tree>:<tree>/plugins/*/src, in ABBA order (before after after before before after) so
# that a load drift falls on both trees alike.  Reports: llmdd bench --report <the three runs> --markdown.
set -u
OUT=${1:?out dir}; mkdir -p "$OUT"; cd /tmp
i=${START:-0}
for w in ${TREES:-before after after before before after}; do
  i=$((i + 1))
  d=/tmp/h16_$w; PP=$d:$(ls -d $d/plugins/*/src | tr '\n' ':')
  echo "$(date -u +%H:%M:%S) $w slot $i load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log.txt"
  PYTHONPATH=$PP timeout 900 /work/main/.venv/bin/llmdd bench --quick --transport tcp --transport shm --quiet \
      --out "$OUT/quick_${w}_$i" >> "$OUT/log.txt" 2>&1
done
echo "$(date -u +%H:%M:%S) done load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/log.txt"
