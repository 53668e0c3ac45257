#!/usr/bin/env bash
# Run the launcher, rendezvous, host and multi-process tests round after round under load, to find flakes.
#
#   bash scripts/flake-loop.sh [ROUNDS]      (default 20; touch .cache/flake-stop to stop after the current run)
#
# Each round runs the quick launcher/rendezvous files (-n 2), then the multi-process ones (-m multiprocess,
# -n 2), while two busy loops (`yes`) load the machine. One summary line per run goes to
# .cache/flake-loop/summary.log, each run's whole output beside it. Results: benchmarks/results/flakes.md.
source "$(dirname "$0")/_venv.sh"
rounds="${1:-20}"
out=.cache/flake-loop
mkdir -p "$out"
rm -f .cache/flake-stop
yes > /dev/null & busy1=$!
yes > /dev/null & busy2=$!
trap 'kill $busy1 $busy2' EXIT
light=(tests/test_rendezvous.py tests/test_membership.py tests/test_launch*.py tests/test_*_promises.py tests/test_watchdog.py)
heavy=(tests/test_hosts.py tests/test_restarts.py tests/test_faults.py tests/test_distributed.py)
for i in $(seq 1 "$rounds"); do
  for kind in light heavy; do
    if [ "$kind" = light ]; then files=("${light[@]}"); marks=(); else files=("${heavy[@]}"); marks=(-m multiprocess); fi
    # _venv.sh sets -e: a failing round must be counted, not end the loop.
    rc=0
    "$PY" -m pytest -q -n 2 -p no:cacheprovider "${marks[@]}" "${files[@]}" > "$out/$kind-$i.log" 2>&1 || rc=$?
    echo "$kind $i rc=$rc $(tail -1 "$out/$kind-$i.log") $(date +%H:%M)" | tee -a "$out/summary.log"
    [ -f .cache/flake-stop ] && exit 0
  done
done
