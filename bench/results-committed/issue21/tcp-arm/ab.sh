#!/usr/bin/env bash
# A/B of two commits with bench/tcp_quick_micro.py (the tcp one-call path without the engine, the raw
# request/reply in the same run): each commit exported with git archive, then three interleaved rounds.
#   bash bench/results-committed/issue21/tcp-arm/ab.sh BEFORE AFTER > bench/results-committed/issue21/tcp-arm/ab.log
set -eu
PY=${PY:-/work/main/.venv/bin/python}
for c in "$1" "$2"; do
  rm -rf "/tmp/ab-$c" && mkdir -p "/tmp/ab-$c" && git archive "$c" | tar -x -C "/tmp/ab-$c"
done
for i in 1 2 3; do
  for c in "$1" "$2"; do
    PP=/tmp/ab-$c:$(ls -d /tmp/ab-$c/plugins/*/src | tr '\n' ':')
    echo "== round $i commit $c $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd "/tmp/ab-$c" && PYTHONPATH=$PP $PY bench/tcp_quick_micro.py --n 4000)
  done
done
