# Sourced by the other scripts: create .venv (once) and install the project into it,
# with the optional dependencies named by EXTRAS (default: test). PYTHON picks the
# interpreter that creates the venv, VENV its directory; the install is redone when
# pyproject.toml changes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-test}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.installed-$EXTRAS-$(cksum < pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
  touch "$stamp"
fi
PY="$VENV/bin/python"
