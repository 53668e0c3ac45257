"""A JAX-free worker that starts a child process, for the launcher's tests of stopping what workers start.

Each worker starts a child (``python -c "time.sleep(600)"``, in the worker's own
process group, as a data loader or a compiler subprocess would be), writes the
child's pid to ``PIDS.<worker>.<start>`` (``<start>``: ``REPLICATOR_RESTART_COUNT``,
0 without restarts), and prints ``stale children alive: [...]``: the pids written
in earlier starts of this job whose processes still run (orphans of a restart).
Then:

* ``--fail-worker I``: worker ``I`` waits until every worker's pid file of this
  start exists (so that the others' children run), then exits with ``--code``
  (only in the job's first ``--fail-starts`` starts, when given); its child stays
  behind, in its process group;
* the others sleep ``--sleep`` seconds, then stop their child and exit 0
  (with ``--leave-child``: exit 0 and leave it running, as a worker that forgot a
  background process does).

``--child-ignores-sigterm``: the child ignores SIGTERM (as JAX's runtime does).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pids", required=True, help="path prefix of the pid files")
p.add_argument("--num-workers", type=int, required=True)
p.add_argument("--fail-worker", type=int)
p.add_argument("--fail-starts", type=int, help="fail only while REPLICATOR_RESTART_COUNT < K")
p.add_argument("--code", type=int, default=3)
p.add_argument("--sleep", type=float, default=60.0)
p.add_argument("--child-ignores-sigterm", action="store_true")
p.add_argument("--leave-child", action="store_true", help="exit 0 without stopping the child")
args = p.parse_args()

me = int(os.environ["REPLICATOR_WORKER_ID"])
start = int(os.environ.get("REPLICATOR_RESTART_COUNT", "0"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) holds no cores, ports or devices.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


stale = []
for path in glob.glob(f"{args.pids}.*.*"):
    # Only finished files, PIDS.<worker>.<start>: another worker's file being written is named apart.
    worker_start = path[len(args.pids) + 1 :].split(".")
    if len(worker_start) == 2 and all(part.isdigit() for part in worker_start) and int(worker_start[1]) < start:
        with open(path) as f:
            pid = int(f.read())
        if alive(pid):
            stale.append(pid)
print(f"stale children alive: {sorted(stale)}", flush=True)

ignore = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " if args.child_ignores_sigterm else ""
child = subprocess.Popen([sys.executable, "-c", f"{ignore}import time; time.sleep(600)"])
tmp = f"{args.pids}-writing-{me}-{start}"  # outside the glob above
with open(tmp, "w") as f:
    f.write(str(child.pid))
os.replace(tmp, f"{args.pids}.{me}.{start}")  # whole or absent
print(f"child {child.pid} started", flush=True)

failing = args.fail_starts is None or start < args.fail_starts
if me == args.fail_worker and failing:
    deadline = time.monotonic() + 30
    while not all(os.path.exists(f"{args.pids}.{w}.{start}") for w in range(args.num_workers)):
        if time.monotonic() > deadline:
            sys.exit("the other workers' children did not start within 30 s")
        time.sleep(0.02)
    os._exit(args.code)  # no clean-up: the child stays behind
time.sleep(args.sleep)
if args.leave_child:
    os._exit(0)
child.kill()
child.wait()
