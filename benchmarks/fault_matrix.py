"""The fault matrix with the launcher's default timeouts: how long each fault takes to end the job.

Each row starts ``python -m replicator.launch --num-workers 2 --cores-per-worker 2``
on ``tests/multiproc/fault_worker.py`` with one injected fault (in worker 1 at step 5
unless stated) and measures the time from the fault (the worker prints when it
happens) to the launcher's exit, with its exit code and the worker it named. Prints a
markdown table (BENCHMARKS.md). ``tests/test_faults.py`` checks the same rows with a
short ``--step-timeout``.

Usage::

    python benchmarks/fault_matrix.py             # every row, default timeouts (about 3 minutes)
    python benchmarks/fault_matrix.py --rows sleep,exit
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multiproc" / "fault_worker.py"

ROWS = {
    "sleep": ("a worker stuck in its own Python code (`time.sleep` between steps)", ["--fault", "sleep"]),
    "input": ("a worker stuck in `input_fn` (I/O that never returns)", ["--fault", "input"]),
    "checkpoint": (
        "process 0 stuck writing a checkpoint",
        ["--fault", "checkpoint", "--worker", "0", "--ckpt", "{tmp}/ckpt"],
    ),
    "exit": ("`sys.exit(3)` in one worker", ["--fault", "exit", "--code", "3"]),
    "leave": ("one worker leaves the loop early and exits 0", ["--fault", "leave"]),
    "before-init": ("a worker exits 0 before `initialize()`", ["--fault", "before-init"]),
    "raise": ("an uncaught exception in one worker", ["--fault", "raise"]),
    "lr": ("worker 1 uses another learning rate", ["--fault", "lr"]),
}


def env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "JAX_PLATFORMS": "cpu"}


def run_row(args: list[str], tmp: str) -> tuple[float | None, int, str]:
    command = [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", "2"]
    command += ["--max-time", "300", str(WORKER), *(a.format(tmp=tmp) for a in args)]
    start = time.time()
    proc = subprocess.run(command, env=env(), cwd=ROOT, capture_output=True, text=True, timeout=400)
    ended = time.time()
    fault = re.search(r"fault \S+ at ([0-9.]+)", proc.stdout)
    after = ended - float(fault.group(1)) if fault else None
    said = [line for line in proc.stderr.splitlines() if line.startswith("[launcher]") and "stack" not in line]
    verdict = next((line for line in said if "watchdog:" in line or "failed with" in line), said[-1] if said else "")
    named = re.search(r"(Behind: worker \d+|worker \d+ (?:failed|ended|was))", verdict)
    if after is None:  # no fault line (the lr row fails before it): from the job's start
        after = ended - start
    return after, proc.returncode, named.group(1) if named else verdict[:80]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    args = p.parse_args()
    import tempfile

    print("| scenario | ended after (s) | exit code | named |")
    print("|---|---:|---:|---|")
    for name in args.rows.split(","):
        what, worker_args = ROWS[name]
        with tempfile.TemporaryDirectory() as tmp:
            after, code, named = run_row(worker_args, tmp)
        print(f"| {what} | {after:.1f} | {code} | {named} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
