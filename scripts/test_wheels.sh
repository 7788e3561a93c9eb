#!/usr/bin/env bash
# Install llmdd as a release is installed and use it:  bash scripts/test_wheels.sh [WHEEL_DIR]
#
# Builds every distribution's wheel into one directory (scripts/build_wheels.sh; or uses
# WHEEL_DIR), then in a fresh venv outside the repository, from a working directory outside it (so
# the source tree cannot be imported by accident):
#   0. every wheel is pure or manylinux-tagged (what a package index accepts);
#   1. pip install --find-links DIR llmdd        -> llmdd with the shm and tcp transports;
#      `llmdd --version`, `llmdd doctor`, `llmdd demo --quick` and a two-process pull must pass;
#   2. pip install --find-links DIR "llmdd[all]" -> + ucx (the plugin; NIXL itself is not pulled in:
#      its wheel requires torch and CUDA), metrics, faults, matplotlib; the same again, plus
#      `llmdd bench`'s plots library; and "llmdd[vllm]" when plugins/llmdd-vllm exists (the
#      connector only; vLLM itself is far too large for this check and is not installed, and importing
#      the connector must say so); info and doctor name NIXL's install as ucx's fix;
#   3. the transports uninstalled: demo, doctor and a link must each say that no transport is
#      available and how to fix it.
# Needs network access to the package index for llmdd's third-party dependencies.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/llmdd-wheels.XXXXXX")
trap 'rm -rf "$work"' EXIT
case "$work/" in "$repo"/*) echo "test_wheels: $work is inside the repository" >&2; exit 2;; esac

wheels=${1:-}
if [ -z "$wheels" ]; then
  wheels="$work/wheels"
  bash "$repo/scripts/build_wheels.sh" "$wheels"
fi
wheels=$(cd "$wheels" && pwd)
# a package index takes manylinux (or pure) wheels only: build_wheels.sh retags the C plugins with auditwheel
if ls "$wheels"/*.whl | grep -E -- '-linux_[^/]*\.whl$'; then
  echo "test_wheels: the wheels above carry a plain linux tag, which a package index refuses" >&2; exit 1
fi
ls "$wheels"/*.whl | sed 's|.*/|  wheel: |'
cd "$work"
unset PYTHONPATH
export PYTHONSAFEPATH=1 PIP_DISABLE_PIP_VERSION_CHECK=1
for v in $(env | sed -n 's/^\(LLMDD_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done
"$PY" -m venv "$work/venv"
V="$work/venv/bin"
pipi() { "$V/python" -m pip install -q --find-links "$wheels" "$@"; }
step() { echo; echo "== test_wheels: $*"; }

cat > "$work/check_install.py" <<'PY'
"""The installed distributions come from the built wheels, not from the source tree."""
import importlib, importlib.metadata as md, os, sys
repo, wheels, want = sys.argv[1], sys.argv[2], sys.argv[3:]
built = {f.split("-")[0].replace("_", "-"): f.split("-")[1] for f in os.listdir(wheels) if f.endswith(".whl")}
for dist in want:
    version = md.version(dist)
    assert version == built[dist], f"{dist} {version} installed, {built[dist]} built"
    direct = md.distribution(dist).read_text("direct_url.json")
    assert direct is None or "editable" not in direct, f"{dist} is an editable install: {direct}"
for module in ("llmdd", "llmdd_shm", "llmdd_tcp"):
    path = os.path.realpath(importlib.import_module(module).__file__)
    assert not path.startswith(os.path.realpath(repo) + os.sep), f"{module} imported from the source tree: {path}"
    assert path.startswith(os.path.realpath(sys.prefix) + os.sep), f"{module} imported from outside the venv: {path}"
print("installed from the wheels:", ", ".join(f"{d} {md.version(d)}" for d in want))
PY

# the two-process example: a prompt process serves a seeded paged cache, a decoder process links to
# it over loopback, pulls three blocks and checks the bytes (and that the block it did not pull is
# untouched); run as two interpreters of the venv from outside the repository
cat > "$work/two_process.py" <<'PY'
"""Two processes, one pull: python two_process.py [--expect-no-transport]."""
import os, socket, subprocess, sys, time
import numpy as np

SHAPE = (2, 8, 16, 8, 64)   # tensors, blocks, tokens, heads, head dim

def data(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float16)

def engine(role, cluster_id, listen=None):
    from llmdd import LLMConfig, LLMDataDist, LLMRole
    dd = LLMDataDist(LLMRole[role], cluster_id)
    cfg = LLMConfig()
    cfg.enable_cache_manager = True
    if listen:
        cfg.listen_ip_info = listen
    dd.init(cfg.generate_options())
    return dd

def prompt(port):
    from llmdd import BlocksCacheKey, CacheDesc, DataType
    dd = engine("PROMPT", 1, f"127.0.0.1:{port}")
    kv = data(7)
    dd.cache_manager.register_blocks_cache(CacheDesc(2, list(SHAPE[1:]), DataType.DT_FLOAT16),
                                           [int(t.ctypes.data) for t in kv], BlocksCacheKey(1, 0))
    print("ready", flush=True)
    sys.stdin.readline()          # the driver closes stdin when the decoder is done
    dd.finalize()

def decoder(port, expect_no_transport):
    import logging
    from llmdd import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMStatusCode
    errors = []
    class Keep(logging.Handler):
        def emit(self, record):
            errors.append(record.getMessage())
    logging.getLogger("llmdd").addHandler(Keep(logging.WARNING))
    dd = engine("DECODER", 2)
    dst = data(99)                # not zeros: a block left alone must keep its own bytes
    before = dst.copy()
    cache = dd.cache_manager.register_blocks_cache(CacheDesc(2, list(SHAPE[1:]), DataType.DT_FLOAT16),
                                                   [int(t.ctypes.data) for t in dst])
    server = LLMClusterInfo()
    server.remote_cluster_id = 1
    server.append_local_ip_info("127.0.0.1", 0)
    server.append_remote_ip_info("127.0.0.1", port)
    ret, rets = dd.link_clusters([server], 5000)
    if expect_no_transport:
        assert ret != LLMStatusCode.LLM_SUCCESS, "linked without a transport"
        text = " ".join(errors)
        assert "no transport is available" in text and "pip install llmdd" in text, errors
        print("no transport: link_clusters says:", next(e for e in errors if "no transport" in e))
        dd.finalize()
        return
    assert ret == LLMStatusCode.LLM_SUCCESS, (ret, rets, errors)
    src_blocks, dst_blocks = [0, 1, 5], [2, 3, 4]
    dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks, dst_blocks)
    assert np.array_equal(dst[:, dst_blocks], data(7)[:, src_blocks]), "pulled bytes differ"
    others = [b for b in range(SHAPE[1]) if b not in dst_blocks]
    assert np.array_equal(dst[:, others], before[:, others]), "a block that was not pulled changed"
    link = dd.statistics()["links"][1]
    print(f"two processes: pulled {dst[:, dst_blocks].nbytes} bytes over {link['transport']}, verified")
    dd.unlink_clusters([server], 5000, force=True)
    dd.finalize()

