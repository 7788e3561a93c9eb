#!/usr/bin/env bash
# Install llmdd's runtime set (scripts/_venv.sh: the same set scripts/demo.sh installs, skipped when
# current) and the test tools on top into .venv, then run the test suite (every test has a
# pytest-timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the shm and tcp plugins' C hot paths (llmdd_shm._shmfast, llmdd_tcp._tcpfast) need a C compiler and
# Python.h; install them when missing (Debian/Ubuntu images: gcc + python3-dev), else the plugins build
# without them and their tests/test_native.py fail the run (LLMDD_REQUIRE_NATIVE=1 below)
inc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if { ! command -v gcc >/dev/null || [ ! -f "$inc/Python.h" ]; } && command -v apt-get >/dev/null \
    && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc python3-dev >/dev/null
fi
export LLMDD_REQUIRE_NATIVE=1
. scripts/_venv.sh
llmdd_venv bench,test
# torch CPU for the torch-registration test (optional for llmdd itself); the CPU build, where the
# package index serves it, so that no CUDA libraries come along; elsewhere that one test skips and says so
.venv/bin/python -c "import torch" 2>/dev/null || llmdd_step "installing torch 2.13.0+cpu (for the one torch-registration test): a ~190 MB download, about 850 MB installed with sympy and networkx; 1-3 minutes" \
    .venv/bin/python -m pip install -q 'torch==2.13.0+cpu' \
    || echo "test.sh: torch==2.13.0+cpu is not available from this package index; the torch test will skip"
echo "test.sh: running the test suite (pytest -m 'not slow'; 8-20 minutes on a 2-core machine, longer when it is busy)"
.venv/bin/python -m pytest -q -m "not slow" "$@"
