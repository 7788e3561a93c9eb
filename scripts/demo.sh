#!/usr/bin/env bash
# Install llmdd's runtime set into .venv (llmdd, its plugin distributions, matplotlib for the bench
# plots, NIXL for the ucx transport; see scripts/_venv.sh: the same set scripts/test.sh installs,
# skipped when current), then run `llmdd demo` (extra arguments are passed to it, e.g.
# `bash scripts/demo.sh --mode push`).  Afterwards the command is .venv/bin/llmdd, or `llmdd` once
# the venv is activated (`. .venv/bin/activate`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
. scripts/_venv.sh
llmdd_venv bench
echo "demo.sh: running llmdd demo (it prints each step as it goes; Ctrl-C stops it)"
exec .venv/bin/llmdd demo "$@"
