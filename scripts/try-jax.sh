#!/usr/bin/env bash
# Try a JAX release that the project does not pin: build .venv-try-jaxVERSION with
# jax==VERSION and jaxlib==VERSION (Python 3.11 for 0.10, the private Python 3.13 of
# scripts/python313.sh otherwise), let pip resolve optax, Flax, Equinox and Haiku
# against it, and run lint + the whole test suite.
#
#   bash scripts/try-jax.sh 0.11.2 [pytest args]
#
# The project's declared range (pyproject.toml) is not enforced here, so a release
# above it can be tried before the range is widened. See docs/reference/compatibility.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION="${1:?usage: scripts/try-jax.sh VERSION [pytest args]}"
shift
if [[ ! "$VERSION" =~ ^[0-9]+(\.[0-9]+)+$ ]]; then
  echo "try-jax.sh: '$VERSION' is not a release number such as 0.11.2" >&2
  exit 2
fi
case "$VERSION" in
  0.10.*) export JAX_LEG=0.10 ;;
  *) export JAX_LEG=0.12 ;;
esac
mkdir -p .cache
pins=".cache/try-jax-$VERSION.txt"
printf 'jax==%s\njaxlib==%s\n' "$VERSION" "$VERSION" > "$pins"
export VENV=".venv-try-jax$VERSION" CONSTRAINTS="$pins" TRY_JAX_IGNORE_RANGE=1
exec bash scripts/test.sh "$@"
