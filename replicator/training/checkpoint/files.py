"""Durable file I/O for checkpoints: fsync, exclusive writes, sha256, removal."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_arrays(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to a new ``.npz`` at ``path`` and fsync it."""
    with open(path, "xb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str, text: str) -> None:
    """Write ``text`` to a new file at ``path`` and fsync it."""
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
