#!/usr/bin/env bash
# Install llmdd and its built-in transport plugins into .venv, then run `llmdd demo`
# (extra arguments are passed to it, e.g. `bash scripts/demo.sh --mode push`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
plugins=()
for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p"); done
.venv/bin/python -m pip install -q -e . "${plugins[@]}"
exec .venv/bin/llmdd demo "$@"
