#!/usr/bin/env bash
# Install into .venv and run lint + the test suite (8 emulated CPU devices).
source "$(dirname "$0")/_venv.sh"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m pytest "$@"
