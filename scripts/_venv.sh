# Sourced by the other scripts: create a virtual environment (once) and install the
# project into it, with the optional dependencies named by EXTRAS (default: test),
# under the pinned versions of one JAX leg.
#
#   JAX_LEG=0.10 (default)  the machine's python3 (3.11), .venv,         constraints/jax-0.10.txt
#   JAX_LEG=0.12            a private Python 3.13 built by scripts/python313.sh,
#                           .venv-jax0.12, constraints/jax-0.12.txt
#
# PYTHON and VENV override the interpreter and the folder; CONSTRAINTS the pins (a file,
# or empty for none). The install is redone when pyproject.toml or the pins change.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
JAX_LEG="${JAX_LEG:-0.10}"
case "$JAX_LEG" in
  0.10) _python=python3 ;;
  0.12) _python="$(bash scripts/python313.sh)" ;;
  *) echo "_venv.sh: unknown JAX_LEG '$JAX_LEG' (0.10 or 0.12; for another release use scripts/try-jax.sh)" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-$_python}"
if [ "$JAX_LEG" = 0.10 ]; then _venv=.venv; else _venv=".venv-jax$JAX_LEG"; fi
VENV="${VENV:-$_venv}"
CONSTRAINTS="${CONSTRAINTS-constraints/jax-$JAX_LEG.txt}"
EXTRAS="${EXTRAS:-test}"
if [ ! -x "$VENV/bin/python" ]; then
  # --without-pip, then pip from its wheel: Debian's ensurepip is missing or broken in
  # the private Python 3.13.
  "$PYTHON" -m venv --without-pip "$VENV"
  mkdir -p .cache/pip-wheel
  if ! ls .cache/pip-wheel/pip-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps -d .cache/pip-wheel pip 2>&1 | grep -v '^WARNING: Location' >&2 || true
  fi
  _pip_whl=$(ls .cache/pip-wheel/pip-*.whl | head -n1)
  "$VENV/bin/python" "$_pip_whl/pip" install -q "$_pip_whl" 2>&1 | grep -v '^WARNING: Location' >&2 || true
fi
_pins=()
[ -n "$CONSTRAINTS" ] && _pins=(-c "$CONSTRAINTS")
stamp="$VENV/.installed-$EXTRAS-$(cat pyproject.toml ${CONSTRAINTS:+"$CONSTRAINTS"} | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  if [ -n "${TRY_JAX_IGNORE_RANGE:-}" ]; then
    # scripts/try-jax.sh: the project's requirements without its jax/jaxlib range.
    mapfile -t _reqs < <("$VENV/bin/python" -c 'import re, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for r in p["dependencies"] + p["optional-dependencies"][sys.argv[1]]:
    print(re.sub(r"^(jax|jaxlib)\b.*", r"\1", r))' "$EXTRAS")
    "$VENV/bin/python" -m pip install -q "${_reqs[@]}" "${_pins[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    "$VENV/bin/python" -m pip install -q --no-deps -e . 2>&1 | grep -v '^WARNING: Location' >&2 || true
  else
    "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" "${_pins[@]}" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  fi
  "$VENV/bin/python" -c 'import jax, replicator' || { echo "_venv.sh: install into $VENV failed" >&2; exit 1; }
  touch "$stamp"
fi
PY="$VENV/bin/python"
