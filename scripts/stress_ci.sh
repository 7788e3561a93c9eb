#!/usr/bin/env bash
# Stress the README's test command (issue 41, point 2): run the default suite (`bash scripts/test.sh`)
# in a fresh clone of this repository's HEAD each time, QUIET times on the machine as it is and BUSY
# times with a CPU hog beside it (one `nice -n 0` busy loop per core, started before the run and
# killed after it), and log each run's outcome, pass/fail counts, duration and load to a log file.
# Exits non-zero if any run was red (or printed no pytest summary).
#
#   bash scripts/stress_ci.sh                        # 5 quiet + 5 busy runs, log: stress_ci.log
#   bash scripts/stress_ci.sh --quiet 0 --busy 1 --log /tmp/s.log -- tests/unit/test_typecheck.py
#
# Options:
#   --quiet N   runs without the hog (default 5)
#   --busy N    runs with the hog (default 5)
#   --log FILE  the log (default: stress_ci.log at the repository root; appended to)
#   --keep      keep each run's clone and its full output (default: removed; the output of a red run
#               is kept either way, its path is in the log)
#   -- ARGS     passed to scripts/test.sh, i.e. to pytest (a selection, to try the script quickly)
# Each clone installs its own .venv (scripts/test.sh), as a new user's clone would; only pip's own
# download cache is shared. The clone is of the committed HEAD: uncommitted changes are not tested.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
quiet=5 busy=5 log="$root/stress_ci.log" keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quiet) quiet=$2; shift 2 ;;
    --busy) busy=$2; shift 2 ;;
    --log) log=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --) shift; break ;;
    *) echo "stress_ci.sh: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
case "$quiet$busy" in *[!0-9]*) echo "stress_ci.sh: --quiet and --busy take a count" >&2; exit 2 ;; esac
commit=$(git -C "$root" rev-parse HEAD) || exit 2
cores=$(nproc)
work=$(mktemp -d "${TMPDIR:-/tmp}/llmdd-stress.XXXXXX")
hog_pids=()

stop_hog() {
  local pid
  for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  hog_pids=()
}
cleanup() {
  stop_hog
  [ -n "${sampler:-}" ] && kill "$sampler" 2>/dev/null
  if [ "$keep" = 0 ]; then rm -rf "$work/clone" "$work"/load*; rmdir "$work" 2>/dev/null; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { echo "$*" | tee -a "$log"; }

say "== stress_ci $(date -u +%FT%TZ) commit $commit host $(hostname) cores $cores: $quiet quiet + $busy busy runs" \
    "of 'bash scripts/test.sh $*'"
red=0 n=0
run_one() {   # $1: quiet|busy
  local mode=$1 dir out rc t0 t1 summary counts load0 load1 loadavg verdict
  shift
  n=$((n + 1))
  dir="$work/clone"
  rm -rf "$dir"
  if ! git clone -q --no-hardlinks "$root" "$dir" || ! git -C "$dir" checkout -q "$commit"; then
    say "run $n $mode: RED (could not clone $root at $commit)"; red=$((red + 1)); return
  fi
  if [ "$mode" = busy ]; then
    for _ in $(seq "$cores"); do nice -n 0 bash -c 'while :; do :; done' & hog_pids+=($!); done
  fi
  out="$work/run$n-$mode.out"
  : >"$work/load$n"
  ( while :; do cut -d' ' -f1 /proc/loadavg >>"$work/load$n"; sleep 15; done ) & sampler=$!
  load0=$(cut -d' ' -f1-3 /proc/loadavg)
  t0=$(date +%s)
  (cd "$dir" && bash scripts/test.sh "$@") >"$out" 2>&1
  rc=$?
  t1=$(date +%s)
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; sampler=
  stop_hog
  load1=$(cut -d' ' -f1-3 /proc/loadavg)
  loadavg=$(awk '{s += $1} END {if (NR) printf "%.1f", s / NR; else print "?"}' "$work/load$n")
  # pytest -q's last line: "1 failed, 3318 passed, 12 skipped, 3 warnings in 1126.12s (0:18:46)"
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)" "$out" | tail -n 1)
  counts=$(echo "$summary" | grep -oE "[0-9]+ (passed|failed|errors?|skipped|xfailed|xpassed)" | paste -sd' ' -)
  if [ "$rc" -eq 0 ] && [ -n "$summary" ]; then
    verdict=green
  else
    verdict=RED red=$((red + 1))
  fi
  say "run $n $mode: $verdict rc=$rc ${counts:-no pytest summary} duration=$((t1 - t0))s" \
      "load(1m) start=${load0%% *} mean=$loadavg end=${load1%% *}"
  if [ "$verdict" = RED ]; then
    grep -E "^(FAILED|ERROR) " "$out" | head -n 20 | sed 's/^/    /' | tee -a "$log"
    say "    full output: $out"
  elif [ "$keep" = 0 ]; then
    rm -f "$out"
  fi
}
for _ in $(seq "$quiet"); do run_one quiet "$@"; done
for _ in $(seq "$busy"); do run_one busy "$@"; done
say "== $((n - red)) of $n runs green ($quiet quiet, $busy busy) at $commit"
[ "$keep" = 1 ] && say "   clones and outputs kept under $work"
[ "$red" -eq 0 ]
