"""The command line: ``python -m replicator.launch [options] (script.py | -m module) [args ...]``.

The launcher's options end at the script (or ``-m MODULE``, or ``--``); the
rest is the worker's command line. :func:`main` runs the job with
:func:`~replicator.launch.supervise.launch` and turns ``SIGINT`` and
``SIGTERM`` into stopping it (exit code ``128 + signal``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from replicator.launch.environment import LaunchError, worker_command
from replicator.launch.processes import DEFAULT_KILL_GRACE_S
from replicator.launch.restarts import DEFAULT_FAILURE_WINDOW_S
from replicator.launch.supervise import launch
from replicator.launch.watchdog import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S
from replicator.runtime.distributed.startup import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
)

__all__ = ["main"]

# The options that take seconds: (flag, default, help), in --help's order.
_SECONDS: list[tuple[str, float | None, str]] = [
    ("--start-timeout", DEFAULT_START_TIMEOUT_S, "seconds workers wait for all to join (default %(default)g)"),
    (
        "--heartbeat-timeout",
        DEFAULT_HEARTBEAT_TIMEOUT_S,
        "seconds after which a silent worker counts as dead (default %(default)g)",
    ),
    (
        "--shutdown-timeout",
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "seconds a finished worker waits for the others (default %(default)g)",
    ),
    (
        "--kill-grace",
        DEFAULT_KILL_GRACE_S,
        "seconds between SIGTERM and SIGKILL when stopping workers (default %(default)g)",
    ),
    ("--max-time", None, "stop the whole job after this many seconds (default: no limit)"),
    (
        "--step-timeout",
        DEFAULT_STEP_TIMEOUT_S,
        "stop the job when no worker made progress for S seconds while one waits for another; it names "
        "the worker behind and prints every worker's Python stack (default %(default)g; 0: off)",
    ),
    ("--compile-timeout", DEFAULT_COMPILE_TIMEOUT_S, "the same while a worker compiles a step (default %(default)g)"),
    (
        "--failure-window",
        DEFAULT_FAILURE_WINDOW_S,
        "with --min-workers: a worker keeps failing when the failure before was blamed on it too and it fails "
        "again within S seconds after the restart in between (default %(default)g)",
    ),
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m replicator.launch",
        usage="%(prog)s [options] (script.py | -m module) [args ...]",
        description="Run a replicator training script as the workers of a multi-process job.",
        epilog="Example: python -m replicator.launch --num-workers 2 --cores-per-worker 4 train.py --steps 100",
    )
    p.add_argument("--num-workers", type=int, metavar="W", help="workers (processes) in the job")
    p.add_argument(
        "--cores-per-worker", type=int, metavar="C", help="devices per worker; on CPU this many are emulated"
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="HOST:PORT of worker 0 (default for local jobs: 127.0.0.1 at a free port)",
    )
    p.add_argument(
        "--worker-id", type=int, metavar="I", help="start only this worker (one per host; needs --coordinator)"
    )
    for flag, default, text in _SECONDS:
        p.add_argument(flag, type=float, metavar="S", default=default, help=text)
    p.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        default=0,
        help="when a worker fails (killed, an exception, the watchdog), stop the others and start every worker "
        "again, up to N times; workers read the restart number in REPLICATOR_RESTART_COUNT (and "
        "TORCHELASTIC_RESTART_COUNT) and resume from their checkpoints, e.g. Trainer(..., resume_from=DIR). "
        "Local jobs only (default %(default)s: a failure ends the job)",
    )
    p.add_argument(
        "--min-workers",
        type=int,
        metavar="M",
        help="with --max-restarts: when a worker keeps failing (see --failure-window), the next restart runs the "
        "job on one worker fewer, never fewer than M; it counts as a restart. Workers read the new count in "
        "REPLICATOR_NUM_WORKERS and the first start's in REPLICATOR_INITIAL_NUM_WORKERS; a Trainer with "
        "resume_from= restores onto the smaller mesh and keeps the global batch (keep_batch='per-replica' keeps "
        "the rows per replica instead). Default: --num-workers (never fewer)",
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module as the worker's program, like python -m")
    return p


def _split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Launcher options | the worker's command: the first positional or ``-m MOD`` ends the options."""
    takes_value = {opt for a in parser._actions if a.nargs is None and a.option_strings for opt in a.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if arg == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in takes_value else 1
    return list(argv), []


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m replicator.launch`` command; returns the exit code."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    options, rest = _split_argv(argv, parser)
    args = parser.parse_args(options)
    if args.module:
        command = worker_command(rest, module=args.module)
    elif rest:
        command = worker_command(rest)
    else:
        parser.error("give the script to run (train.py [args]) or a module (-m pkg.train [args]).")

    interrupted = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        del frame
        interrupted.signum = signum  # type: ignore[attr-defined]
        interrupted.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return launch(
            command,
            num_workers=args.num_workers,
            cores_per_worker=args.cores_per_worker,
            coordinator=args.coordinator,
            worker_id=args.worker_id,
            start_timeout_s=args.start_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            kill_grace_s=args.kill_grace,
            max_time_s=args.max_time,
            step_timeout_s=args.step_timeout,
            compile_timeout_s=args.compile_timeout,
            max_restarts=args.max_restarts,
            min_workers=args.min_workers,
            failure_window_s=args.failure_window,
            interrupted=interrupted,
        )
    except LaunchError as e:
        parser.error(str(e))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
