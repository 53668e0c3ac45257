"""Worker status files: how a worker tells the launcher why it stopped.

``python -m replicator.launch`` creates a private directory and passes it to
every worker in ``REPLICATOR_STATUS_DIR``. A worker that stops on an uncaught
exception (or gives up waiting for the others to start) writes
``worker-<id>.json`` there, atomically, before it exits::

    {"worker_id": 1, "pid": 4242, "time": 1700000000.0, "kind": "exception",
     "exception_type": "ValueError", "message": "...", "first_failure": true,
     "runtime_error": false}

``kind`` is ``"exception"`` or ``"start-timeout"``; ``first_failure`` is true
for the first worker of the job (sharing the directory) to fail;
``runtime_error`` is true for an error raised by JAX's runtime (e.g. a
collective broken by a peer that died), which may only echo another worker's
failure. The launcher reads these files, with the exit codes, to say which
worker failed and why. JSON only; nothing is written without the variable.
This module imports only the standard library (the launcher's tests load it
without JAX).

Promises:

1. ``write_status`` writes ``worker-<id>.json`` atomically, leaving no temporary file, and ``read_status`` reads
   it back (tests/test_launch.py::TestStatusFiles::test_write_and_read).
2. ``write_status`` never raises: where it cannot write (a directory gone) it returns None
   (tests/test_launch.py::TestStatusFiles::test_unreadable_files_are_no_report).
3. ``claim_first_failure`` is true for the first caller of a directory only
   (tests/test_launch.py::TestStatusFiles::test_write_and_read), so only the first reported exception is
   marked ``first_failure`` (tests/test_distributed.py::test_a_reported_exception_is_named_as_a_traceback_names_it).
4. ``read_status`` is None for no file, a file that is not JSON, and a record missing a field or holding one of
   another type (``exception_type`` may be None or absent)
   (tests/test_launch.py::TestStatusFiles::test_unreadable_files_are_no_report,
   tests/test_distributed.py::test_a_status_file_missing_a_field_or_with_one_of_another_type_is_no_report).
5. ``report_exception`` names the type as a traceback does (builtins bare, others with their module), puts a
   placeholder for a message whose ``__str__`` fails, and marks JAX runtime errors ``runtime_error``
   (tests/test_distributed.py::test_a_reported_exception_is_named_as_a_traceback_names_it,
   tests/test_distributed.py::TestInitialize::test_uncaught_exceptions_are_reported_to_the_launcher).
6. A worker that fails before ``initialize()`` is reported too, by the bootstrap
   (tests/test_watchdog.py::TestBootstrap::test_an_exception_before_initialize_is_reported_to_the_launcher).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

__all__ = ["ENV_STATUS_DIR", "claim_first_failure", "read_status", "report_exception", "status_path", "write_status"]

#: Set by the launcher: the directory where workers write their status files.
ENV_STATUS_DIR = "REPLICATOR_STATUS_DIR"

_FIRST_FAILURE = "first-failure"
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "worker_id": int,
    "kind": str,
    "exception_type": (str, type(None)),
    "message": str,
    "first_failure": bool,
    "runtime_error": bool,
}


def status_path(directory: str, worker_id: int) -> str:
    """The status file of worker ``worker_id`` in ``directory``."""
    return os.path.join(directory, f"worker-{worker_id}.json")


def claim_first_failure(directory: str) -> bool:
    """True for the first caller in the job (race-free: an exclusive create), else False."""
    try:
        os.close(os.open(os.path.join(directory, _FIRST_FAILURE), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False
    except OSError:  # the directory is gone or not writable: nothing to claim
        return False


def write_status(
    directory: str,
    worker_id: int,
    *,
    kind: str,
    message: str,
    exception_type: str | None = None,
    first_failure: bool = False,
    runtime_error: bool = False,
) -> str | None:
    """Write worker ``worker_id``'s status file atomically (a temporary file, then ``os.replace``).

    Args:
      directory: the launcher's status directory (``REPLICATOR_STATUS_DIR``).
      worker_id: this worker's id.
      kind: ``"exception"`` or ``"start-timeout"``.
      message: what went wrong (``str(exception)`` for an exception).
      exception_type: the exception's type, as a traceback names it
        (``ValueError``, ``pkg.module.MyError``).
      first_failure: whether this worker was the job's first to fail
        (see :func:`claim_first_failure`).
      runtime_error: whether the exception came from JAX's runtime.

    Returns:
      The file's path, or None if it could not be written (never raises:
      this runs while the worker is failing).
    """
    record = {
        "worker_id": worker_id,
        "pid": os.getpid(),
        "time": time.time(),
        "kind": kind,
        "exception_type": exception_type,
        "message": message,
        "first_failure": first_failure,
        "runtime_error": runtime_error,
    }
    path = status_path(directory, worker_id)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".worker-{worker_id}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception:  # noqa: BLE001 - reporting must not hide the worker's own failure
        return None
    return path


def _type_name(exc_type: type[BaseException]) -> str:
    """The exception type's name as a traceback prints it (``ValueError``, ``pkg.mod.MyError``)."""
    module = getattr(exc_type, "__module__", None)
    name = getattr(exc_type, "__qualname__", exc_type.__name__)
    return name if module in (None, "builtins", "__main__") else f"{module}.{name}"


def _is_jax_runtime_error(exc_type: type[BaseException]) -> bool:
    """Whether it is (a subclass of) ``jax.errors.JaxRuntimeError``, without importing JAX."""
    return any(c.__name__ == "JaxRuntimeError" and c.__module__.startswith("jax") for c in exc_type.__mro__)


def report_exception(directory: str, worker_id: int, exc_type: type[BaseException], exc: BaseException) -> None:
    """Write worker ``worker_id``'s uncaught exception as its status file."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure
        message = f"<{exc_type.__name__} with an unprintable message>"
    write_status(
        directory,
        worker_id,
        kind="exception",
        exception_type=_type_name(exc_type),
        message=message,
        first_failure=claim_first_failure(directory),
        runtime_error=_is_jax_runtime_error(exc_type),
    )


def read_status(directory: str, worker_id: int) -> dict[str, Any] | None:
    """Worker ``worker_id``'s status, or None if it wrote none (or an unreadable one)."""
    try:
        with open(status_path(directory, worker_id)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    for name, kind in _FIELDS.items():
        if not isinstance(record.get(name), kind):
            return None
    return record
