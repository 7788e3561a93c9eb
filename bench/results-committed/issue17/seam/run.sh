#!/usr/bin/env bash
# Issue 17 point 1 (the narrow seam): the shm Channel.read/write p50 against the bare process_vm_readv/writev
# of the same iovecs (a same-run ratio), on this branch (hseam) and on main (fec15a9), back to back, 2 cores
# shared with other engineers' tests (load recorded in each .txt). The seam change on this path is one
# try/except around _submit (refusals become the completion's error); no verdict is typed here.
set -euo pipefail
cd /work/wt-seam && source /work/wtenv.sh /work/wt-seam
$PY bench/shm_seam_latency.py --out bench/results-committed/issue17/seam/hseam-1 > bench/results-committed/issue17/seam/hseam-1.txt 2>&1
cd /work/main && source /work/wtenv.sh /work/main
$PY bench/shm_seam_latency.py --out /work/wt-seam/bench/results-committed/issue17/seam/main-1 > /work/wt-seam/bench/results-committed/issue17/seam/main-1.txt 2>&1
cd /work/wt-seam && source /work/wtenv.sh /work/wt-seam
$PY bench/shm_seam_latency.py --out bench/results-committed/issue17/seam/hseam-2 > bench/results-committed/issue17/seam/hseam-2.txt 2>&1
