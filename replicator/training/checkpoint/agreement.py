"""Multi-process agreement: one writer tells everyone, readers check they read the same.

Promises:

1. :func:`share_temporary`: process 0 gets its own temporary's name back, or raises its own exception (the same
   object) (tests/test_checkpoint.py::test_process_zero_learns_its_own_temporary_and_raises_its_own_error).
2. Every other process takes part in the collective and gets process 0's name, or a CheckpointError quoting
   process 0's error
   (tests/test_checkpoint.py::test_a_process_other_than_zero_learns_the_temporary_or_raises_process_zeros_error_quoted).
3. :func:`agree_written`: a process that failed raises its own exception, every other one a CheckpointError
   naming the first process that failed and its error; nothing is raised where all wrote theirs
   (tests/test_checkpoint.py::test_a_process_that_wrote_its_part_names_the_first_process_that_did_not,
   tests/test_checkpoint_sharded.py::test_a_process_that_fails_to_write_its_shards_fails_the_save_everywhere).
4. An :class:`Attempt` raises as usual alone; in a multi-process job it keeps an ``Exception`` for the collective,
   never a ``KeyboardInterrupt``
   (tests/test_checkpoint.py::test_an_attempt_keeps_an_exception_only_in_a_multi_process_job_and_never_a_keyboard_interrupt).
5. An error message reaches the other processes whole up to :data:`MESSAGE_BYTES` bytes, else cut there, and
   packing it never raises (which would leave the others waiting in the collective), whatever it holds: a path's
   undecodable byte (a lone surrogate) arrives as a ``\\udcxx`` escape
   (tests/test_checkpoint.py::test_an_error_message_reaches_the_other_processes_whole_or_cut_at_its_bound).
6. Processes that read different checkpoints get a CheckpointError (not a bare ValueError) that says to restore
   the same directory and step on every process
   (tests/test_checkpoint.py::test_processes_that_read_different_checkpoints_get_a_checkpoint_error).
"""

from __future__ import annotations

import jax
import numpy as np

from replicator.runtime.distributed.agreement import check_same_across_workers, from_process0
from replicator.training.checkpoint.encoding import CheckpointError

MESSAGE_BYTES = 2048  # of process 0's error, sent to the other processes when its save fails


def check_same_checkpoint(what_was_read: str) -> None:
    """Check that every process read the same checkpoint (or failed the same way); one collective."""
    try:
        check_same_across_workers(
            [what_was_read],
            ["the checkpoint read (its step and sha256, or the error)"],
            what="the restored checkpoint",
            fix=(
                "Every process must restore the same checkpoint: keep the checkpoint directory on a file "
                "system that every process reads (a shared one), and pass the same directory and step= "
                "on every process."
            ),
        )
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from None


class Attempt:
    """A part of a save, as a ``with`` block: alone it raises as usual; in a multi-process job its exception is
    kept in ``error`` instead, for the collective that follows to raise on every process.

    Example::

        attempt = Attempt(multi=True)
        with attempt:
            raise OSError("disk full")
        assert isinstance(attempt.error, OSError)
    """

    def __init__(self, multi: bool):
        self.multi = multi
        self.error: Exception | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> bool:
        if self.multi and isinstance(error, Exception):
            self.error = error
            return True
        return False


def _pack(text: str) -> np.ndarray:
    raw = text.encode(errors="backslashreplace")[:MESSAGE_BYTES]  # a lone surrogate (a path's undecodable byte)
    out = np.zeros(MESSAGE_BYTES, np.uint8)
    out[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def _unpack(packed: np.ndarray) -> str:
    return np.asarray(packed, np.uint8).tobytes().rstrip(b"\0").decode(errors="replace")


def share_temporary(error: Exception | None, temporary: str, final: str) -> str:
    """Process 0 tells every process the temporary directory it made (or why it could not); a collective.

    Returns ``temporary``'s name (a file name, the same on every process), or
    raises on every process: process 0 its own exception, the others a
    :class:`CheckpointError` that quotes it.
    """
    text = f"{type(error).__name__}: {error}" if error is not None else temporary
    failed, packed = from_process0((np.int32(error is not None), _pack(text)))
    if jax.process_index() == 0 and error is not None:
        raise error
    if failed:
        raise CheckpointError(f"process 0 failed to save the checkpoint {final}: {_unpack(packed)}")
    return _unpack(packed)


def agree_on_save(error: Exception | None, final: str) -> None:
    """Process 0 tells every process whether its save succeeded; a collective that all wait in.

    Returns on every process once process 0 has committed the checkpoint (or
    raises on every process if it failed: process 0 its own exception, the
    others a :class:`CheckpointError` that quotes it).
    """
    share_temporary(error, "", final)


def agree_written(error: Exception | None, final: str) -> None:
    """Every process says whether it wrote its part of the checkpoint; a collective that all wait in.

    Returns on every process if all wrote theirs, else raises on every process
    (the one that failed its own exception, the others a
    :class:`CheckpointError` naming the first process that failed and why).
    """
    from jax.experimental import multihost_utils

    text = f"{type(error).__name__}: {error}" if error is not None else ""
    failed, packed = multihost_utils.process_allgather((np.int32(error is not None), _pack(text)))
    failed = np.asarray(failed).reshape(-1)
    if error is not None:
        raise error
    if failed.any():
        first = int(np.flatnonzero(failed)[0])
        message = _unpack(np.asarray(packed).reshape(len(failed), MESSAGE_BYTES)[first])
        raise CheckpointError(
            f"process {first} failed to write its part of the checkpoint {final}, so it was not saved: {message}"
        )
