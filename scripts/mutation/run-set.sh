#!/usr/bin/env bash
# Run a set of hand-written mutants (scripts/mutation/<set>/NN-module.patch) against the suite:
# each patch applied in a clean clone of HEAD, the tests of its area run (-x, 2 xdist processes),
# "caught" when they fail. The checkout itself is never written to.
#
#   bash scripts/mutation/run-set.sh hidden2 [NN ...]     (default: every patch of the set)
#
# One line per mutant on stdout: NN  caught|SURVIVED  seconds  first failing test.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
set_dir="$root/scripts/mutation/$1"; shift
py="$root/.venv/bin/python"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
git clone -q "$root" "$work/tree"
cd "$work/tree"
area_tests() {
  case "$1" in
    replicator/launch/*) ls tests/test_launch*.py tests/test_*_promises.py tests/test_watchdog.py tests/test_restarts.py \
        tests/test_faults.py tests/test_rendezvous.py tests/test_membership.py tests/test_hosts.py tests/test_distributed.py 2>/dev/null ;;
    replicator/runtime/*) ls tests/test_run.py tests/test_execution.py tests/test_inputs*.py tests/test_state.py \
        tests/test_consistency.py tests/test_host_path.py tests/test_divergence.py tests/test_memory.py tests/test_gc_pause.py \
        tests/test_distributed.py tests/test_per_replica_state.py tests/test_bad_input.py tests/test_prefetch.py \
        tests/test_porting_inputs.py tests/test_loop.py tests/test_watchdog.py 2>/dev/null ;;
    replicator/training/checkpoint/*) ls tests/test_checkpoint*.py tests/stages/test_checkpoints.py 2>/dev/null ;;
    *) echo "run-set.sh: no area for $1" >&2; return 1 ;;
  esac
}
patches=()
if [ $# -gt 0 ]; then for n in "$@"; do patches+=("$set_dir/$n"-*.patch); done; else patches=("$set_dir"/[0-9]*.patch); fi
for patch in "${patches[@]}"; do
  name="$(basename "$patch" .patch)"
  module="$(grep -m1 '^+++ b/' "$patch" | sed 's|^+++ b/||')"
  if ! git apply "$patch"; then echo "$name  NOT-APPLIED"; continue; fi
  start=$SECONDS
  PYTHONPATH="$work/tree" "$py" -m pytest -q -x -n 2 -p no:cacheprovider $(area_tests "$module") > "$work/$name.log" 2>&1
  rc=$?
  first="$(grep -m1 -E '^FAILED|^ERROR' "$work/$name.log" | cut -c1-160)"
  if [ $rc -ne 0 ]; then echo "$name  caught  $((SECONDS - start))s  $first"; else echo "$name  SURVIVED  $((SECONDS - start))s"; fi
  git checkout -q -- replicator
done
