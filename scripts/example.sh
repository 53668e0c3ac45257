#!/usr/bin/env bash
# Install the project with its `examples` extra into .venv and run examples/NAME.py.
#
#   bash scripts/example.sh NAME [args]     e.g.  bash scripts/example.sh classifier --steps 100
#
# NAME is one of the files in examples/ without .py (classifier, gan, contrastive, train_mlp);
# the arguments go to the example (each has --help). PYTHON and VENV as in scripts/_venv.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

available() { (cd examples && ls -- *.py | sed 's/\.py$//' | tr '\n' ' '); }
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  echo "usage: bash scripts/example.sh NAME [args]   (NAME: $(available))" >&2
  exit 2
fi
NAME="$1"
shift
if [[ ! "$NAME" =~ ^[A-Za-z0-9_]+$ ]] || [ ! -f "examples/$NAME.py" ]; then
  echo "scripts/example.sh: no example '$NAME'; available: $(available)" >&2
  exit 2
fi

EXTRAS=examples source scripts/_venv.sh
exec "$PY" "examples/$NAME.py" "$@"
