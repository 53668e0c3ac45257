"""What the launcher gives a worker: its command line, its environment, a coordinator's port.

A worker runs through the bootstrap (:func:`worker_command`) with the job's
settings in ``REPLICATOR_*`` variables (:func:`worker_env`), which
:func:`replicator.runtime.distributed.initialize` reads. :class:`LaunchError`
is the error for bad launcher arguments.

Promises:

1. A worker's environment has the job's coordinator, worker count, worker
   id, cores per worker and the three timeouts, and keeps the rest of the
   launcher's environment (tests/test_launch.py::TestCommandLine::test_worker_env).
2. A setting not given is removed, never inherited from the launcher's own
   environment (a stale status directory included), and the launcher's
   environment itself is not changed
   (tests/test_launch.py::TestCommandLine::test_worker_env_status_dir,
   tests/test_environment_promises.py::test_worker_env_sets_or_unsets_every_setting_and_leaves_base_alone).
3. The restart count and the most restarts are set under both names,
   ``REPLICATOR_*`` and torchrun's ``TORCHELASTIC_*``; the first start's
   worker count defaults to this start's
   (tests/test_environment_promises.py::test_the_restart_count_and_the_most_restarts_are_under_both_names).
4. ``cores_per_worker`` replaces the device count in ``XLA_FLAGS``, keeping
   the other flags (tests/test_launch.py::TestCommandLine::test_worker_env).
5. Output is unbuffered (``PYTHONUNBUFFERED=1``, ``python -u``), every worker
   runs through the bootstrap (a script, or ``-m module``) and is given the
   launcher's pid to die with it
   (tests/test_environment_promises.py::test_a_worker_runs_through_the_bootstrap_unbuffered,
   tests/test_environment_promises.py::test_worker_env_sets_or_unsets_every_setting_and_leaves_base_alone).
6. A coordinator's port in use on this machine is refused before any worker
   starts, naming the port and a free one to pass
   (tests/test_watchdog.py::TestPortCheck::test_a_port_in_use_is_named_with_another_to_use);
   an address of another machine is not checked
   (tests/test_watchdog.py::TestPortCheck::test_an_address_of_another_machine_is_not_checked).
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Sequence

from replicator.runtime.distributed import bootstrap, progress, startup, status
from replicator.runtime.distributed.startup import free_port
from replicator.runtime.mesh import with_device_count

__all__ = ["TORCHELASTIC_ENV", "LaunchError", "check_port_free", "free_port", "worker_command", "worker_env"]

#: torchrun's names for the restart count and ``--max-restarts``, set as well for familiarity.
TORCHELASTIC_ENV = {
    startup.ENV_RESTART_COUNT: "TORCHELASTIC_RESTART_COUNT",
    startup.ENV_MAX_RESTARTS: "TORCHELASTIC_MAX_RESTARTS",
}


class LaunchError(ValueError):
    """Bad launcher arguments; the message says what to pass."""


def check_port_free(address: str) -> None:
    """Raise :class:`LaunchError` if worker 0 could not open the coordinator's port ``HOST:PORT`` here.

    Checked on the host that runs worker 0, before any worker starts: JAX's own
    error for a port in use ("Failed to start RPC server") names no port. A
    host that is not one of this machine's addresses is not checked.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is no conflict
            s.bind((host, int(port)))
    except socket.gaierror:
        return  # a host name this machine cannot resolve: worker 0 runs elsewhere (JAX will say if not)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"the coordinator's port {port} on {host} is already in use (another job, or one that has not "
                f"ended yet); pass another port, e.g. --coordinator {host}:{free_port(host)}, or leave "
                f"--coordinator out for a local job (a free port is chosen)."
            ) from None
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return  # not an address of this machine: worker 0 runs elsewhere
        raise LaunchError(f"cannot open the coordinator's port {address}: {e}.") from None


def worker_command(args: Sequence[str], module: str | None = None) -> list[str]:
    """The command line of a worker that runs ``script.py args`` (or ``-m module args``) through the bootstrap.

    The bootstrap (:mod:`~replicator.runtime.distributed.bootstrap`) makes the
    worker die with the launcher, report its progress and exit code, and
    print its stacks on ``SIGUSR1``.
    """
    entry = [bootstrap.__file__, "-m", module] if module else [bootstrap.__file__]
    return [sys.executable, "-u", *entry, *args]


def worker_env(
    base: dict[str, str],
    *,
    coordinator: str | None,
    num_workers: int | None,
    worker_id: int | None,
    cores_per_worker: int | None,
    start_timeout_s: float,
    heartbeat_timeout_s: float,
    shutdown_timeout_s: float,
    status_dir: str | None = None,
    progress_file: str | None = None,
    restart_count: int = 0,
    max_restarts: int = 0,
    initial_num_workers: int | None = None,
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the job's settings.

    Args:
      base: the environment to start from.
      coordinator, num_workers, worker_id, cores_per_worker: the job's
        settings (None: unset, e.g. under SLURM).
      start_timeout_s, heartbeat_timeout_s, shutdown_timeout_s: the timeouts.
      status_dir: where the worker writes its status file (None: nowhere).
      progress_file: where the worker writes its progress record (None: nowhere).
      restart_count, max_restarts: how many times the job was restarted before
        this start, and the most it may be (``REPLICATOR_RESTART_COUNT`` and
        ``REPLICATOR_MAX_RESTARTS``, and torchrun's ``TORCHELASTIC_*`` names).
      initial_num_workers: the job's worker count at its first start
        (``REPLICATOR_INITIAL_NUM_WORKERS``; default ``num_workers``): more
        than ``num_workers`` once ``--min-workers`` dropped a worker.

    Returns:
      A new environment dict.
    """
    env = dict(base)
    for name, value in (
        (startup.ENV_COORDINATOR, coordinator),
        (startup.ENV_NUM_WORKERS, num_workers),
        (startup.ENV_WORKER_ID, worker_id),
        (startup.ENV_CORES_PER_WORKER, cores_per_worker),
        (startup.ENV_INITIAL_NUM_WORKERS, num_workers if initial_num_workers is None else initial_num_workers),
        (status.ENV_STATUS_DIR, status_dir),
        (progress.ENV_PROGRESS_FILE, progress_file),
    ):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    env[startup.ENV_START_TIMEOUT] = f"{start_timeout_s:g}"
    env[startup.ENV_HEARTBEAT_TIMEOUT] = f"{heartbeat_timeout_s:g}"
    env[startup.ENV_SHUTDOWN_TIMEOUT] = f"{shutdown_timeout_s:g}"
    for name, value in ((startup.ENV_RESTART_COUNT, restart_count), (startup.ENV_MAX_RESTARTS, max_restarts)):
        env[name] = env[TORCHELASTIC_ENV[name]] = str(value)
    if cores_per_worker is not None:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), cores_per_worker)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
    env[bootstrap.ENV_LAUNCHER_PID] = str(os.getpid())  # the worker dies with this process
    return env
