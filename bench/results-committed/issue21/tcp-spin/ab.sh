#!/usr/bin/env bash
# tcp spinning (llmdd.tcp.spin_us) A/B: end-to-end one-block pull_blocks / push_blocks with the raw Python
# request/reply measured in the same run (bench/small_latency.py), and `llmdd bench --quick --transport tcp`
# (its latency rows against its anchors), spin 0 and 50 interleaved, three rounds; then the C wake-up probe (bench/rr_wakeup.c) on both cores and on one.  Run from the
# repository root with the venv's python: bash bench/results-committed/issue21/tcp-spin/ab.sh TAG
set -eu
TAG=${1:?tag}
OUT=bench/results-committed/issue21/tcp-spin/$TAG
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for i in 1 2 3; do
  for spin in 0 50; do
    echo "== round $i spin_us=$spin $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
    $PY bench/small_latency.py --n 2000 --option llmdd.tcp.spin_us=$spin --json "$OUT/spin$spin-run$i.json"
    $PY -m llmdd bench --quiet --quick --transport tcp --option llmdd.tcp.spin_us=$spin --out "$OUT/bench-spin$spin-run$i" \
      | grep -E "one 64 KiB block|engine options"
  done
done
gcc -O2 -o /tmp/rr_wakeup bench/rr_wakeup.c
for mode in block client both yield; do
  echo "== rr_wakeup $mode, both cores: $(/tmp/rr_wakeup 3000 $mode)"
  echo "== rr_wakeup $mode, one core:   $(taskset -c 0 /tmp/rr_wakeup 3000 $mode)"
done
