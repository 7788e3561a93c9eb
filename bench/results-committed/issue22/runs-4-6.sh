#!/usr/bin/env bash
# three interleaved full runs (bench, then its peers), as run-1..3 were made
cd /work/wt-22
source /work/wtenv.sh /work/wt-22
export LLMDD_PY=$PY LLMDD_PYTHONPATH=$PYTHONPATH
for i in 4 5 6; do
  echo "== run-$i $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
  $PY -m llmdd bench --out bench/results-committed/issue22/run-$i
  bash bench/run_peers.sh bench/results-committed/issue22/run-$i
  echo "== run-$i done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
