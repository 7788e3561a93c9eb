#!/bin/bash
# interleaved: threads=1 (t1) vs threads=2 with 4 parts per thread from one queue (t2), same code otherwise
PY=/work/main/.venv/bin/python
pp() { local WT=$1; local P="$WT"; for d in "$WT"/plugins/*/src; do P="$P:$d"; done; echo "$P"; }
for i in 1 2 3; do
  for which in t1 t2; do
    WT=/tmp/ucx2-$which
    echo "$which $i start $(date -u +%T) $(uptime)"
    (cd $WT && PYTHONPATH=$(pp $WT) $PY -m llmdd bench --transport ucx --quiet --out /tmp/ucx2-runs2/$which-$i > /tmp/ucx2-runs2/$which-$i.log 2>&1)
    echo "$which $i end $(date -u +%T) rc=$? $(uptime)"
  done
done
