"""Warnings for a loop that compiles its step again and again, or restarts its data at every step.

JAX compiles a function again for each new function object and each new shape; a ``Replicator`` does
too (its cache is keyed by the step function and the state's and batch's signatures), and so does a
new ``input_fn`` start a new iterator. Each cause is warned about once per Replicator, naming the
user's line (JAX's ``explain_cache_misses`` in spirit).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["NEW_INPUT_WARNING_AFTER", "RETRACE_WARNING_AFTER", "caller_stacklevel", "warn_if_retracing"]

#: Warn when a step has been compiled this many times already for one cause.
RETRACE_WARNING_AFTER = 8
#: Warn when this many new input functions of the same code in a row each ran one step before the next.
NEW_INPUT_WARNING_AFTER = 2

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def caller_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` naming the first caller outside this package (the user's line)."""
    frame, level = sys._getframe(1), 1  # the function that calls warnings.warn
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def code_of(fn: Any) -> Any:
    """The code object of a function or of a ``functools.partial``'s function (None otherwise)."""
    return getattr(fn, "__code__", None) or getattr(getattr(fn, "func", None), "__code__", None)


def warn_if_retracing(step_fn: Callable, keys: Iterable[tuple], warned: set[str]) -> None:
    """Warn once per cause when ``step_fn`` is about to be compiled again: ``keys`` are the cache's keys
    (the step function first); ``warned``: the causes already warned about (updated)."""
    code = code_of(step_fn)
    keys = list(keys)
    same_code = [k for k in keys if k[0] is not step_fn and code_of(k[0]) is code and code]
    same_fn = [k for k in keys if k[0] is step_fn]
    if len(same_code) >= RETRACE_WARNING_AFTER and "new-function" not in warned:
        warned.add("new-function")
        warnings.warn(
            f"Replicator.run: step_fn {getattr(code, 'co_name', step_fn)!r} is a new function object on every "
            f"call ({len(same_code) + 1} so far: a lambda or functools.partial made inside the loop), so every "
            "step is traced and compiled again. Define it once, outside the loop.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )
    elif len(same_fn) >= RETRACE_WARNING_AFTER and "new-shapes" not in warned:
        warned.add("new-shapes")
        warnings.warn(
            f"Replicator.run: step_fn has been compiled for {len(same_fn) + 1} different state/batch shapes or "
            "dtypes; each new one compiles again. Pad batches to a fixed size (drop_last, or pad and mask) "
            "and keep the state's shapes fixed.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


def warn_new_input_fn(input_fn: Callable, count: int, warned: set[str]) -> None:
    """Warn once: ``input_fn`` is a new function on every call, so its data starts over at every step."""
    if "new-input-function" in warned:
        return
    warned.add("new-input-function")
    code = code_of(input_fn)
    where = f" (made at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    warnings.warn(
        f"Replicator.run: input_fn {getattr(code, 'co_name', input_fn)!r}{where} is a new function object on "
        f"every call ({count} in a row, each used for one step: a lambda or function made inside the loop), "
        "so every step starts a new iterator and reads its first batch: the data starts over at every step. "
        "Define input_fn once, outside the loop (one iterator, continued from call to call), or pass the "
        "step's batch itself, repl.run(step_fn, batch, state), or an iterator of batches, "
        "repl.run(step_fn, batches, state), which run continues.",
        RuntimeWarning,
        stacklevel=caller_stacklevel(),
    )
