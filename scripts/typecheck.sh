#!/usr/bin/env bash
# Type-check llmdd/ and the plugin packages with mypy (configuration: [tool.mypy] in pyproject.toml),
# print mypy's report, then the error count per package and in all. Exits with mypy's status (0: no
# error). Extra arguments go to mypy (e.g. `-p llmdd._control` to check one package).
# A step of .ci/run (after the default suite): any error fails CI. Then, when called without arguments,
# a control: a planted file that misuses llmdd's own types must fail with exactly its two errors (a
# mis-resolved import would turn llmdd's types into Any and let every error through). Not a test of the
# default suite (issue 41): mypy on a cold cache is minutes of CPU on a busy machine, no test deadline.
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
[ "$rc" -ne 0 ] || [ "$#" -ne 0 ] || {
  echo "== control: a type error against llmdd's own types must fail the check"
  ctl=$(mktemp -d)
  trap 'rm -f "$out"; rm -rf "$ctl"' EXIT
  cat >"$ctl/uses_llmdd_wrongly.py" <<'PYEOF'
from llmdd._control.link import Link
from llmdd._engine.core import EngineCore


def transport_id(link: Link) -> int:
    return link.transport


def drop(core: EngineCore) -> None:
    core.link_manager = None
PYEOF
  "$PY" -m mypy --follow-imports silent "$ctl/uses_llmdd_wrongly.py" >"$out" 2>&1
  crc=$?
  cat "$out"
  if [ "$crc" -eq 1 ] && grep -q "uses_llmdd_wrongly.py:6: error: Incompatible return value type" "$out" \
      && grep -q "uses_llmdd_wrongly.py:10: error: Incompatible types in assignment" "$out" \
      && grep -q "Found 2 errors in 1 file" "$out"; then
    echo "control: failed as it must (2 errors)"
  else
    echo "control: the check did not see llmdd's types (mypy exit $crc; expected exit 1 and the 2 errors above)"
    rc=1
  fi
}
exit "$rc"
