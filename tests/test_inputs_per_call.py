"""Where a step's batch comes from: an input_fn held only while it lives, a warning for one made per call, and a
batch or an iterator of batches given to run directly."""

import gc
import warnings
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp


def _numbered(rows: int):
    """A generator of batches numbered 0, 1, 2, ...: ``x`` is the batch number on every row."""
    i = 0
    while True:
        yield {"x": np.full((rows,), i, np.float32)}
        i += 1


def step(count, batch):
    return count + 1, {"first": batch["x"][0], "x": batch["x"]}


def _input_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "input_fn" in str(w.message)]


def test_a_new_input_function_every_call_warns_once_naming_the_call_site_and_the_fix(n_devices):
    repl = rp.Replicator(1, n_devices)
    count, firsts = jnp.int32(0), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            count, out = repl.run(step, lambda ctx: _numbered(n_devices), count)  # the line the warning names
            firsts.append(float(out["first"][0]))
    assert firsts == [0.0] * 6  # the footgun itself: every step read batch 0
    (warning,) = _input_warnings(caught)
    message = str(warning.message)
    assert "new function object on every call" in message and "starts over at every step" in message
    assert "Define input_fn once, outside the loop" in message and "repl.run(step_fn, batch, state)" in message
    assert f"made at {__file__}:" in message
    assert (
        warning.filename == __file__ and "the line the warning names" in open(__file__).readlines()[warning.lineno - 1]
    )


def test_iterators_of_input_functions_that_no_longer_exist_are_not_kept(n_devices):
    repl = rp.Replicator(1, n_devices)
    generators = []

    def make_generator():
        generators.append(g := _numbered(n_devices))
        return g

    count = jnp.int32(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(20):
            count, _ = repl.run(step, lambda ctx: make_generator(), count)
    refs = [weakref.ref(g) for g in generators]
    generators.clear()
    gc.collect()
    assert len(repl._inputs) == 0
    assert [r for r in refs if r() is not None] == []


def test_a_generator_function_made_every_call_is_not_kept(n_devices):
    """Its generator refers to the function: the registry drops it once only its generators hold it."""
    repl = rp.Replicator(1, n_devices)
    count, refs = jnp.int32(0), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):

            def input_fn(ctx, i=i):
                yield {"x": np.full((n_devices,), i, np.float32)}

            count, out = repl.run(step, input_fn, count)
            refs.append(weakref.ref(input_fn))
            assert float(out["first"][0]) == i
    del input_fn
    assert len(repl._inputs) <= 1 and sum(r() is not None for r in refs) <= 1
    assert len(_input_warnings(caught)) == 1


def test_a_function_held_by_the_caller_is_continued_a_bound_method_too(n_devices):
    repl = rp.Replicator(1, n_devices)

    class Loader:
        def batches(self, ctx):
            return _numbered(n_devices)

    loader, count = Loader(), jnp.int32(0)
    firsts = []
    for _ in range(4):  # loader.batches is a new bound method object every time
        count, out = repl.run(step, loader.batches, count)
        firsts.append(float(out["first"][0]))
    assert firsts == [0.0, 1.0, 2.0, 3.0]
    assert repl.input_position(loader.batches) == 4
    del loader
    gc.collect()
    assert len(repl._inputs) == 0


def test_a_new_input_function_per_epoch_does_not_warn(n_devices):
    repl = rp.Replicator(1, n_devices)

    def make_input(epoch):
        def input_fn(ctx):
            for i in range(3):
                yield {"x": np.full((n_devices,), 10 * epoch + i, np.float32)}

        return input_fn

    count, firsts = jnp.int32(0), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(5):
            input_fn = make_input(epoch)
            for _ in range(3):
                count, out = repl.run(step, input_fn, count)
                firsts.append(float(out["first"][0]))
    assert firsts == [10.0 * e + i for e in range(5) for i in range(3)]
    assert _input_warnings(caught) == []


class TestGivenDirectly:
    def test_a_batch_is_split_over_the_replicas_in_order(self, repl2d):
        n = repl2d.num_replicas
        x = np.arange(3 * n, dtype=np.float32).reshape(n, 3)
        count, out = repl2d.run(step, {"x": x}, jnp.int32(0))
        assert int(count) == 1
        np.testing.assert_array_equal(np.asarray(out["x"]), x.reshape(n, 1, 3))  # replica r: row r

    def test_an_iterator_is_continued_and_its_end_is_input_exhausted(self, repl2d):
        n = repl2d.num_replicas
        batches = iter([{"x": np.full((n,), i, np.float32)} for i in range(3)])
        firsts = [float(repl2d.run(step, batches, jnp.int32(0))[1]["first"][-1]) for _ in range(3)]
        assert firsts == [0.0, 1.0, 2.0]
        with pytest.raises(rp.InputExhausted, match="iterator of batches given to run is exhausted"):
            repl2d.run(step, batches, jnp.int32(0))

    def test_rows_not_divisible_by_the_replicas_of_the_process_are_named(self, repl2d):
        n = repl2d.num_replicas
        with pytest.raises(ValueError, match=rf"batch\['x'\] has {n + 2} rows, not divisible by"):
            repl2d.run(step, {"x": np.ones((n + 2,), np.float32)}, jnp.int32(0))

    def test_a_batch_for_each_call_neither_warns_nor_recompiles(self, n_devices):
        repl = rp.Replicator(1, n_devices)
        count = jnp.int32(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):
                count, out = repl.run(step, {"x": np.full((n_devices,), i, np.float32)}, count)
                assert float(out["first"][0]) == i
        assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
        (compiled,) = repl._compiled.values()
        assert repl.trace_count == 1 and compiled.executable._cache_size() == 1


@pytest.mark.parametrize("prefetch", [0, 1])
def test_host_batches_compile_once_with_or_without_prefetch(n_devices, prefetch):
    """Placed by the step's own dispatch (NumPy) or by prefetch (device arrays), never both for one step: jit
    would compile each kind."""
    repl = rp.Replicator(1, n_devices, prefetch=prefetch)
    input_fn, count = (lambda ctx: _numbered(n_devices)), jnp.int32(0)
    for i in range(4):
        count, out = repl.run(step, input_fn, count)
        assert float(out["first"][0]) == i
    (compiled,) = repl._compiled.values()
    assert compiled.executable._cache_size() == 1
