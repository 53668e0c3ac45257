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

Promises:

1. Inside ``gc_paused()`` the cyclic collector is off, and a step is traced inside it (once: a later call
   reuses the compiled step)
   (tests/test_gc_pause.py::test_paused_while_the_step_is_traced_and_back_after).
2. After the block the collector is on again
   (tests/test_gc_pause.py::test_paused_while_the_step_is_traced_and_back_after).
3. It is on again after a block that raised, e.g. a step that fails to trace
   (tests/test_gc_pause.py::test_back_on_after_a_step_that_fails_to_trace).
4. A collector the user disabled stays disabled, during and after the block
   (tests/test_gc_pause.py::test_a_collector_the_user_disabled_stays_disabled).
5. Nested blocks: the inner one's end leaves the collector off; only the outer one's end turns it on
   (tests/test_gc_pause.py::test_a_nested_pause_leaves_the_collector_off_until_the_outer_one_ends).
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
