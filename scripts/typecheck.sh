#!/usr/bin/env bash
# Type-check llmdd/ and the plugin packages with mypy (configuration: [tool.mypy] in pyproject.toml),
# print mypy's report, then the error count per package and in all. Exits with mypy's status (0: no
# error). Extra arguments go to mypy (e.g. `-p llmdd._control` to check one package).
# A step of .ci/run (after the default suite): any error fails CI. tests/unit/test_typecheck.py runs
# the same check in the default suite.
#   PYTHON   the interpreter whose site-packages mypy resolves third-party imports against
#            (default: .venv/bin/python, else python3); mypy is installed there when missing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" -c "import mypy" 2>/dev/null || "$PY" -m pip install -q 'mypy>=2.4,<3' || exit 2
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$PY" -m mypy "$@" >"$out" 2>&1
rc=$?
cat "$out"
echo "== errors per package"
"$PY" - "$out" <<'PYEOF'
import collections, re, sys

counts = collections.Counter()
for line in open(sys.argv[1], encoding="utf-8"):
    m = re.match(r"(\S+?\.pyi?):\d+(?::\d+)?: error:", line)
    if m is None:
        continue
    parts = m.group(1).split("/")
    if parts[0] == "plugins":
        key = parts[1]
    elif len(parts) > 2:
        key = "/".join(parts[:2])
    else:
        key = parts[-1] if len(parts) == 1 else "/".join(parts)
    counts[key] += 1
for key in sorted(counts):
    print(f"{counts[key]:5d}  {key}")
print(f"{sum(counts.values()):5d}  total")
PYEOF
exit "$rc"
