"""The cyclic garbage collector is paused while a step compiles, and only then."""

import gc

import numpy as np
import pytest

import replicator as rp


def _batches(n):
    return lambda ctx: iter([np.ones((n, 2), np.float32)])


def test_paused_while_the_step_is_traced_and_back_after(n_devices):
    seen = []

    def step(batch):
        seen.append(gc.isenabled())  # runs once, while tracing
        return rp.all_mean(batch.sum())

    assert gc.isenabled()
    repl = rp.Replicator(1, n_devices)
    repl.run(step, _batches(n_devices))
    repl.run(step, _batches(n_devices))  # compiled already: not traced again
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled(n_devices):
    gc.disable()
    try:
        rp.Replicator(1, n_devices).run(lambda b: rp.all_sum(b), _batches(n_devices))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_back_on_after_a_step_that_fails_to_trace(n_devices):
    def step(batch):
        raise ZeroDivisionError("in the step")

    with pytest.raises(ZeroDivisionError):
        rp.Replicator(1, n_devices).run(step, _batches(n_devices))
    assert gc.isenabled()


def test_a_nested_pause_leaves_the_collector_off_until_the_outer_one_ends():
    from replicator.runtime.gc_pause import gc_paused

    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it paused: it leaves it so
    assert gc.isenabled()
