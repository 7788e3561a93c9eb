#!/usr/bin/env bash
# Issue 37 A/B of the C++ row of llmdd bench (PullKvBlocks one 64 KiB block p50, C++ vs Python
# decoder), interleaved A B A B A B; each side's library built from its own tree (cpp/build: the
# bridge's text is compiled in).  Usage: run.sh A_WORKTREE B_WORKTREE OUT_DIR
set -u
A=$1; B=$2; OUT=$3
mkdir -p "$OUT"
for i in 1 2 3; do
  for side in A B; do
    tree=$A; [ "$side" = B ] && tree=$B
    name="$side$i"
    # LLMDD_CPP_BUILD: the row looks for cpp/build under llmdd/ (one directory too deep) without it
    (cd "$tree" && LLMDD_CPP_BUILD="$tree/cpp/build" timeout 600 .venv/bin/python -m llmdd._tools.bench.cpp row --quick \
        --out "$OUT/$name.json") \
        > "$OUT/$name.out" 2>&1
    echo "rc=$?" >> "$OUT/$name.out"
  done
done
