"""Process start-up of a multi-worker job: settings, ``initialize``, ``shutdown``, failing fast.

:func:`initialize` reads the job's settings (arguments, the launcher's
``REPLICATOR_*`` variables, or a SLURM / Open MPI environment), starts JAX's
distributed runtime with bounded timeouts, and makes failures end the job
instead of hanging it: a worker that does not join within the start-up
timeout makes the others exit (code :data:`START_TIMEOUT_EXIT_CODE`); a worker
that dies is noticed by the others within the heartbeat timeout (JAX then
aborts them); an uncaught exception ends its worker at once (exit code 1)
rather than after JAX's shutdown barrier, and is reported to the launcher
(see :mod:`replicator.runtime.distributed.status`).

Promises:

1. Without settings ``initialize()`` is a single process: ``WorkerInfo(0, 1, None, None, 'single-process')``,
   returned again by a later call; a later call with other settings is a ``RuntimeError``
   (tests/test_distributed.py::TestInitialize::test_single_process_without_settings).
2. A one-worker job from the launcher needs no distributed runtime
   (tests/test_distributed.py::TestInitialize::test_one_worker_from_the_launcher_needs_no_runtime).
3. Incomplete or malformed settings are a ``ValueError`` naming what to set: a missing worker id or
   coordinator, an address that is not ``HOST:PORT``, a worker id out of range
   (tests/test_distributed.py::TestInitialize::test_bad_settings_say_what_to_set), a timeout that is not a
   positive number (tests/test_distributed.py::TestInitialize::test_bad_timeout), a variable that is not an
   integer, a timeout of ``inf`` or ``nan`` from the environment, ``cores_per_worker=0``, worker 1 of a
   one-worker job, 0 workers; a refused call initializes nothing
   (tests/test_distributed.py::test_a_setting_that_is_not_a_number_or_out_of_range_is_a_value_error_naming_it).
4. Called after JAX started its backend it is a ``RuntimeError`` that says to call it first
   (tests/test_distributed.py::TestInitialize::test_after_jax_started_says_to_call_it_first).
5. Under the launcher an uncaught exception is reported (first failure, JAX runtime error) and handed to the
   previous hook; without it the hook is left alone
   (tests/test_distributed.py::TestInitialize::test_uncaught_exceptions_are_reported_to_the_launcher,
   tests/test_distributed.py::TestInitialize::test_no_report_without_the_launcher).
6. SLURM and Open MPI are detected only with all their variables, and the rank read from them
   (tests/test_distributed.py::TestInitialize::test_cluster_detection,
   tests/test_launch.py::TestOtherModes::test_under_slurm_one_worker_reads_the_cluster).
7. A worker that never starts makes the others exit with ``START_TIMEOUT_EXIT_CODE`` after the start-up
   timeout (tests/test_distributed.py::TestTwoProcesses::test_a_worker_that_never_starts); a worker that fails
   or hangs ends the job, the survivors exiting on their own
   (tests/test_distributed.py::TestTwoProcesses::test_a_failed_worker_stops_the_job,
   tests/test_distributed.py::TestTwoProcesses::test_a_hung_worker_is_dropped_after_the_heartbeat_timeout,
   tests/test_distributed.py::TestTwoProcesses::test_survivors_exit_on_their_own).
8. A script the launcher started as one of several workers that never called ``initialize()`` is told to
   (tests/test_faults.py::test_a_script_that_forgot_initialize_is_told_to_call_it).
9. ``restart_count()`` is 0 and ``initial_num_workers()`` None outside the launcher, else its variables
   (tests/test_distributed.py::test_the_restart_count_and_the_first_worker_count_come_from_the_launcher).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax

from replicator._jax_compat import backends_initialized
from replicator.runtime.distributed import progress
from replicator.runtime.distributed.status import ENV_STATUS_DIR, report_exception, write_status
from replicator.runtime.mesh import force_cpu_devices

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "ENV_CORES_PER_WORKER",
    "ENV_COORDINATOR",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_INITIAL_NUM_WORKERS",
    "ENV_MAX_RESTARTS",
    "ENV_NUM_WORKERS",
    "ENV_RESTART_COUNT",
    "ENV_SHUTDOWN_TIMEOUT",
    "ENV_START_TIMEOUT",
    "ENV_WORKER_ID",
    "START_TIMEOUT_EXIT_CODE",
    "WorkerInfo",
    "check_initialized_under_launcher",
    "cluster_environment",
    "cluster_rank",
    "free_port",
    "initial_num_workers",
    "initialize",
    "is_initialized",
    "restart_count",
    "shutdown",
]

# Set by `python -m replicator.launch` for each worker it starts.
ENV_COORDINATOR = "REPLICATOR_COORDINATOR"
ENV_NUM_WORKERS = "REPLICATOR_NUM_WORKERS"
ENV_WORKER_ID = "REPLICATOR_WORKER_ID"
ENV_CORES_PER_WORKER = "REPLICATOR_CORES_PER_WORKER"
ENV_START_TIMEOUT = "REPLICATOR_START_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "REPLICATOR_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "REPLICATOR_SHUTDOWN_TIMEOUT"
#: How many times the launcher restarted the job before starting this worker (0: the first
#: start), and its ``--max-restarts``; torchrun's ``TORCHELASTIC_RESTART_COUNT`` and
#: ``TORCHELASTIC_MAX_RESTARTS`` are set to the same values.
ENV_RESTART_COUNT = "REPLICATOR_RESTART_COUNT"
ENV_MAX_RESTARTS = "REPLICATOR_MAX_RESTARTS"
#: The job's worker count at its first start: ``--min-workers`` may restart it on fewer
#: (``REPLICATOR_NUM_WORKERS``), after a worker kept failing.
ENV_INITIAL_NUM_WORKERS = "REPLICATOR_INITIAL_NUM_WORKERS"

DEFAULT_START_TIMEOUT_S = 120.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0

#: Exit code of a worker that gave up waiting for the others to join (EX_TEMPFAIL).
START_TIMEOUT_EXIT_CODE = 75

# Cluster managers whose environment jax.distributed reads by itself: the
# variables that must all be present, as JAX's own detection checks them.
_CLUSTER_ENVS: dict[str, tuple[str, ...]] = {
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    "ompi": ("OMPI_MCA_orte_hnp_uri",),
}
_CLUSTER_RANK = {"slurm": "SLURM_PROCID", "ompi": "OMPI_COMM_WORLD_RANK"}
_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Where this process stands in the job, as :func:`initialize` found it.

    Attributes:
      worker_id: this process's worker, ``0 <= worker_id < num_workers``.
      num_workers: processes (workers) in the job.
      cores_per_worker: devices per worker if the launcher or the caller said
        (pass it on to ``Replicator``), else ``None`` (all local devices).
      coordinator_address: ``HOST:PORT`` of worker 0's coordination service,
        or ``None`` in a single process (and under SLURM / Open MPI, where JAX
        derives it from the cluster's environment).
      source: where the settings came from: ``'arguments'``, ``'launcher'``
        (environment variables), ``'slurm'``, ``'ompi'``, ``'jax'`` (JAX's
        distributed runtime was already up) or ``'single-process'``.
    """

    worker_id: int
    num_workers: int
    cores_per_worker: int | None
    coordinator_address: str | None
    source: str

    @property
    def is_multiprocess(self) -> bool:
        return self.num_workers > 1