def main():
    expect = "--expect-no-transport" in sys.argv
    if sys.argv[1:2] == ["prompt"]:
        return prompt(int(sys.argv[2]))
    if sys.argv[1:2] == ["decoder"]:
        return decoder(int(sys.argv[2]), expect)
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    p = subprocess.Popen([sys.executable, __file__, "prompt", str(port)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()                      # blocks until ready or the prompt exits
        assert line.strip() == "ready", f"the prompt did not start: {line!r}, exit {p.poll()}"
        subprocess.run([sys.executable, __file__, "decoder", str(port)] + sys.argv[1:], check=True, timeout=120)
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
    assert p.returncode == 0, f"the prompt exited {p.returncode}"

main()
PY

run_all() {   # the commands a new user runs; every one must pass
  "$V/llmdd" --version
  "$V/llmdd" info | sed -n '/^transports/,/^profile/p'
  "$V/llmdd" doctor --seconds 1
  "$V/llmdd" demo --quick | tail -n 3
  timeout 300 "$V/python" "$work/two_process.py"
}

step "pip install --find-links $wheels llmdd   (fresh venv: $work/venv, cwd $work)"
"$V/python" -m pip install -q --upgrade pip
pipi llmdd
"$V/python" "$work/check_install.py" "$repo" "$wheels" llmdd llmdd-transport-shm llmdd-transport-tcp
run_all

step "pip install --find-links $wheels \"llmdd[all]\""
pipi "llmdd[all]"
"$V/python" "$work/check_install.py" "$repo" "$wheels" llmdd llmdd-transport-shm llmdd-transport-tcp \
  llmdd-transport-ucx llmdd-metrics llmdd-faults llmdd-transport-sim
"$V/python" -c "import matplotlib, llmdd_metrics, llmdd_faults, llmdd_ucx, llmdd_sim; print('matplotlib', matplotlib.__version__)"
run_all
# llmdd[all] has the ucx plugin but not NIXL (an extra cannot say --no-deps): info and doctor name the fix
"$V/llmdd" info | grep -F "fix: pip install --no-deps nixl-cu12"
"$V/llmdd" doctor --seconds 0 | grep -F "fix: pip install --no-deps nixl-cu12"
# a wheel ships no C++ sources: the bench's C++ row says what to do instead of pointing at scripts/test_cpp.sh
"$V/python" -c "from llmdd._tools.bench.cpp import not_built_reason as r; m = r(); print('bench C++ row:', m); \
assert m.startswith('the C++ API is not part of an installed llmdd'), m"
if [ -f "$repo/plugins/llmdd-vllm/pyproject.toml" ]; then
  step "pip install --find-links $wheels \"llmdd[vllm]\"  (the connector; vLLM itself is not installed here)"
  pipi "llmdd[vllm]"
  "$V/python" "$work/check_install.py" "$repo" "$wheels" llmdd llmdd-vllm
  # without vLLM, importing the connector says what to install (not a bare "No module named 'torch'")
  if out=$("$V/python" -c "import llmdd_vllm" 2>&1); then
    echo "test_wheels: llmdd_vllm imported without vLLM installed" >&2; exit 1
  fi
  grep -F "llmdd_vllm is the KV connector that vLLM loads: it needs vLLM (and its torch) installed" <<<"$out" \
    || { echo "test_wheels: import llmdd_vllm without vLLM said: $out" >&2; exit 1; }
fi

step "no transport (shm, tcp and ucx uninstalled): every command says so and how to fix it"
"$V/python" -m pip uninstall -q -y llmdd-transport-shm llmdd-transport-tcp llmdd-transport-ucx
expect_fail() {   # command...: must fail and say "no transport is available" with the pip fix
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ "$rc" = 0 ] || ! grep -q "no transport is available" <<<"$out" || ! grep -q "pip install" <<<"$out"; then
    echo "test_wheels: '$*' did not fail with the no-transport message (exit $rc):" >&2
    echo "$out" >&2
    return 1
  fi
  grep -m1 "no transport is available" <<<"$out"
}
expect_fail "$V/llmdd" demo --quick
expect_fail "$V/llmdd" doctor --seconds 0
expect_fail "$V/llmdd" bench --quick
"$V/llmdd" info | grep "no transport is available: pip install llmdd"
timeout 120 "$V/python" "$work/two_process.py" --expect-no-transport

echo
echo "== test_wheels: all passed"
