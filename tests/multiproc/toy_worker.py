"""A JAX-free stand-in worker for the launcher's tests (starts in milliseconds).

Prints ``hello from worker I`` on stdout and ``note from worker I`` on
stderr (``I`` from ``REPLICATOR_WORKER_ID``, else ``?``), then the requested
environment variables as ``NAME=value``, then:

* ``--fail-worker I --code C --after S``: worker ``I`` waits ``S`` seconds,
  prints ``ValueError: toy failure in worker I`` on stderr, reports it in the
  launcher's status directory as an uncaught exception would be (unless
  ``--no-report``) and exits with ``C`` (or kills itself with ``--signal
  NAME``, reporting nothing); the others sleep ``--sleep``;
* otherwise every worker sleeps ``--sleep`` seconds and exits 0.

``--restart-sleep S`` sleeps ``S`` instead of ``--sleep`` in the starts after the first;
``--until-file PATH`` ends the sleep early once ``PATH`` exists.
``--fail-starts K`` makes worker ``I`` fail only in the job's first ``K`` starts
(``REPLICATOR_RESTART_COUNT < K``: under ``--max-restarts``); ``--fail-in-start R`` only in
start ``R``. ``--ignore-sigterm``
makes it ignore SIGTERM, as JAX's runtime does;
``--ready-file PATH`` creates ``PATH.I`` once it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

STATUS = Path(__file__).resolve().parents[2] / "replicator" / "runtime" / "distributed" / "status.py"


def report(worker_id: int, message: str) -> None:
    """Write the status file with the real protocol code (stdlib only: loaded without importing JAX)."""
    directory = os.environ.get("REPLICATOR_STATUS_DIR")
    if not directory:
        return
    spec = importlib.util.spec_from_file_location("toy_status", STATUS)
    status = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(status)
    first = status.claim_first_failure(directory)
    status.write_status(
        directory, worker_id, kind="exception", exception_type="ValueError", message=message, first_failure=first
    )


p = argparse.ArgumentParser()
p.add_argument("--env", nargs="*", default=[])
p.add_argument("--fail-worker", type=int)
p.add_argument("--code", type=int, default=3)
p.add_argument("--signal")
p.add_argument("--no-report", action="store_true")
p.add_argument("--after", type=float, default=0.0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--restart-sleep", type=float, help="sleep this long instead of --sleep after a restart")
p.add_argument("--until-file", help="end the sleep early once this file exists")
p.add_argument("--fail-starts", type=int, help="fail only while REPLICATOR_RESTART_COUNT < K")
p.add_argument("--fail-in-start", type=int, help="fail only when REPLICATOR_RESTART_COUNT == R")
p.add_argument("--ignore-sigterm", action="store_true")
p.add_argument("--ready-file")
args = p.parse_args()

if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
me = os.environ.get("REPLICATOR_WORKER_ID", "?")
print(f"hello from worker {me}", flush=True)
print(f"note from worker {me}", file=sys.stderr, flush=True)
for name in args.env:
    print(f"{name}={os.environ.get(name, '<unset>')}", flush=True)
if args.ready_file:
    open(f"{args.ready_file}.{me}", "w").close()
start = int(os.environ.get("REPLICATOR_RESTART_COUNT", "0"))
failing = (args.fail_starts is None or start < args.fail_starts) and args.fail_in_start in (None, start)
if args.fail_worker is not None and me == str(args.fail_worker) and failing:
    time.sleep(args.after)
    print(f"ValueError: toy failure in worker {me}", file=sys.stderr, flush=True)
    if args.signal:
        os.kill(os.getpid(), signal.Signals[f"SIG{args.signal}"])
    if not args.no_report:
        report(int(me), f"toy failure in worker {me}")
    sys.exit(args.code)
deadline = time.monotonic() + (args.sleep if start == 0 or args.restart_sleep is None else args.restart_sleep)
while time.monotonic() < deadline and not (args.until_file and os.path.exists(args.until_file)):
    time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
