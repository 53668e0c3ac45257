#!/usr/bin/env bash
# Install into a virtual environment and run lint + the test suite (8 emulated CPU devices).
#
#   bash scripts/test.sh [pytest args]              JAX 0.10 on the machine's Python 3.11 (.venv)
#   bash scripts/test.sh --jax 0.12 [pytest args]   JAX 0.12 on a private Python 3.13 (.venv-jax0.12),
#                                                   built by scripts/python313.sh under .cache/
#
# The pinned versions of each leg are in constraints/jax-VERSION.txt; .ci/run runs both legs (the second
# without the tests marked one_leg: tests/conftest.py). The tests run on as many pytest-xdist processes as
# the machine has cores (REPLICATOR_TEST_JOBS=N for another count, 0 for one process).
if [ "${1:-}" = "--jax" ]; then
  export JAX_LEG="${2:?usage: scripts/test.sh --jax VERSION [pytest args]}"
  shift 2
fi
source "$(dirname "$0")/_venv.sh"
echo "test.sh: $("$PY" -c 'import sys, jax, jaxlib; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")') ($VENV)" >&2
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m pytest -n "${REPLICATOR_TEST_JOBS:-auto}" "$@"
