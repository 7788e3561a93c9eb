# Sourced by scripts/demo.sh and scripts/test.sh: one runtime set for both, installed into .venv.
#
# llmdd_venv EXTRAS: llmdd (editable) with the given extras ("bench" for the demo, "bench,test" for
# the tests), every plugin distribution under plugins/ (editable; the shm and tcp transports are
# also llmdd's own dependencies; llmdd-vllm without vLLM itself, which is very large and installed
# only by .ci/run's vLLM step), and NIXL for the ucx transport (--no-deps: the nixl-cu12 wheel
# requires torch and CUDA wheels that llmdd does not need).  The set `pip install "llmdd[all,vllm]"`
# gives from wheels (scripts/test_wheels.sh), editable, plus NIXL.
#
# Nothing is reinstalled when it is current: a stamp in .venv records the hash of every
# pyproject.toml and setup.py, the shm plugin's C source, this file, the Python version and whether
# a C compiler with Python.h is present (the shm C hot path is built at install time); any change
# reinstalls.  A fresh clone (CI) has no .venv and always installs.  LLMDD_REINSTALL=1 forces it.

NIXL_PIN='nixl-cu12==1.5.1'

llmdd_step() {   # $1 = what is installed and what to expect (size, time); the rest: the command. Says both,
  local what=$1 t0=$SECONDS   # runs it, then says how long it took (pip -q prints nothing meanwhile)
  shift
  echo "llmdd: $what ..."
  "$@" || return   # (also where the caller's `||` turns errexit off)
  echo "llmdd:   done in $((SECONDS - t0)) s"
}

_llmdd_native_capable() {
  local inc
  inc=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  if command -v gcc >/dev/null && [ -f "$inc/Python.h" ]; then echo native; else echo no-native; fi
}

_llmdd_plugin_dirs() {
  local p
  for p in plugins/*/; do
    [ -f "$p/pyproject.toml" ] || continue
    printf '%s\n' "${p%/}"
  done
}

_llmdd_install_key() {   # the hash of what an install depends on (the extras are recorded beside it)
  {
    printf 'nixl=%s\n' "$NIXL_PIN"
    .venv/bin/python -c "import sys; print(sys.version)"
    _llmdd_native_capable
    _llmdd_plugin_dirs
    sha256sum pyproject.toml plugins/*/pyproject.toml plugins/*/setup.py scripts/_venv.sh 2>/dev/null
    find plugins -path '*/src/*' -name '*.c' -print0 | sort -z | xargs -0 -r sha256sum
  } | sha256sum | cut -d' ' -f1
}

_llmdd_stamp_covers() {   # $1 = stamp file, $2 = hash, $3 = extras: a stamp of this hash has them all
  local h e want have
  [ -f "$1" ] || return 1
  while read -r h e; do
    [ "$h" = "$2" ] || continue
    have=",$e,"
    for want in ${3//,/ }; do [[ $have == *",$want,"* ]] || continue 2; done
    return 0
  done < "$1"
  return 1
}

llmdd_venv() {   # $1 = extras of llmdd
  local extras=$1 stamp=.venv/.llmdd-install-stamp key args=() p
  [ -x .venv/bin/python ] || "${PY:-python3}" -m venv .venv
  key="$(_llmdd_install_key) $extras"
  if [ "${LLMDD_REINSTALL:-0}" != 1 ] && _llmdd_stamp_covers "$stamp" "${key%% *}" "$extras" \
      && .venv/bin/python -c "import llmdd, llmdd_shm, llmdd_tcp" 2>/dev/null; then
    echo "llmdd: .venv is current (llmdd[$extras] and the plugins; LLMDD_REINSTALL=1 reinstalls them)"
    return 0
  fi
  local size="about 200 MB (numpy, matplotlib for the bench's plots, structlog, pluggy, ...)"
  [[ ",$extras," == *",test,"* ]] && size="about 300 MB (numpy, matplotlib, and the test tools: pytest, hypothesis, mypy, cryptography, ...)"
  echo "llmdd: installing llmdd[$extras] and the plugins into .venv (editable), then NIXL; about 1.5-3 minutes" \
       "in all on a 2-core machine (LLMDD_REINSTALL=1 forces it; later runs skip it while nothing changed)"
  llmdd_step "upgrading pip in .venv (a few seconds)" .venv/bin/python -m pip install -q --upgrade pip
  while IFS= read -r p; do args+=(-e "$p"); done < <(_llmdd_plugin_dirs)
  llmdd_step "installing llmdd[$extras] and $(( ${#args[@]} / 2 )) plugin distributions: $size from the package index, and compiling the shm and tcp plugins' C extensions; about 1-2 minutes" \
    .venv/bin/python -m pip install -q -e ".[$extras]" "${args[@]}"
  llmdd_step "installing NIXL ($NIXL_PIN, --no-deps) for the ucx transport: about 220 MB, 15-60 s" \
    .venv/bin/python -m pip install -q --no-deps "$NIXL_PIN"
  # stamps of other extras stay valid only under the same hash (the same sources)
  { [ -f "$stamp" ] && grep -F "${key%% *} " "$stamp" | grep -vxF "$key"; echo "$key"; } > "$stamp.new" || true
  mv "$stamp.new" "$stamp"
}