_LOCK = threading.Lock()
_INFO: WorkerInfo | None = None


def cluster_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """``'slurm'`` or ``'ompi'`` if this process was started by one, else None.

    Args:
      environ: the environment to look at (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    for name, variables in _CLUSTER_ENVS.items():
        if all(v in environ for v in variables):
            return name
    return None


def cluster_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as the cluster manager numbers it, if any."""
    environ = os.environ if environ is None else environ
    env = cluster_environment(environ)
    value = environ.get(_CLUSTER_RANK[env], "") if env else ""
    return int(value) if value.isdigit() else None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer.") from None


def _timeout(value: float | None, env: str, default: float, what: str) -> float:
    if value is None:
        raw = os.environ.get(env)
        value = default if raw in (None, "") else float(raw)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}.")
    return float(value)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it), e.g. for a local job's coordinator."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address {address!r} is not HOST:PORT; give worker 0's host and a free port, "
            f"e.g. '10.0.0.1:29500' (or '127.0.0.1:29500' for workers on this machine)."
        )
    return host, int(port)


def _check_worker(worker_id: int, num_workers: int) -> None:
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}.")
    if not isinstance(worker_id, int) or not 0 <= worker_id < num_workers:
        raise ValueError(
            f"worker_id must be an int in [0, {num_workers}) for a job of {num_workers} workers, "
            f"got {worker_id!r}; number the workers 0, 1, ..., {num_workers - 1}, worker 0 on the "
            f"coordinator's host."
        )


