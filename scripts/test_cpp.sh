#!/usr/bin/env bash
# Build and test llmdd's C++ API (cpp/, docs/cpp.md): configure against .venv's Python, build,
# run ctest (one-process API checks, C++/Python peer pairs, threads, an embedding host, exit
# without Finalize); then install the package, build examples/cpp against it with
# find_package(llm_datadist CONFIG), and run those programs as two processes on loopback.
# Needs cmake and a C++17 compiler; installs llmdd into .venv when it is not there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
BUILD=${LLMDD_CPP_BUILD:-cpp/build}
if ! .venv/bin/python -c "import llmdd" 2>/dev/null; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  plugins=()
  for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && plugins+=(-e "$p"); done
  . scripts/_venv.sh   # llmdd_step, NIXL_PIN
  llmdd_step "installing llmdd and its plugins into .venv (editable): about 100 MB, about a minute" \
    .venv/bin/python -m pip install -q -e . "${plugins[@]}"
  llmdd_step "installing NIXL ($NIXL_PIN, --no-deps) for the ucx transport: about 220 MB, 15-60 s" \
    .venv/bin/python -m pip install -q --no-deps "$NIXL_PIN"
fi
echo "== C++ API: configure and build ($BUILD; about 40 s from an empty build directory on 2 cores)"
cmake -S cpp -B "$BUILD" -DLLMDD_PYTHON="$PWD/.venv/bin/python" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD" -j "$JOBS"
echo "== C++ API: ctest (about 15 s on a quiet machine, a few minutes on a busy one)"
ctest --test-dir "$BUILD" --output-on-failure --timeout 120
echo "== C++ API: install, then the examples built against the installed package"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$BUILD" --prefix "$work/install" >/dev/null
cmake -S examples/cpp -B "$work/examples" -DCMAKE_PREFIX_PATH="$work/install" >/dev/null
cmake --build "$work/examples" -j "$JOBS"
.venv/bin/python cpp/tests/run_case.py --bin "$work/examples" cpp_cpp
.venv/bin/python cpp/tests/run_case.py --bin "$work/examples" cpp_prompt_py_decoder
echo "== C++ API: all passed"
