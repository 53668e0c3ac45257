#!/usr/bin/env bash
# Install into .venv and run the main example on 8 emulated CPU devices.
source "$(dirname "$0")/_venv.sh"
"$PY" examples/train_mlp.py "$@"
