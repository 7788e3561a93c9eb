#!/usr/bin/env bash
# Issue 17 (4): the tcp transport over TLS before (51dbb05: memoryview slices per op) and after (4f53ee4: staged
# with llmdd.lowlevel.copy_runs), interleaved: three pairs of `llmdd bench --quick --transport tcp+tls --seed 17`,
# before first then after, load recorded by the bench itself.
#   BEFORE_TREE=/tmp/hb/before [TAG=-2] bash bench/results-committed/issue17/run_tls.sh   (BEFORE_TREE: `git archive` of 51dbb05;
#   TAG names a later set of runs: the first set ran with the whole suite alongside, TAG=-2 quiet, at f950bf6)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=bench/results-committed/issue17
TAG=${TAG:-}
for i in 1 2 3; do
  for side in before after; do
    tree=$([ "$side" = before ] && echo "$BEFORE_TREE" || pwd)
    source /work/wtenv.sh "$tree"
    (cd "$tree" && $PY -m llmdd bench --quick --transport tcp+tls --seed 17 --quiet \
        --out "$OLDPWD/$OUT/tls$TAG-$side-$i") > "$OUT/tls$TAG-$side-$i.txt" 2>&1
  done
done
