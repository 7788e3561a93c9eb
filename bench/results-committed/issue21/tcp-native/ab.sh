#!/usr/bin/env bash
# The tcp C hot path against the pure-Python one, same commit, same run: LLMDD_TCP_NATIVE=0 / 1 (both the
# client and the owner child inherit it) in three interleaved rounds of
#   bench/tcp_quick_micro.py   (the channel's one-call pull / push without the engine, raw request/reply beside)
#   bench/small_latency.py     (pull_blocks / push_blocks of one 64 KiB block through the engine, two processes)
# from a clean export of COMMIT with both extensions built there.
#   bash bench/results-committed/issue21/tcp-native/ab.sh COMMIT > bench/results-committed/issue21/tcp-native/ab.log
set -eu
COMMIT=${1:?commit}
PY=${PY:-/work/main/.venv/bin/python}
D=/tmp/ab-native-$COMMIT
rm -rf "$D" && mkdir -p "$D" && git -C /work/main archive "$COMMIT" | tar -x -C "$D"
for p in shm tcp; do (cd "$D/plugins/llmdd-transport-$p" && $PY setup.py -q build_ext --inplace >/dev/null); done
cd "$D"
export PYTHONPATH=$D:$(ls -d "$D"/plugins/*/src | tr '\n' ':')
for i in 1 2 3; do
  for v in 0 1; do
    echo "== round $i LLMDD_TCP_NATIVE=$v commit $COMMIT $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
    LLMDD_TCP_NATIVE=$v $PY bench/tcp_quick_micro.py --n 3000
    LLMDD_TCP_NATIVE=$v $PY bench/small_latency.py --transport tcp --n 2000
  done
done
