#!/bin/bash
# interleaved before/after: llmdd bench --transport ucx (full sizes)
PY=/work/main/.venv/bin/python
pp() { local WT=$1; local P="$WT"; for d in "$WT"/plugins/*/src; do P="$P:$d"; done; echo "$P"; }
for i in 1 2 3; do
  for which in before after; do
    if [ $which = before ]; then WT=/tmp/ucx2-before; else WT=/work/wt-ucx2; fi
    echo "$which $i start $(date -u +%T) $(uptime)"
    (cd $WT && PYTHONPATH=$(pp $WT) $PY -m llmdd bench --transport ucx --quiet --out /tmp/ucx2-runs/$which-$i > /tmp/ucx2-runs/$which-$i.log 2>&1)
    echo "$which $i end $(date -u +%T) rc=$? $(uptime)"
  done
done
