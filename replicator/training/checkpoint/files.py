"""Durable file I/O for checkpoints: fsync, exclusive and atomic writes, sha256, removal.

Promises:

1. :func:`write_arrays` makes a new file: an existing one is refused (``FileExistsError``) and left as it was
   (tests/test_checkpoint_faults.py::test_a_data_file_is_never_written_over).
2. The arrays file, the shard files and the manifest are fsynced before the step directory is renamed into place
   (tests/test_checkpoint.py::test_every_data_file_is_fsynced_before_the_step_directory_is_renamed_into_place).
3. A :func:`write_text` file appears whole or not at all: its name does not exist while the text is written, no
   temporary is left, and an existing file raises ``FileExistsError`` and keeps its text
   (tests/test_checkpoint_faults.py::test_a_polled_file_appears_whole_or_not_at_all).
4. :func:`sha256` is the hex sha256 of the file's bytes, as ``hashlib`` computes it
   (tests/test_checkpoint.py::TestRoundTrip::test_the_files_are_plain_npz_and_json).
5. :meth:`DirectoryLock.acquire` never waits: it returns False while another holder, in this process or another,
   holds the lock (tests/test_checkpoint_faults.py::TestLock::test_a_second_manager_saving_meanwhile_is_refused,
   tests/test_checkpoint_faults.py::TestLock::test_another_process_holding_the_lock).
6. :meth:`DirectoryLock.release` removes the lock file: none is left, and the next writer takes the lock
   (tests/test_checkpoint_faults.py::TestLock::test_a_second_manager_saving_meanwhile_is_refused).
7. A lock file replaced on every try is not taken, and nothing is left locked
   (tests/test_checkpoint.py::test_a_lock_file_replaced_on_every_try_is_not_taken).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

import numpy as np

from replicator.runtime.distributed import progress


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Reporting:
    """A binary file whose every write counts as progress (the launcher's watchdog sees a slow write move)."""

    def __init__(self, f: Any):
        self._f = f

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        progress.touch()
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def write_arrays(path: str, arrays: dict[str, np.ndarray], report: bool = True) -> None:
    """Write ``arrays`` to a new ``.npz`` at ``path`` and fsync it (``report``: each write counts as progress)."""
    with open(path, "xb") as f:
        np.savez(_Reporting(f) if report else f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str, text: str) -> None:
    """Write ``text`` to a new file at ``path``, fsynced, that appears whole or not at all.

    Another process polls for these files (a sidecar, a failure report), so
    the text is written under a temporary name first and then linked to
    ``path``: a reader never sees it empty or half written. Like ``open(path,
    "x")``, it raises ``FileExistsError`` if ``path`` exists.
    """
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.partial")
    try:
        with open(temporary, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temporary, path)  # atomic, and fails if path exists
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links
            if os.path.exists(path):
                raise FileExistsError(path) from None
            os.rename(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def sha256(path: str) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def rmtree(path: str) -> None:
    """Remove a directory tree, ignoring errors (leftovers are tidied by the next save)."""
    shutil.rmtree(path, ignore_errors=True)


class DirectoryLock:
    """An exclusive, non-blocking ``fcntl.flock`` on ``<directory>/<name>``, held by one writer.

    ``acquire`` returns False (it never waits) when another writer, in this
    process or another, holds it. The holder unlinks the lock file before
    releasing it, so none is left behind; a writer that locked a file that was
    unlinked meanwhile sees that its inode is no longer the path's and tries
    again. Without ``fcntl`` (not POSIX) there is no lock.
    """

    def __init__(self, directory: str, name: str):
        self.path = os.path.join(directory, name)
        self._fd: int | None = None

    def acquire(self) -> bool:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return True
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return True
            os.close(fd)  # the holder before us unlinked it: lock the new file
        return False

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None
