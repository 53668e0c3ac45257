"""Checking that every worker of a job holds the same host values (e.g. compiled the same step).

Used by the runtime before a compiled step first runs and by checkpoint
restore: a worker that disagrees would otherwise hang in, or silently corrupt,
the next collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["check_same_across_workers", "from_process0"]


def _digest(x: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of an array's dtype, shape and bytes, as two int32s."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{x.dtype.str}{x.shape}".encode())
    h.update(np.ascontiguousarray(x).tobytes())
    return np.frombuffer(h.digest(), dtype=np.int32)


def check_same_across_workers(values: Sequence[Any], names: Sequence[str], *, what: str, fix: str) -> None:
    """Check that each host value is identical in every process (one collective).

    Every process must call it with the same number of values. In a single
    process it does nothing (no collective).

    Args:
      values: host arrays (or anything ``np.asarray`` takes), or strings.
      names: a name for each value, for the error message.
      what: what the values are, e.g. ``"the state"``.
      fix: the sentence that tells the user how to make them agree.

    Raises:
      ValueError: naming the values that differ and the workers that disagree
        with worker 0, followed by ``fix``.
    """
    if jax.process_count() == 1 or not values:
        return
    from jax.experimental import multihost_utils

    local = np.concatenate(
        [_digest(np.frombuffer(v.encode(), np.uint8) if isinstance(v, str) else np.asarray(v)) for v in values]
    )
    everyone = np.asarray(multihost_utils.process_allgather(local)).reshape(jax.process_count(), len(values), 2)
    differ = (everyone != everyone[0]).any(axis=2)  # (process, value)
    if differ.any():
        bad = [names[i] for i in np.flatnonzero(differ.any(axis=0))]
        procs = [int(p) for p in np.flatnonzero(differ.any(axis=1))]
        raise ValueError(
            f"{what} differs between workers: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} "
            f"on worker(s) {procs} is not what worker 0 has. {fix}"
        )


def from_process0(values: Any) -> Any:
    """Process 0's ``values`` (a pytree of host arrays or numbers) on every process; one collective.

    In a single process it returns ``values`` unchanged (no collective). Every
    process must call it with values of the same structure, shapes and dtypes.
    Numbers come back as Python numbers.
    """
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    out = multihost_utils.broadcast_one_to_all(jax.tree.map(np.asarray, values))
    return jax.tree.map(
        lambda new, old: new.item() if np.ndim(old) == 0 and not isinstance(old, np.ndarray) else np.asarray(new),
        out,
        values,
    )
