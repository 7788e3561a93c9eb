#!/usr/bin/env bash
# three full runs (bench, then its peers) of main at 84436c8 after the session's merges, from a clean
# export (git archive 84436c8 into /tmp/bench_main, the shm extension built there), as runs 4-6 were made
cd /tmp/bench_main
PY=/work/main/.venv/bin/python
PP=/tmp/bench_main:$(ls -d /tmp/bench_main/plugins/*/src | tr '\n' ':')
export PYTHONPATH=$PP LLMDD_PY=$PY LLMDD_PYTHONPATH=$PP
OUT=/work/main/bench/results-committed/issue22
for i in 7 8 9; do
  echo "== run-$i $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
  $PY -m llmdd bench --out $OUT/run-$i
  bash bench/run_peers.sh $OUT/run-$i
  echo "== run-$i done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
