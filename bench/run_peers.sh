#!/usr/bin/env bash
# Run the NIXL and Mooncake anchors of ../shared/bench right after `llmdd bench`, on the same
# machine, and merge them into that run's results.json (ratios and targets against the peers).
#
# Usage: bench/run_peers.sh [RESULTS_DIR]
#   RESULTS_DIR   the `llmdd bench --out` directory (default: the newest bench/results/*/)
# Environment:
#   PEERS_VENV    venv for the peers (default bench/results/.peers-venv, git-ignored; never the llmdd venv)
#   SHARED_BENCH  the anchor scripts (default ../shared/bench)
#   LLMDD_PY      python of the llmdd venv (default .venv/bin/python)
#   INSTALL_TIMEOUT, RUN_TIMEOUT  seconds per install / per anchor script (600 / 420)
#
# Installs (as ../shared/bench/README.md says): NIXL torch-free with
#   pip install numpy && pip install --no-deps nixl-cu12
# and Mooncake's non-CUDA build plus libibverbs1 from apt:
#   pip install mooncake-transfer-engine-non-cuda && apt-get install -y libibverbs1
# A failed install or run is recorded in RESULTS_DIR/peers/status.txt and the other peer still runs.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SHARED_BENCH="${SHARED_BENCH:-$ROOT/../shared/bench}"
PEERS_VENV="${PEERS_VENV:-$ROOT/bench/results/.peers-venv}"
LLMDD_PY="${LLMDD_PY:-$ROOT/.venv/bin/python}"
INSTALL_TIMEOUT="${INSTALL_TIMEOUT:-600}"
RUN_TIMEOUT="${RUN_TIMEOUT:-420}"

RESULTS="${1:-}"
if [ -z "$RESULTS" ]; then
  RESULTS="$(ls -d "$ROOT"/bench/results/*/ 2>/dev/null | sort | tail -n 1)"
fi
RESULTS="${RESULTS%/}"
if [ ! -f "$RESULTS/results.json" ]; then
  echo "run_peers.sh: no results.json in '$RESULTS' (run 'llmdd bench' first)" >&2
  exit 2
fi
RESULTS="$(cd "$RESULTS" && pwd)"  # absolute: the anchors run from $SHARED_BENCH
if [ ! -d "$SHARED_BENCH" ]; then
  echo "run_peers.sh: anchor scripts not found at $SHARED_BENCH (set SHARED_BENCH)" >&2
  exit 2
fi
OUT="$RESULTS/peers"
mkdir -p "$OUT"
STATUS="$OUT/status.txt"
: > "$STATUS"
note() { echo "$*" | tee -a "$STATUS"; }

note "run_peers.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -x "$PEERS_VENV/bin/python" ]; then
  python3 -m venv "$PEERS_VENV" || { note "venv: python3 -m venv $PEERS_VENV failed"; exit 1; }
fi
PY="$PEERS_VENV/bin/python"
PIP="$PEERS_VENV/bin/pip"

t0=$(date +%s)
nixl_ok=0
if timeout "$INSTALL_TIMEOUT" "$PIP" install -q numpy >>"$OUT/install.log" 2>&1 \
   && timeout "$INSTALL_TIMEOUT" "$PIP" install -q --no-deps nixl-cu12 >>"$OUT/install.log" 2>&1 \
   && "$PY" -c "import nixl_cu12" >>"$OUT/install.log" 2>&1; then
  nixl_ok=1
  note "nixl: installed ($("$PIP" show nixl-cu12 2>/dev/null | grep ^Version), $(( $(date +%s) - t0 )) s)"
else
  note "nixl: install failed, see $OUT/install.log"
fi

t1=$(date +%s)
mooncake_ok=0
if timeout "$INSTALL_TIMEOUT" "$PIP" install -q mooncake-transfer-engine-non-cuda >>"$OUT/install.log" 2>&1; then
  if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    (timeout "$INSTALL_TIMEOUT" apt-get update -q && timeout "$INSTALL_TIMEOUT" apt-get install -y -q libibverbs1) \
      >>"$OUT/install.log" 2>&1 || note "mooncake: apt-get install libibverbs1 failed"
  fi
  if "$PY" -c "import mooncake.engine" >>"$OUT/install.log" 2>&1; then
    mooncake_ok=1
    note "mooncake: installed ($("$PIP" show mooncake-transfer-engine-non-cuda 2>/dev/null | grep ^Version), $(( $(date +%s) - t1 )) s)"
  else
    note "mooncake: installed but 'import mooncake.engine' fails, see $OUT/install.log"
  fi
else
  note "mooncake: pip install mooncake-transfer-engine-non-cuda failed, see $OUT/install.log"
fi

export ANCHORS_RESULTS_DIR="$OUT"
run() {
  local name="$1"; shift
  echo "== $name: $*"
  (cd "$SHARED_BENCH" && timeout "$RUN_TIMEOUT" "$PY" "$@") 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  note "$name: rc=$rc"
}
[ "$nixl_ok" = 1 ] && run nixl anchors_nixl.py --runs 5
[ "$mooncake_ok" = 1 ] && run mooncake anchors_mooncake.py --runs 5
note "finished $(date -u +%Y-%m-%dT%H:%M:%SZ) load $(cut -d' ' -f1-3 /proc/loadavg)"

"$LLMDD_PY" -m llmdd bench --report "$RESULTS/results.json" --peers "$OUT"
