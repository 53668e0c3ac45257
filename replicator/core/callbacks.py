"""Declaring a host callback replica-invariant.

``jax.pure_callback`` runs Python on the host; the replica-variance analysis
cannot see inside it, so by default its result is assumed to differ between
replicas (a callback may read a clock, a file or the device id), and a
collective that depends on it under a condition, or state computed from it,
is rejected. A callback that is a pure function of its inputs can say so:

>>> @rp.invariant_callback
... def host_square(x):
...     return np.asarray(x) ** 2
>>> repl = rp.Replicator(1, 8)
>>> def step(w, batch):
...     spec = jax.ShapeDtypeStruct(w.shape, w.dtype)
...     return jax.pure_callback(host_square, spec, w), {}  # new state from state: identical everywhere
>>> w, _ = repl.run(step, lambda ctx: iter([{"x": np.ones((8, 1))}]), jnp.arange(3.0))
>>> np.asarray(w).tolist()
[0.0, 1.0, 4.0]

Its result then varies exactly as its inputs do. Declaring a callback that
does not behave so is a lie the analysis believes: replicas may diverge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["invariant_callback", "is_invariant_callback"]

_MARK = "__replicator_invariant_callback__"


def invariant_callback(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as a pure function of its inputs, for ``jax.pure_callback`` in a replicated step."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapped, _MARK, True)
    return wrapped


def is_invariant_callback(fn: object) -> bool:
    """Whether ``fn`` was marked with :func:`invariant_callback`."""
    return bool(getattr(fn, _MARK, False))
