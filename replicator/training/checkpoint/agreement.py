"""Multi-process agreement: one writer tells everyone, readers check they read the same."""

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


def agree_on_save(error: Exception | None, final: str) -> None:
    """Process 0 tells every process whether its save succeeded; a collective that all wait in.

    Returns on every process once process 0 has committed the checkpoint (or
    raises on every process if it failed: process 0 its own exception, the
    others a :class:`CheckpointError` that quotes it).
    """
    text = np.zeros(MESSAGE_BYTES, np.uint8)
    if error is not None:
        raw = f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
        text[: len(raw)] = np.frombuffer(raw, np.uint8)
    failed, text = from_process0((np.int32(error is not None), text))
    if jax.process_index() == 0:
        if error is not None:
            raise error
        return
    if failed:
        message = text.tobytes().rstrip(b"\0").decode(errors="replace")
        raise CheckpointError(f"process 0 failed to save the checkpoint {final}: {message}")