def check_initialized_under_launcher() -> None:
    """Raise if ``python -m replicator.launch`` started this process as a worker of a job that it has not joined.

    Without ``initialize()`` each worker would see only its own devices and
    train alone (or fail to find as many devices as the job has).
    """
    workers = os.environ.get(ENV_NUM_WORKERS, "")
    if workers.isdigit() and int(workers) > 1 and not is_initialized():
        raise RuntimeError(
            f"this process was started by python -m replicator.launch as worker "
            f"{os.environ.get(ENV_WORKER_ID, '?')} of {workers}, but it has not joined the job: call "
            f"`info = replicator.runtime.distributed.initialize()` at the top of the script (before anything "
            f"uses JAX), then `Replicator(info.num_workers, info.cores_per_worker)`."
        )


def restart_count() -> int:
    """How many times ``python -m replicator.launch --max-restarts N`` restarted this job (0: its first start).

    Read from ``REPLICATOR_RESTART_COUNT``; 0 outside the launcher. A script
    resumes from its checkpoints whatever the count (``Trainer(...,
    resume_from=directory)``); the count is for logs, or for doing something
    once per start.
    """
    return _env_int(ENV_RESTART_COUNT) or 0


def initial_num_workers() -> int | None:
    """The job's worker count at its first start, before ``--min-workers`` dropped any (None: not launched).

    Read from ``REPLICATOR_INITIAL_NUM_WORKERS``; compare it with the current
    count (``REPLICATOR_NUM_WORKERS``, ``initialize().num_workers``) to tell
    whether the job goes on without some of its workers.
    """
    return _env_int(ENV_INITIAL_NUM_WORKERS)


def is_initialized() -> bool:
    """True once :func:`initialize` has run in this process (or JAX's runtime is up)."""
    return _INFO is not None or jax.distributed.is_initialized()


