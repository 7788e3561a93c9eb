#!/usr/bin/env bash
# Full runs (bench, then its peers) of main at COMMIT, one per run number given, from a clean export
# (git archive COMMIT into /tmp/bench_main, the shm and tcp extensions built there), as runs 10-18 were
# made (their own scripts, runs-N-M.sh, are kept beside); the peers' venv is bench/results/.peers-venv of
# /work/main (run_peers.sh installs it when missing).
#   bash bench/results-committed/issue22/runs.sh COMMIT 19 20 21 > bench/results-committed/issue22/runs-19-21.log 2>&1
set -eu
COMMIT=${1:?commit}
shift
echo "== runs.sh $COMMIT $*"
rm -rf /tmp/bench_main && mkdir -p /tmp/bench_main
git -C /work/main archive "$COMMIT" | tar -x -C /tmp/bench_main
PY=/work/main/.venv/bin/python
for p in shm tcp; do (cd /tmp/bench_main/plugins/llmdd-transport-$p && $PY setup.py -q build_ext --inplace >/dev/null); done
cd /tmp/bench_main
PP=/tmp/bench_main:$(ls -d /tmp/bench_main/plugins/*/src | tr '\n' ':')
export PYTHONPATH=$PP LLMDD_PY=$PY LLMDD_PYTHONPATH=$PP PEERS_VENV=/work/main/bench/results/.peers-venv
OUT=/work/main/bench/results-committed/issue22
for i in "$@"; do
  echo "== run-$i $COMMIT $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
  $PY -m llmdd bench --out $OUT/run-$i
  bash bench/run_peers.sh $OUT/run-$i
  echo "== run-$i done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
