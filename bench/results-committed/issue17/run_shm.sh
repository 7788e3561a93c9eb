#!/usr/bin/env bash
# Issue 17 (4), the shm plugin's pure-Python path (LLMDD_SHM_NATIVE=0).  BEFORE_TREE: `git archive` of 51dbb05
# (one ctypes.memmove per op), with this commit's bench/shm_mapped_path.py copied in.
#   BEFORE_TREE=/tmp/hb/before bash bench/results-committed/issue17/run_shm.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=bench/results-committed/issue17
P=$PWD/$OUT/shm-profile
source /work/wtenv.sh "$PWD"
# 1. profiles, before: llmdd bench (user memory: one process_vm_readv per chunk already) and the mapped path
LLMDD_SHM_NATIVE=0 $PY -m llmdd bench --quick --transport shm --cprofile --seed 17 --quiet --out $P/before > $P/before.txt 2>&1
(source /work/wtenv.sh "$BEFORE_TREE"; cd "$BEFORE_TREE" && LLMDD_SHM_NATIVE=0 $PY bench/shm_mapped_path.py --worker \
    --cprofile $P/profile_mapped_before.txt > $P/mapped_worker_before.json)
LLMDD_SHM_NATIVE=0 $PY bench/shm_mapped_path.py --worker --cprofile $P/profile_mapped_after.txt > $P/mapped_worker_after.json
# 2. the three copy methods, same run (loop / own-pid process_vm_readv / numpy gather)
$PY bench/shm_copy_micro.py > $OUT/shm_copy_micro.txt
# 3. before/after through Channel.read/write over pool memory, trees interleaved, 3 rounds each
#    (runs 1 and 2 were earlier thresholds of llmdd_shm._copy: 16 KiB / 16 ops, 8 KiB / 16 ops; run 3 is
#    this commit's 8 KiB / 32 ops with the one-length fast path)
$PY bench/shm_mapped_path.py --trees "$BEFORE_TREE" . --rounds 3 --out $OUT/shm-mapped-3 | tee $OUT/shm-mapped-3.txt
