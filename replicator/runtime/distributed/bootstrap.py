"""The launcher's worker entry point: run the worker's script, report how it ended.

``python -m replicator.launch`` starts every worker as ``python -u <this
file> (script.py | -m module) [args ...]``, which runs the script as ``python
script.py`` would (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]``)
and adds, before the first line of the script:

* **No orphans.** The worker dies with its launcher, however the launcher
  dies (``kill -9`` included): Linux's parent-death signal (``prctl
  PR_SET_PDEATHSIG``, ``SIGKILL``), and a thread that checks every
  :data:`WATCH_INTERVAL_S` that the launcher (``REPLICATOR_LAUNCHER_PID``)
  is still its parent, which also covers other systems and the moment before
  ``prctl`` ran; it kills the worker's whole process group.
* **Stacks on request.** ``SIGUSR1`` prints every thread's Python stack to
  stderr (:mod:`faulthandler`): the launcher's watchdog sends it to a worker
  that stopped making progress, so the log shows where it is stuck.
* **Progress and exit code.** The worker's progress record
  (:mod:`~replicator.runtime.distributed.progress`) is written from the
  start, and its exit code when the script ends, ``sys.exit(n)`` and
  ``raise SystemExit`` included. A worker of a multi-process job that ends
  with a non-zero code exits at once, without waiting in JAX's shutdown
  barrier for peers that are blocked in a collective with it.

It runs by path, not as ``replicator....bootstrap``, so that nothing (JAX
included) is imported before the script: only the standard library and
``progress.py`` (and ``status.py`` to report an exception raised before
``initialize()``), registered under their package names so that the
library, once the script imports it, updates the same record.

Promises:

1. The script runs as ``python script.py`` would: ``__main__``, its ``sys.argv`` and ``sys.path[0]``, nothing
   imported first (tests/test_watchdog.py::TestBootstrap::test_runs_the_script_as_main_with_its_argv_and_path);
   ``-m module`` too (tests/test_watchdog.py::TestBootstrap::test_a_module_runs_with_dash_m).
2. The worker's exit code is the script's, and is in its progress record: ``sys.exit(n)``, ``raise SystemExit``
   (0), a message (1), an exception (1)
   (tests/test_watchdog.py::TestBootstrap::test_the_exit_code_is_the_scripts_and_is_recorded), computed as
   Python does (``n & 0xFF``, None is 0, a bool is an int)
   (tests/test_watchdog.py::test_an_exit_code_is_what_python_would_exit_with).
3. Without a script it prints its usage and returns 2
   (tests/test_watchdog.py::test_bootstrap_without_a_script_is_a_usage_error).
4. An exception raised before ``initialize()`` is written to the launcher's status directory
   (tests/test_watchdog.py::TestBootstrap::test_an_exception_before_initialize_is_reported_to_the_launcher).
5. ``SIGUSR1`` prints every thread's stack (tests/test_watchdog.py::TestBootstrap::test_sigusr1_prints_the_stacks).
6. The worker dies with its launcher, ``kill -9`` included
   (tests/test_watchdog.py::TestBootstrap::test_the_worker_dies_with_its_launcher,
   tests/test_faults.py::test_workers_die_when_the_launcher_is_killed).
7. A worker of a multi-process job that ends with a non-zero code exits at once with it
   (tests/test_faults.py::test_sys_exit_gives_the_workers_own_code_at_once).
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import runpy
import signal
import sys
import threading
import time

ENV_LAUNCHER_PID = "REPLICATOR_LAUNCHER_PID"
WATCH_INTERVAL_S = 0.5
_PACKAGE = "replicator.runtime.distributed"
_ENV_STATUS_DIR = "REPLICATOR_STATUS_DIR"  # status.ENV_STATUS_DIR
_ENV_WORKER_ID = "REPLICATOR_WORKER_ID"  # startup.ENV_WORKER_ID
_PR_SET_PDEATHSIG = 1


def _load(name: str):
    """``<name>.py`` of this package as ``replicator.runtime.distributed.<name>``, shared with the library."""
    full = f"{_PACKAGE}.{name}"
    module = sys.modules.get(full)
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return module


def _report(exc: BaseException) -> None:
    """Report an uncaught exception raised before ``initialize()`` installed its hook to the launcher."""
    directory, worker = os.environ.get(_ENV_STATUS_DIR), os.environ.get(_ENV_WORKER_ID, "")
    if directory and worker.isdigit():
        _load("status").report_exception(directory, int(worker), type(exc), exc)


def _die_with(launcher_pid: int) -> None:
    """End this worker (and its process group) when the launcher ``launcher_pid`` is gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the thread below still watches
            pass

    def watch() -> None:
        while True:
            if os.getppid() != launcher_pid:  # re-parented: the launcher died
                try:
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                finally:
                    os._exit(137)
            time.sleep(WATCH_INTERVAL_S)

    threading.Thread(target=watch, name="replicator-launcher-watch", daemon=True).start()


def _exit_code(exc: SystemExit) -> int:
    """The process exit code of ``SystemExit``, as Python computes it (printing a non-int reason)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _multiprocess_job() -> bool:
    jax = sys.modules.get("jax")
    try:
        return bool(jax and jax.distributed.is_initialized() and jax.process_count() > 1)
    except Exception:  # noqa: BLE001 - a broken runtime: treat as one process
        return False


def run(argv: list[str]) -> int:
    """Run ``script.py args`` or ``-m module args``; return its exit code."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: bootstrap.py (script.py | -m module) [args ...]", file=sys.stderr)
        return 2
    if hasattr(signal, "SIGUSR1"):  # before the first record: the launcher signals only workers that wrote one
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    launcher = os.environ.get(ENV_LAUNCHER_PID, "")
    if launcher.isdigit():
        _die_with(int(launcher))
    progress = _load("progress")
    progress.start_reporting()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        if not progress.joined():  # after initialize() its excepthook reports it
            _report(e)
        progress.mark_exited(130 if isinstance(e, KeyboardInterrupt) else 1)
        raise  # the excepthook prints it
    progress.mark_exited(code)
    if code and _multiprocess_job():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                pass
        os._exit(code)  # not JAX's shutdown barrier: the peers may be blocked in a collective with us
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
