#!/usr/bin/env bash
# Issue 17 (4): the tcp data path before (memoryview slices per op, commit BEFORE) and after (numpy iovec
# arrays through sendmsg/recvmsg, this commit), interleaved: three pairs of `llmdd bench --quick
# --transport tcp --cprofile --seed 17`, before first then after, load recorded by the bench itself.
#   BEFORE_TREE=/tmp/h17_before bash bench/results-committed/issue17/run.sh   (BEFORE_TREE: `git archive` of BEFORE)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=bench/results-committed/issue17
for i in 1 2 3; do
  for side in before after; do
    tree=$([ "$side" = before ] && echo "$BEFORE_TREE" || pwd)
    source /work/wtenv.sh "$tree"
    (cd "$tree" && $PY -m llmdd bench --quick --transport tcp --cprofile --seed 17 --quiet \
        --out "$OLDPWD/$OUT/$side-$i") > "$OUT/$side-$i.txt" 2>&1
  done
done
