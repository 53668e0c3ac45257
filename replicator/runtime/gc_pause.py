"""Python's cyclic garbage collector paused while a step is traced, rewritten and compiled.

Tracing the step, the passes and JAX's lowering allocate hundreds of
thousands of short-lived objects; every so many allocations Python runs a
collection, and the occasional full one walks the whole heap. On the 64-layer
MLP of ``benchmarks/first_call.py`` one landed in the lowering of the step and
cost 0.07 s of a 1.6 s first call (``--no-gc`` shows the first call without
it). Pausing the collector for the compile is what CPython's own advice for
allocation-heavy phases is (``gc.disable`` / ``gc.freeze``): objects are still
freed by reference counting as they die; only reference cycles made meanwhile
wait for the first collection after the pause.

>>> import gc
>>> with gc_paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector inside the block, if it is enabled (a user who disabled it keeps it so)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
