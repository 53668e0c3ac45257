"""Checking that every worker of a job holds the same host values (e.g. compiled the same step).

Used by the runtime before a compiled step first runs and by checkpoint
restore: a worker that disagrees would otherwise hang in, or silently corrupt,
the next collective.

Promises:

1. In a single process ``check_same_across_workers`` compares nothing and runs no collective
   (tests/test_distributed.py::TestSameAcrossWorkers::test_one_process_compares_nothing).
2. Values every worker holds alike pass; a worker whose value differs from worker 0's is a ``ValueError``
   naming the value, the worker and the ``fix``, after one all-gather
   (tests/test_distributed.py::TestSameAcrossWorkers::test_workers_are_compared_with_worker_0).
3. Values that differ only in dtype or shape (the same bytes), 0-d values of narrow dtypes, and bool arrays are
   told apart (tests/test_distributed.py::test_values_that_differ_in_dtype_or_shape_alone_are_not_the_same).
4. More than five values that differ: the first five are named, then ``...``
   (tests/test_distributed.py::test_more_than_five_values_that_differ_are_named_five_then_dots).
5. ``from_process0`` returns the values themselves in a single process; with several, process 0's values,
   numbers as Python numbers and arrays (0-d ones too) as NumPy arrays of their dtype
   (tests/test_distributed.py::test_process_0s_values_come_back_numbers_as_python_numbers).
6. A worker that compiled another program is refused before the first step runs
   (tests/test_divergence.py::test_a_different_learning_rate_on_one_worker_is_an_error_before_step_one).
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
