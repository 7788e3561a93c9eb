#!/usr/bin/env bash
# Issue 37 A/B of the one-block latency (bench/probes/latency_path.py; bench/latency_path.py in trees
# before the probes moved, as both trees of the committed runs), interleaved A B A B A B.
# A = main at the branch point (7f36c45) in a second worktree, B = branch prepare; each run measures
# shm, tcp and ucx, one 64 KiB block per pull_blocks and per push_blocks call, --n 3000 calls.
# Usage: run.sh A_WORKTREE B_WORKTREE OUT_DIR
set -u
A=$1; B=$2; OUT=$3
mkdir -p "$OUT"
for i in 1 2 3; do
  for side in A B; do
    tree=$A; [ "$side" = B ] && tree=$B
    name="$side$i"
    { date -u +%FT%TZ; uptime; } > "$OUT/$name.load-before"
    script=bench/probes/latency_path.py; [ -f "$tree/$script" ] || script=bench/latency_path.py
    (cd "$tree" && timeout 900 .venv/bin/python "$script" --transport shm --transport tcp \
        --transport ucx --push --n 3000 --json "$OUT/$name.json") > "$OUT/$name.out" 2>&1
    echo "rc=$?" >> "$OUT/$name.out"
    { date -u +%FT%TZ; uptime; } > "$OUT/$name.load-after"
  done
done