def initialize(
    coordinator_address: str | None = None,
    num_workers: int | None = None,
    worker_id: int | None = None,
    *,
    cores_per_worker: int | None = None,
    init_timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    shutdown_timeout_s: float | None = None,
    fail_fast: bool = True,
) -> WorkerInfo:
    """Join this process to a multi-worker job (or do nothing in a single process).

    Call it at the top of the script, before anything starts JAX's backend
    (``jax.devices()``, creating an array). Settings come, in order, from the
    arguments, from the environment variables set by ``python -m
    replicator.launch`` (``REPLICATOR_COORDINATOR``, ``REPLICATOR_NUM_WORKERS``,
    ``REPLICATOR_WORKER_ID``, ``REPLICATOR_CORES_PER_WORKER`` and the
    ``REPLICATOR_*_TIMEOUT`` ones), or from a SLURM / Open MPI environment,
    which JAX reads itself. With none of them this is a single-process job and
    nothing is initialized. Calling it again returns the same
    :class:`WorkerInfo`.

    On CPU the cross-process collectives go through gloo. Start-up is over
    when every worker has joined and exchanged its devices; a worker missing
    after ``init_timeout_s`` makes this one print which and exit with code
    :data:`START_TIMEOUT_EXIT_CODE`. Under the launcher
    (``REPLICATOR_STATUS_DIR`` set) an uncaught exception or a start-up
    timeout is also written to the launcher's status directory, which is how
    the launcher says why a worker failed.

    Args:
      coordinator_address: ``HOST:PORT`` of worker 0, which runs the
        coordination service there (on a loopback host it binds to loopback
        only, otherwise to all interfaces).
      num_workers: processes in the job, one worker each.
      worker_id: this process's worker id, ``0 <= worker_id < num_workers``.
      cores_per_worker: devices per worker. On CPU this many devices are
        emulated per process (before JAX starts). Returned in the info so the
        script can pass it to ``Replicator``.
      init_timeout_s: how long to wait for every worker to join (default
        ``REPLICATOR_START_TIMEOUT`` or 120 s).
      heartbeat_timeout_s: after how long without heartbeats a worker counts
        as dead; the others then abort (default ``REPLICATOR_HEARTBEAT_TIMEOUT``
        or 10 s; JAX's own default is 100 s).
      shutdown_timeout_s: how long a finishing worker waits for the others at
        exit (default ``REPLICATOR_SHUTDOWN_TIMEOUT`` or 30 s).
      fail_fast: on an uncaught exception, print it and exit at once with
        code 1 instead of waiting in JAX's shutdown barrier for workers that
        are blocked in a collective with this one.

    Returns:
      A :class:`WorkerInfo` with this process's worker id and the job's size.

    Raises:
      ValueError: on incomplete or malformed settings (the message says which
        argument or variable to set).
      RuntimeError: if JAX's backend already started (the fix: call this
        first), or if called again with different settings.
    """
    global _INFO
    with _LOCK:
        if _INFO is not None:
            _check_same(_INFO, coordinator_address, num_workers, worker_id, cores_per_worker)
            return _INFO
        if jax.distributed.is_initialized():  # started by someone else: adopt it
            _INFO = WorkerInfo(jax.process_index(), jax.process_count(), cores_per_worker, None, "jax")
            progress.mark_joined()
            return _INFO

        status_dir = os.environ.get(ENV_STATUS_DIR) or None
        source = "arguments"
        if coordinator_address is None and num_workers is None and worker_id is None:
            env_values = (os.environ.get(ENV_COORDINATOR), _env_int(ENV_NUM_WORKERS), _env_int(ENV_WORKER_ID))
            if any(v is not None for v in env_values):
                coordinator_address, num_workers, worker_id = env_values
                source = "launcher"
            else:
                source = cluster_environment() or "single-process"
        if cores_per_worker is None:
            cores_per_worker = _env_int(ENV_CORES_PER_WORKER)
        if cores_per_worker is not None and (not isinstance(cores_per_worker, int) or cores_per_worker < 1):
            raise ValueError(f"cores_per_worker must be a positive int, got {cores_per_worker!r}.")
        init_s = _timeout(init_timeout_s, ENV_START_TIMEOUT, DEFAULT_START_TIMEOUT_S, "init_timeout_s")
        heartbeat_s = _timeout(
            heartbeat_timeout_s, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S, "heartbeat_timeout_s"
        )
        shutdown_s = _timeout(
            shutdown_timeout_s, ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT_S, "shutdown_timeout_s"
        )

        if source == "single-process" or (num_workers == 1 and source in ("arguments", "launcher")):
            if worker_id not in (None, 0):
                _check_worker(worker_id, 1)
            if cores_per_worker is not None:
                force_cpu_devices(cores_per_worker)
            _INFO = WorkerInfo(0, 1, cores_per_worker, None, source)
            progress.mark_joined()
            if status_dir:
                _install_excepthook(0, status_dir, exit_now=False)
            return _INFO

        if source in ("arguments", "launcher"):
            missing = [
                name
                for name, value in (
                    ("coordinator_address", coordinator_address),
                    ("num_workers", num_workers),
                    ("worker_id", worker_id),
                )
                if value is None
            ]
            if missing:
                raise ValueError(
                    f"initialize() got only part of a multi-worker job's settings: {', '.join(missing)} "
                    f"missing. Give all three (coordinator_address='HOST:PORT', num_workers=W, worker_id=I), "
                    f"set {ENV_COORDINATOR}, {ENV_NUM_WORKERS} and {ENV_WORKER_ID}, or start the script "
                    f"with `python -m replicator.launch --num-workers W script.py`."
                )
            assert coordinator_address is not None and num_workers is not None and worker_id is not None
            _check_address(coordinator_address)
            _check_worker(worker_id, num_workers)

        if backends_initialized():
            raise RuntimeError(
                "replicator.runtime.distributed.initialize() must run before JAX starts its backend, but "
                "jax.devices() was already called or an array was already created. Call it at the "
                "top of your script, right after the imports."
            )
        if cores_per_worker is not None:
            force_cpu_devices(cores_per_worker)
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")

        kwargs: dict[str, Any] = {}
        if source in ("arguments", "launcher"):
            host, _ = _check_address(coordinator_address)  # type: ignore[arg-type]
            kwargs = {"coordinator_address": coordinator_address, "num_processes": num_workers, "process_id": worker_id}
            if host in _LOOPBACK_HOSTS:
                kwargs["coordinator_bind_address"] = coordinator_address
            who, me = f"worker {worker_id} of {num_workers}", worker_id
        else:
            me = cluster_rank()
            who = f"process {me} of a {source} job"
        where = f" at {coordinator_address}" if coordinator_address else ""

        timer = threading.Timer(init_s, _start_timed_out, args=(who, where, init_s, status_dir, me))
        timer.daemon = True
        timer.start()
        progress.set_phase("joining")
        try:
            jax.distributed.initialize(
                **kwargs,
                initialization_timeout=math.ceil(init_s) + 10,  # ours fires first, with a message
                heartbeat_timeout_seconds=max(1, math.ceil(heartbeat_s)),
                shutdown_timeout_seconds=max(1, math.ceil(shutdown_s)),
            )
            jax.devices()  # every worker exchanges its devices: part of start-up
        except jax.errors.JaxRuntimeError as e:
            if "Failed to start RPC server" in str(e) and coordinator_address:
                raise RuntimeError(
                    f"worker 0 could not open the coordinator's port at {coordinator_address}: it is probably in "
                    f"use (another job, or one that has not ended yet). Pass another port (python -m "
                    f"replicator.launch picks a free one when --coordinator is left out). JAX said: {e}"
                ) from None
            raise
        finally:
            timer.cancel()
        _INFO = WorkerInfo(
            jax.process_index(),
            jax.process_count(),
            cores_per_worker,
            coordinator_address,  # None when JAX read it from the cluster's environment
            source,
        )
        progress.mark_joined()
        exit_now = fail_fast and _INFO.is_multiprocess
        if exit_now or status_dir:
            _install_excepthook(_INFO.worker_id, status_dir, exit_now=exit_now)
        return _INFO


