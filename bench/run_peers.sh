#!/usr/bin/env bash
# Measure the peers (NIXL over UCX, Mooncake over TCP) with bench/peers/*.py on this machine right
# after an `llmdd bench` run, and merge them into that run's results.json (ratios and targets
# against the peers: `llmdd bench --report RESULTS/results.json --peers RESULTS/peers`).
#
# Usage: bench/run_peers.sh [RESULTS_DIR]
#   RESULTS_DIR   an `llmdd bench --out` directory (default: the newest llmdd-bench-results/*/ or bench/results/*/)
# Environment:
#   PEERS_VENV    venv for the peers (default bench/results/.peers-venv, git-ignored; never the llmdd venv)
#   LLMDD_PY      python of the llmdd venv (default .venv/bin/python); LLMDD_PYTHONPATH its PYTHONPATH, if any
#   PEER_RUNS     timed runs per workload (default 5); PEER_GIB buffer per side in GiB (default 1)
#   INSTALL_TIMEOUT, RUN_TIMEOUT  seconds per install / per peer script (600 / 420)
#
# Installs, into PEERS_VENV, only what is missing:
#   NIXL:     pip install numpy && pip install --no-deps nixl-cu12==1.5.1   (as scripts/test.sh, torch-free)
#   Mooncake: pip install mooncake-transfer-engine; where that (CUDA) build cannot be imported
#             (no libcudart), pip install mooncake-transfer-engine-non-cuda instead; both need
#             libibverbs.so.1 (apt-get install -y libibverbs1, tried when missing and apt-get is usable).
# Whatever fails is written to RESULTS_DIR/peers/status.txt (and shows in the report); the other peer still runs.
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS_VENV="${PEERS_VENV:-$ROOT/bench/results/.peers-venv}"
LLMDD_PY="${LLMDD_PY:-$ROOT/.venv/bin/python}"
PEER_RUNS="${PEER_RUNS:-5}"
PEER_GIB="${PEER_GIB:-1}"
INSTALL_TIMEOUT="${INSTALL_TIMEOUT:-600}"
RUN_TIMEOUT="${RUN_TIMEOUT:-420}"

RESULTS="${1:-}"
if [ -z "$RESULTS" ]; then
  RESULTS="$(ls -td "$ROOT"/llmdd-bench-results/*/ "$ROOT"/bench/results/*/ 2>/dev/null | head -n 1)"
fi
RESULTS="${RESULTS%/}"
if [ -z "$RESULTS" ] || [ ! -f "$RESULTS/results.json" ]; then
  echo "run_peers.sh: no results.json in '${RESULTS:-bench/results/*}' (run 'llmdd bench --out DIR' first)" >&2
  exit 2
fi
RESULTS="$(cd "$RESULTS" && pwd)"
OUT="$RESULTS/peers"
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
STATUS="$OUT/status.txt"
: > "$STATUS"
: > "$OUT/install.log"
note() { echo "$*" | tee -a "$STATUS"; }

note "run_peers.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -x "$PEERS_VENV/bin/python" ]; then
  python3 -m venv "$PEERS_VENV" >>"$OUT/install.log" 2>&1 || { note "venv: python3 -m venv $PEERS_VENV failed"; exit 1; }
fi
PY="$PEERS_VENV/bin/python"
unset PYTHONPATH PYTHONHOME  # the peers' venv sees numpy and the peer's wheel only; LLMDD_PY keeps its own environment
pipi() { timeout "$INSTALL_TIMEOUT" "$PY" -m pip install -q --disable-pip-version-check "$@" >>"$OUT/install.log" 2>&1; }
has() { "$PY" -c "import $1" >>"$OUT/install.log" 2>&1; }
version() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }

nixl_ok=0
if has nixl_cu12 || { pipi numpy && pipi --no-deps 'nixl-cu12==1.5.1' && has nixl_cu12; }; then
  nixl_ok=1
  note "nixl: nixl-cu12 $(version nixl-cu12)"
else
  note "nixl: install failed (pip install --no-deps nixl-cu12==1.5.1), see peers/install.log"
fi

ensure_ibverbs() {
  ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { timeout "$INSTALL_TIMEOUT" apt-get update -q && timeout "$INSTALL_TIMEOUT" apt-get install -y -q libibverbs1; } \
      >>"$OUT/install.log" 2>&1 && return 0
  fi
  note "mooncake: libibverbs.so.1 missing and apt-get install libibverbs1 not possible here"
  return 1
}
mooncake_ok=0
if has mooncake.engine; then
  mooncake_ok=1
else
  pipi numpy
  if pipi mooncake-transfer-engine; then
    ensure_ibverbs
    if has mooncake.engine; then
      mooncake_ok=1
    else
      why="$("$PY" -c 'import mooncake.engine' 2>&1 | tail -n 1)"
      note "mooncake: pip install mooncake-transfer-engine installed, but it does not import here: $why"
      "$PY" -m pip uninstall -y -q mooncake-transfer-engine >>"$OUT/install.log" 2>&1
    fi
  else
    note "mooncake: pip install mooncake-transfer-engine failed, see peers/install.log"
  fi
  if [ "$mooncake_ok" = 0 ]; then
    if pipi mooncake-transfer-engine-non-cuda && ensure_ibverbs && has mooncake.engine; then
      mooncake_ok=1
    else
      note "mooncake: unavailable (mooncake-transfer-engine-non-cuda did not install or import either), see peers/install.log"
    fi
  fi
fi
if [ "$mooncake_ok" = 1 ]; then
  v="$(version mooncake-transfer-engine)"
  [ -n "$v" ] && note "mooncake: mooncake-transfer-engine $v" \
              || note "mooncake: mooncake-transfer-engine-non-cuda $(version mooncake-transfer-engine-non-cuda) (the CUDA build does not import here)"
fi

run() {
  local name="$1"; shift
  echo "== $name: $*"
  timeout "$RUN_TIMEOUT" "$PY" "$@" --out "$OUT" --runs "$PEER_RUNS" --gib "$PEER_GIB" 2>&1 | tee "$OUT/$name.log"
  note "$name: rc=${PIPESTATUS[0]}"
}
[ "$nixl_ok" = 1 ] && run nixl "$ROOT/bench/peers/nixl_peer.py"
[ "$mooncake_ok" = 1 ] && run mooncake "$ROOT/bench/peers/mooncake_peer.py"
note "finished $(date -u +%Y-%m-%dT%H:%M:%SZ) load $(cut -d' ' -f1-3 /proc/loadavg)"

env ${LLMDD_PYTHONPATH:+PYTHONPATH="$LLMDD_PYTHONPATH"} "$LLMDD_PY" -m llmdd bench --report "$RESULTS/results.json" \
  --peers "$OUT"
