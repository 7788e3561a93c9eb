#!/usr/bin/env bash
# tcp spin budget (llmdd.tcp.spin_us, both sides) with the C hot path: `llmdd bench --quick --transport tcp`
# with 50, 150 and 400 us, two interleaved rounds, each run's results kept (rN-SPIN/results.json, rN-SPIN.txt).
#   cd /work/main && bash bench/results-committed/issue21/tcp-spin-budget/ab.sh   (made at ca955b4)
set -eu
D=$(cd "$(dirname "$0")" && pwd)
for r in 1 2; do
  for sp in 50 150 400; do
    .venv/bin/python -m llmdd bench --quick --transport tcp --option llmdd.tcp.spin_us=$sp --out "$D/r$r-$sp" --quiet \
      > "$D/r$r-$sp.txt" 2>&1
    echo "r$r spin=$sp $(grep -E 'one 64 KiB block (pull|push)_blocks, p50|request/reply 64 KiB, p50|raw tcp push' \
      "$D/r$r-$sp.txt" | sed 's/  */ /g' | tr '\n' '|')"
  done
done