def _check_same(
    info: WorkerInfo,
    coordinator_address: str | None,
    num_workers: int | None,
    worker_id: int | None,
    cores_per_worker: int | None,
) -> None:
    asked = {
        "num_workers": num_workers,
        "worker_id": worker_id,
        "cores_per_worker": cores_per_worker,
        "coordinator_address": coordinator_address,
    }
    for name, value in asked.items():
        if value is not None and value != getattr(info, name):
            raise RuntimeError(
                f"replicator.runtime.distributed.initialize() already ran in this process with {name}="
                f"{getattr(info, name)!r}; it cannot be re-initialized with {name}={value!r}. "
                f"Initialize once per process, at the top of the script."
            )


def _start_timed_out(who: str, where: str, timeout_s: float, status_dir: str | None, me: int | None) -> None:
    """Watchdog: not every worker joined in time. Say so, and exit (no core dump)."""
    message = (
        f"{who} gave up after {timeout_s:g} s waiting for every worker to join the job"
        f"{where}. A worker was not started, crashed before initialize(), or uses another "
        f"coordinator address, port or worker count. Fix: start every worker with the same "
        f"--coordinator and --num-workers and a distinct --worker-id (0 on the coordinator's host), "
        f"check that the port is reachable, or allow more time with --start-timeout / init_timeout_s."
    )
    if status_dir and me is not None:
        write_status(status_dir, me, kind="start-timeout", message=message)
    sys.stderr.write(f"replicator: {message}\n")
    sys.stderr.flush()
    os._exit(START_TIMEOUT_EXIT_CODE)


def _install_excepthook(worker_id: int, status_dir: str | None, *, exit_now: bool) -> None:
    """Report an uncaught exception to the launcher and, with ``exit_now``, end the process at once.

    At exit JAX waits (up to the shutdown timeout) for every worker to reach a
    shutdown barrier; peers blocked in a collective with this worker never do,
    so without ``exit_now`` the job would hang for that long and then abort
    everywhere.
    """
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            if status_dir:
                report_exception(status_dir, worker_id, exc_type, exc)
            previous(exc_type, exc, tb)
            if exit_now:
                sys.stderr.write(
                    f"replicator: worker {worker_id} stopped by the uncaught {exc_type.__name__} above; "
                    f"exiting now so that the other workers are not kept waiting for it.\n"
                )
        finally:
            if exit_now:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                        pass
                os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    sys.excepthook = excepthook


def shutdown() -> None:
    """Leave the job (JAX's shutdown barrier: waits for the other workers)."""
    global _INFO
    with _LOCK:
        jax.distributed.shutdown()
        _INFO = None
