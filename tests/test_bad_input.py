"""Bad input gets a clear error naming the leaf, and nothing grows without bound."""

import warnings

import numpy as np
import pytest

import replicator as rp
from replicator.runtime import build, retrace


def _input(x):
    return lambda ctx: iter([{"x": x}] * 100)


def test_a_batch_with_no_rows_is_an_error(repl):
    with pytest.raises(ValueError, match=r"batch has 0 rows \(batch\['x'\] has shape \(0, 2\)\)"):
        repl.run(lambda b: {"y": b["x"]}, _input(np.ones((0, 2), np.float32)))


def test_a_python_int_that_does_not_fit_the_state_dtype_is_an_error(repl, n_devices):
    x = np.ones((n_devices, 2), np.float32)
    with pytest.raises(OverflowError, match=r"state\['n'\] is the Python int 1099511627776, which does not fit"):
        repl.run(lambda s, b: (s, {}), _input(x), {"n": 2**40})
    state, _ = repl.run(lambda s, b: ({"n": s["n"] + 1}, {}), _input(x), {"n": 2**30})
    assert int(state["n"]) == 2**30 + 1


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_new_step_function_every_call_warns_once(n_devices):
    repl = rp.Replicator(1, n_devices)
    inp = _input(np.ones((n_devices, 2), np.float32))

    def loop():
        for _ in range(retrace.RETRACE_WARNING_AFTER + 4):
            repl.run(lambda b: {"y": b["x"] * 2}, inp)

    messages = _recorded(loop)
    assert len(messages) == 1 and "a new function object on every call" in messages[0], messages


def test_new_shapes_every_call_warn_once(n_devices):
    repl = rp.Replicator(1, n_devices)

    def step(b):
        return {"y": b["x"]}

    def loop():
        for n in range(1, retrace.RETRACE_WARNING_AFTER + 4):
            repl.run(step, {"x": np.ones((n_devices * n, 2), np.float32)})  # the batch itself, new shapes each call

    messages = _recorded(loop)
    assert len(messages) == 1 and "different state/batch shapes" in messages[0], messages


def test_the_compile_cache_is_bounded(n_devices, monkeypatch):
    monkeypatch.setattr(build, "MAX_COMPILED_STEPS", 3)
    repl = rp.Replicator(1, n_devices)
    inp = _input(np.ones((n_devices, 2), np.float32))
    steps = [lambda b, k=k: {"y": b["x"] * k} for k in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            repl.run(step, inp)
        assert len(repl._compiled) == 3
        repl.run(steps[-1], inp)  # still cached: no new trace
    assert repl.trace_count == 5


def _host_square(x):
    return np.asarray(x) ** 2


def _callback_step(callback):
    import jax

    def step(w, batch):
        return jax.pure_callback(callback, jax.ShapeDtypeStruct(w.shape, w.dtype), w), {}

    return step


def test_a_host_callback_is_assumed_to_vary_and_the_error_says_how_to_declare_it(repl, n_devices):
    import jax.numpy as jnp

    inp = _input(np.ones((n_devices, 1), np.float32))
    with pytest.raises(rp.DivergentStateError, match=r"(?s)results of pure_callback.*rp\.invariant_callback"):
        repl.run(_callback_step(_host_square), inp, jnp.arange(3.0))
    w, _ = repl.run(_callback_step(rp.invariant_callback(_host_square)), inp, jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(w), [0.0, 1.0, 4.0])


def test_a_declared_callback_of_per_replica_data_still_varies(repl, n_devices):
    import jax

    def step(w, batch):  # the callback's input is batch data: its result differs between replicas
        return w + jax.pure_callback(
            rp.invariant_callback(_host_square), jax.ShapeDtypeStruct((), w.dtype), batch["x"][0, 0]
        ), {}

    x = np.arange(n_devices, dtype=np.float32).reshape(n_devices, 1)
    with pytest.raises(rp.DivergentStateError):
        repl.run(step, _input(x), np.float32(0))


def test_a_list_in_the_batch_is_named_as_the_culprit(repl, n_devices):
    rows = [[1.0, 2.0]] * n_devices
    with pytest.raises(ValueError, match=r"batch\['x'\] is a Python list or tuple of numbers"):
        repl.run(lambda b: {"y": b["x"]}, lambda ctx: iter([{"x": rows}]))


def test_a_batch_larger_than_the_free_memory_is_an_error_before_placing_it(repl, n_devices, monkeypatch):
    from replicator.runtime import execution

    monkeypatch.setattr(execution, "MEMORY_CHECK_BYTES", 0)
    monkeypatch.setattr(execution, "available_host_memory", lambda: 1024)  # as if 1 KiB were free
    x = np.ones((n_devices, 64), np.float32)  # 2 KiB
    with pytest.raises(MemoryError, match=r"only 0\.0 GiB of memory is available"):
        repl.run(lambda b: {"y": b["x"]}, _input(x))
