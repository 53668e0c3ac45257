#!/usr/bin/env bash
# Install into .venv and run lint + the test suite (8 emulated CPU devices, 2 pytest workers).
source "$(dirname "$0")/_venv.sh"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# Two pytest workers (pytest-xdist): the multi-process tests mostly wait on their
# workers, so a second runner overlaps them with compiling. REPLICATOR_TEST_WORKERS=0
# runs in this process only.
"$PY" -m pytest -n "${REPLICATOR_TEST_WORKERS:-2}" "$@"
