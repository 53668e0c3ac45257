"""The launcher's corners that scripts/mutate.py found untested (benchmarks/results/mutation.md).

Each test here kills a mutant that survived the rest of the launcher's tests: the port check of
worker 0 in a job spread over hosts, the summary of a worker's status file, a status file read
before the worker ended, and the launcher's clean-up of directories that are already gone.
"""

from __future__ import annotations

import glob
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from replicator.launch import LaunchError, blame, processes, supervise
from replicator.runtime.distributed import status


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


class TestMultiHostPlan:
    def test_worker_0_checks_the_coordinator_port(self, busy_port: int) -> None:
        """Worker 0 opens the coordinator's port: one in use fails before anything starts, naming it."""
        with pytest.raises(LaunchError, match=f"port {busy_port} on 127.0.0.1 is already in use"):
            supervise._plan({}, 2, f"127.0.0.1:{busy_port}", 0)

    def test_other_workers_do_not_check_it(self, busy_port: int) -> None:
        """Worker 1 only connects to the coordinator: the port being open (by worker 0) is no error."""
        address = f"127.0.0.1:{busy_port}"
        assert supervise._plan({}, 2, address, 1) == [(1, address, 2)]


def _worker(status_dir: str, ended: float | None) -> processes.Worker:
    """A worker record (its process an already finished ``true``), as the launcher keeps it."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return processes.Worker(
        worker_id=0,
        proc=proc,
        started=time.time(),
        threads=[],
        status_dir=status_dir,
        progress_file=os.path.join(status_dir, "progress-0.json"),
        ended=ended,
    )


class TestStatus:
    def test_a_running_worker_has_no_status_yet(self, tmp_path) -> None:
        """The status file is read once the worker ended: one already there (an earlier start's) is not its own."""
        status.write_status(str(tmp_path), 0, kind="exception", exception_type="ValueError", message="old")
        running = _worker(str(tmp_path), ended=None)
        assert running.status is None
        running.ended = time.time()
        assert running.status is not None and running.status["message"] == "old"

    @pytest.mark.parametrize(
        "kind, exception_type, message, expected",
        [
            ("exception", "ValueError", "bad value\nmore", "ValueError: bad value"),
            ("exception", None, "no type given", "no type given"),  # not "None: no type given"
            ("start-timeout", "TimeoutError", "peers never joined", "peers never joined"),  # only exceptions name one
            ("exception", "KeyError", "", "KeyError"),
        ],
    )
    def test_error_summary(self, tmp_path, kind: str, exception_type: str | None, message: str, expected: str) -> None:
        """``Type: first line`` for an exception with a type, else the message alone."""
        status.write_status(str(tmp_path), 0, kind=kind, exception_type=exception_type, message=message)
        assert blame.error_summary(_worker(str(tmp_path), ended=time.time())) == expected


def _launch(code: str) -> tuple[int, str]:
    """launch() one worker running ``python -c code``; returns (exit code, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "REPLICATOR_"))}
    rc = supervise.launch([sys.executable, "-c", code], num_workers=1, env=env, stdout=out, stderr=err, max_time_s=60)
    return rc, err.getvalue()


class TestCleanUp:
    def test_a_removed_status_directory_is_no_error(self) -> None:
        """The launcher's status directory removed under it (a /tmp cleaner): the job's exit code, no traceback."""
        code = "import os, shutil; shutil.rmtree(os.path.dirname(os.environ['REPLICATOR_STATUS_DIR'])); raise SystemExit(3)"
        rc, err = _launch(code)
        assert rc == 3, err

    def test_a_removed_log_directory_is_no_error(self, tmp_path, monkeypatch) -> None:
        """The same for the temporary directory of the workers' logs, removed at the end when nothing failed."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launcher makes it
        code = f"import glob, shutil; [shutil.rmtree(d) for d in glob.glob({str(tmp_path)!r} + '/replicator-logs-*')]"
        rc, err = _launch(code)
        assert rc == 0, err
        assert not glob.glob(str(tmp_path / "replicator-logs-*"))
