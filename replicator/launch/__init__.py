"""Start a multi-worker job: ``python -m replicator.launch [options] script.py [args]``.

Each worker is a process that runs the same script; the script calls
:func:`replicator.runtime.distributed.initialize` first, which reads the settings the
launcher passes in environment variables (``REPLICATOR_COORDINATOR``,
``REPLICATOR_NUM_WORKERS``, ``REPLICATOR_WORKER_ID``,
``REPLICATOR_CORES_PER_WORKER`` and the timeouts). Every line a worker prints
is prefixed with ``[worker I] ``; the launcher's own lines with
``[launcher] ``.

Four ways to run::

    # all workers on this machine (coordinator on 127.0.0.1, a free port):
    python -m replicator.launch --num-workers 2 --cores-per-worker 4 train.py --steps 100

    # across hosts, torchrun's way: the same on every host; the launchers agree through the
    # rendezvous (served by the one that can open it) on hosts, worker ids and restarts
    python -m replicator.launch --nnodes 1:4 --rdzv-endpoint 10.0.0.1:29400 --rdzv-secret-file S --max-restarts 3 train.py

    # one worker per host: run this on every host, I = 0 on the coordinator's host
    python -m replicator.launch --coordinator 10.0.0.1:29500 --num-workers 4 --worker-id I train.py

    # under SLURM (srun) or Open MPI (mpirun), one task per worker: JAX reads the cluster's settings
    srun -n 4 python -m replicator.launch train.py

torchrun's spellings work where they mean the same (``--nproc-per-node 2`` is
``--num-workers 2``; :data:`~replicator.launch.cli.TORCHRUN`), and are refused
with what to pass where they do not (``--rdzv-backend etcd``); a script that does not
exist is refused before any worker starts. Runtime chatter (Gloo's connection
lines) is left out unless ``--show-runtime-logs``; when a worker fails, the
launcher's diagnosis comes first and the other workers' consequential errors
one line each; every worker's whole output is kept in ``--log-dir``
(:mod:`~replicator.launch.relay`).

``--cores-per-worker C`` emulates ``C`` CPU devices per worker on CPU (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=C``; other platforms ignore
it) and tells the script through ``REPLICATOR_CORES_PER_WORKER``; on a GPU
host each local worker sees all of the host's GPUs, so run one worker per GPU
host there (multi-host mode). A module can
be run instead of a script: ``python -m replicator.launch --num-workers 2 -m
pkg.train``.

Nothing waits forever. When a worker exits with an error or is killed, the
launcher says which and why, stops the others (``SIGTERM``, then ``SIGKILL``
after ``--kill-grace`` seconds: JAX catches ``SIGTERM``) and exits with that
worker's exit code (``128 + signal`` for a signal), within about
``--kill-grace`` seconds. Workers started apart (several hosts) also end on
their own: a worker that does not join within ``--start-timeout`` makes the
others exit (code 75); a worker that dies is noticed by the others after
``--heartbeat-timeout`` seconds (default 10; JAX's own default is 100).
``--max-time`` bounds the whole job.

Each worker runs through :mod:`~replicator.runtime.distributed.bootstrap`
(``python -u bootstrap.py script.py args``): it dies with the launcher
(however the launcher dies), prints its Python stacks on ``SIGUSR1``, reports
its exit code (``sys.exit(n)`` included) and its progress. The watchdog
(:mod:`~replicator.launch.watchdog`) reads the progress: when no worker has
moved for ``--step-timeout`` seconds (default 20) while one waits for
another, it names the worker behind and where it is, asks every worker for
its stacks and ends the job with code 76; a worker whose script ended with 0
while the others went on to a step it will never run is named at once (76),
one that ended before joining the job too (75).

Why a worker failed comes from a structured signal, not from its log: the
launcher passes each worker a private directory in ``REPLICATOR_STATUS_DIR``,
where :func:`~replicator.runtime.distributed.initialize`'s exception hook
writes ``worker-<id>.json`` (the exception's type and message, and whether it
was the job's first failure; see :mod:`replicator.runtime.distributed.status`).
The launcher blames the first worker that failed on its own (not one aborted
by JAX, timed out at start-up, or hit by a runtime error after a peer failed),
using those files and the exit codes.

With ``--max-restarts N`` a failure (a worker killed, an exception, the
watchdog) does not end a local job: the launcher stops the other workers, then
starts them all again, on a new coordinator port, up to ``N`` times, with the
restart number in ``REPLICATOR_RESTART_COUNT`` (and torchrun's
``TORCHELASTIC_RESTART_COUNT``); a script whose ``Trainer`` has
``resume_from=`` goes on from its newest checkpoint. Each restart is logged with
its cause and how long the recovery took (see :mod:`~replicator.launch.restarts`).
With ``--min-workers M`` a worker that keeps failing (blamed again within
``--failure-window`` seconds after its restart) is left behind: the next
restart runs one worker fewer, never fewer than ``M``, with the first start's
count in ``REPLICATOR_INITIAL_NUM_WORKERS``; a ``Trainer`` with ``resume_from=``
goes on on the smaller mesh, the global batch kept.

Library use: :func:`launch` runs a job and returns its exit code; its options
(timeouts, restarts, the watchdog, the rendezvous's timing, the logs) are a
:class:`LaunchOptions`, the command line's defaults when left out::

    from replicator.launch import LaunchOptions, launch

    code = launch([sys.executable, "train.py"], num_workers=2, options=LaunchOptions(max_restarts=3))

Modules: :mod:`~replicator.launch.environment` (a worker's command line and
environment, the coordinator's port), :mod:`~replicator.launch.processes`
(starting, prefixing and stopping worker processes), :mod:`~replicator.launch.relay`
(what of a worker's output is shown, and its log file),
:mod:`~replicator.launch.blame` (which failed worker to blame, in words),
:mod:`~replicator.launch.watchdog` (verdicts on the workers' progress),
:mod:`~replicator.launch.supervise` (the supervision loop and :func:`launch`),
:mod:`~replicator.launch.restarts` (which endings are restarted, timing recoveries),
:mod:`~replicator.launch.options` (:class:`LaunchOptions`: the options, their defaults and checks),
:mod:`~replicator.launch.cli` (the command line, :func:`main`).
"""

from replicator.launch.cli import main
from replicator.launch.environment import LaunchError, check_port_free, free_port, worker_command, worker_env
from replicator.launch.options import LaunchOptions
from replicator.launch.processes import DEFAULT_KILL_GRACE_S
from replicator.launch.supervise import launch

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "LaunchError",
    "LaunchOptions",
    "check_port_free",
    "free_port",
    "launch",
    "main",
    "worker_command",
    "worker_env",
]
