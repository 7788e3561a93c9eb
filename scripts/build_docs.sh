#!/usr/bin/env bash
# Build the docs site into site/ (ignored by git) with `mkdocs build --strict`: every nav entry,
# internal link and anchor must resolve and every page in docs/ must be in the nav, else the
# build fails. Offline: the theme loads no web fonts and no plugin fetches anything.
# Installs the `docs` extra's tools (pyproject.toml) into .venv when they are missing.
#   bash scripts/build_docs.sh            # then open site/index.html
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
  mapfile -t reqs < <(.venv/bin/python - <<'PYEOF'
import re
text = open("pyproject.toml", encoding="utf-8").read()
# the list ends at a "]" alone on its line (a requirement such as mkdocstrings[python] holds one too)
block = re.search(r"^docs\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
print("\n".join(re.findall(r'"([^"]+)"', block)))
PYEOF
)
  .venv/bin/python -m pip install -q "${reqs[@]}"
fi
# the API pages' directives must match the public modules (docs/_tools/gen_api.py)
.venv/bin/python docs/_tools/gen_api.py --check
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --site-dir site "$@"
echo "docs site: $(pwd)/site/index.html"
