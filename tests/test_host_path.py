"""The steady-state host path of ``Replicator.run``: the Python calls it makes per step, and the identity fast
paths it takes when a step repeats (same step_fn, input_fn, returned state and batch structure)."""

from __future__ import annotations

import collections
import os
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.pass_manager.manager import PassManager

AXES = ("workers", "cores")
#: Python calls a steady-state ``run`` of a trivial step makes beyond the hand-written call's (measured
#: 8: run, begin_step, end_step, set_phase, the steady step's take and _run_steady, and two tree flattens,
#: the state's and the batch's, jax's Python wrapper of a C call). The general path made 16, and 42 before
#: its identity fast paths. Raise it only for work every step needs.
MAX_EXTRA_CALLS = 8

_REPLICATOR_DIR = os.path.dirname(os.path.abspath(rp.__file__)) + os.sep


def _rows(n: int) -> np.ndarray:
    return np.arange(8 * n, dtype=np.float32)


def _forever(n: int) -> Callable[[Any], Iterator[dict]]:
    batch = {"x0": _rows(n)}

    def input_fn(ctx: Any) -> Iterator[dict]:
        while True:
            yield batch

    return input_fn


def _step(state: list, batch: dict) -> tuple[list, dict]:
    m = rp.all_mean(jnp.mean(batch["x0"]))
    return [s + m for s in state], {"m": m}


def _calls_per_step(fn: Callable[[], Any], steps: int = 20) -> tuple[float, collections.Counter]:
    """Median Python calls (``sys.setprofile`` "call" events) per call of ``fn``, and the calls by function."""
    for _ in range(5):
        jax.block_until_ready(fn())
    per_step: list[int] = []
    by_function: collections.Counter = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            per_step[-1] += 1
            code = frame.f_code
            by_function[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1

    for _ in range(steps):
        per_step.append(0)
        sys.setprofile(profile)
        try:
            out = fn()
        finally:
            sys.setprofile(None)
        jax.block_until_ready(out)
    return statistics.median(per_step), by_function


def _hand_written(n: int, mesh: Any) -> Callable[[], Any]:
    """The user's own ``jit(shard_map(pmean))`` step, given the same NumPy batch, two steps in flight."""

    def per_replica(state: list, batch: dict) -> tuple[list, dict]:
        m = lax.pmean(jnp.mean(batch["x0"]), AXES)
        return [s + m for s in state], {"m": m[None]}

    program = jax.jit(
        jax.shard_map(per_replica, mesh=mesh, in_specs=([P()], P(AXES)), out_specs=([P()], P(AXES)), check_vma=False)
    )
    batches = _forever(n)(None)
    holder = {"state": jax.device_put([np.zeros((), np.float32)], NamedSharding(mesh, P()))}
    in_flight: collections.deque = collections.deque()

    def call() -> Any:
        batch = next(batches)
        while len(in_flight) >= 2:
            in_flight.popleft().block_until_ready()
        holder["state"], _ = program(holder["state"], batch)
        in_flight.append(holder["state"][0])
        return holder["state"]

    return call


def _replicator_loop(repl: rp.Replicator, n: int) -> Callable[[], Any]:
    input_fn = _forever(n)
    holder = {"state": repl.broadcast_state([np.zeros((), np.float32)])}

    def call() -> Any:
        holder["state"], _ = repl.run(_step, input_fn, holder["state"])
        return holder["state"]

    return call


def test_a_repeated_step_makes_few_python_calls_beyond_the_hand_written_call(n_devices):
    repl = rp.Replicator(1, n_devices)
    replicator_calls, by_function = _calls_per_step(_replicator_loop(repl, n_devices))
    hand_calls, _ = _calls_per_step(_hand_written(n_devices, repl.mesh))
    extra = replicator_calls - hand_calls
    ours = {k: v / 20 for k, v in by_function.most_common() if not k.startswith(("literals.py", "pxla.py"))}
    assert extra <= MAX_EXTRA_CALLS, f"run makes {extra} Python calls per step more than the hand call: {ours}"


def test_a_batch_given_to_run_again_makes_few_python_calls_beyond_the_hand_written_call(n_devices):
    """A batch given to ``run`` itself (not an ``input_fn``) takes the steady path too."""
    repl = rp.Replicator(1, n_devices)
    batches = _forever(n_devices)(None)
    holder = {"state": repl.broadcast_state([np.zeros((), np.float32)])}

    def call() -> Any:
        holder["state"], _ = repl.run(_step, next(batches), holder["state"])
        return holder["state"]

    replicator_calls, by_function = _calls_per_step(call)
    hand_calls, _ = _calls_per_step(_hand_written(n_devices, repl.mesh))
    extra = replicator_calls - hand_calls
    assert extra <= MAX_EXTRA_CALLS, f"run makes {extra} Python calls per step more than the hand call: {by_function}"


def test_a_repeated_step_takes_the_jitted_functions_cpp_fast_path(n_devices):
    """No Python frame of jax's jit machinery (``pjit.py``: its cache-miss fallback) runs in a steady-state step."""
    repl = rp.Replicator(1, n_devices)
    _, by_function = _calls_per_step(_replicator_loop(repl, n_devices))
    assert not [k for k in by_function if k.startswith("pjit.py:")], sorted(by_function)
    assert not [k for k in by_function if "_python_pjit" in k or "cache_miss" in k], sorted(by_function)


def test_alternating_step_functions_each_run_their_own_step(n_devices):
    repl = rp.Replicator(1, n_devices)
    input_fn = _forever(n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])

    def doubled(state: list, batch: dict) -> tuple[list, dict]:
        m = rp.all_mean(jnp.mean(batch["x0"]))
        return [s + 2 * m for s in state], {"m": m}

    mean = float(np.mean(_rows(n_devices)))
    expected = 0.0
    for i in range(6):
        step_fn = _step if i % 3 else doubled
        state, out = repl.run(step_fn, input_fn, state)
        expected += mean * (1 if i % 3 else 2)
        np.testing.assert_allclose(np.asarray(state[0]), expected, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(out["m"]), np.full(n_devices, mean), rtol=1e-6)
    assert repl.trace_count == 2


def test_a_new_pass_manager_between_calls_compiles_the_step_again(n_devices):
    repl = rp.Replicator(1, n_devices)
    step = _replicator_loop(repl, n_devices)
    step(), step()
    assert repl.trace_count == 1
    repl.passes = PassManager(disable=["fuse-collectives"])
    step()
    assert repl.trace_count == 2


@pytest.mark.parametrize("given", ["input_fn", "batch"])
def test_a_batch_of_the_same_shapes_in_another_structure_is_traced_for_it(n_devices, given):
    """Steady steps of ``{"a", "b"}`` batches, then ``{"a", "c"}`` with the same shapes and dtypes, then a tuple:
    each new structure is traced for itself; the program compiled for the last one never runs it (it would
    read ``c`` as ``b``)."""
    repl = rp.Replicator(1, n_devices)
    weight = {"a": 1.0, "b": 10.0, "c": 100.0}

    def step(state, batch):
        items = batch.items() if isinstance(batch, dict) else zip(("a", "c"), batch, strict=True)
        return state + sum(weight[k] * rp.all_mean(jnp.mean(v)) for k, v in items), {}

    x = np.ones(n_devices, np.float32)
    plan = [({"a": x, "b": x}, 11.0), ({"a": x, "c": x}, 101.0), ((x, x), 101.0)]
    one_input_fn = lambda ctx: iter([batch for batch, _ in plan for _ in range(3)])  # noqa: E731 - one iterator
    state, expected = repl.broadcast_state(np.zeros((), np.float32)), 0.0
    for batch, adds in plan:
        data = one_input_fn if given == "input_fn" else batch
        for _ in range(3):  # the second and third calls of a structure take the steady path
            state, _ = repl.run(step, data, state)
            expected += adds
            np.testing.assert_allclose(np.asarray(state), expected, rtol=1e-6, err_msg=str(batch)[:40])
    assert repl.trace_count == 3


def test_a_batch_of_a_new_shape_after_repeated_steps_is_checked_and_compiled(n_devices):
    repl = rp.Replicator(1, n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    for rows in (8, 8, 16, 16, 8):
        x = np.arange(rows * n_devices, dtype=np.float32)
        state, out = repl.run(_step, {"x0": x}, state)
        np.testing.assert_allclose(np.asarray(out["m"]), np.full(n_devices, x.mean()), rtol=1e-6)
    assert repl.trace_count == 2


def test_a_float_leaf_after_repeated_numpy_batches_is_refused(n_devices):
    """The checks a batch of known NumPy leaves skips still run for a leaf of another type."""
    repl = rp.Replicator(1, n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    x = _rows(n_devices)
    for _ in range(3):
        state, _ = repl.run(_step, {"x0": x}, state)
    try:
        repl.run(_step, {"x0": 1.5}, state)
    except ValueError as e:
        assert "scalar" in str(e)
    else:
        raise AssertionError("a scalar batch leaf was accepted")


# -- the steady path (replicator/runtime/steady.py): a call like the last one --------------------------------


def _batches_of(*rows: int, n: int) -> Callable[[Any], Iterator[dict]]:
    """An ``input_fn`` yielding one batch per entry of ``rows`` (that many rows per replica), then ending."""

    def input_fn(ctx: Any) -> Iterator[dict]:
        for i, r in enumerate(rows):
            yield {"x0": np.arange(r * n, dtype=np.float32) + 100 * i}

    return input_fn


def _means(*rows: int, n: int) -> list[float]:
    return [float(np.mean(np.arange(r * n, dtype=np.float32) + 100 * i)) for i, r in enumerate(rows)]


def test_steady_steps_run_each_batch_once_in_order_across_a_change_of_shape(n_devices):
    """A batch of a new shape after steady steps is not lost: it is checked, compiled and run at its own step."""
    rows = (8, 8, 8, 4, 4, 8, 8)
    repl = rp.Replicator(1, n_devices)
    input_fn = _batches_of(*rows, n=n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    total = 0.0
    for want in _means(*rows, n=n_devices):
        state, out = repl.run(_step, input_fn, state)
        total += want
        np.testing.assert_allclose(np.asarray(out["m"]), np.full(n_devices, want), rtol=1e-6)
        np.testing.assert_allclose(float(state[0]), total, rtol=1e-6)
    assert repl.trace_count == 2
    assert repl.input_position(input_fn) == len(rows)
    with pytest.raises(rp.InputExhausted, match=f"exhausted after {len(rows)} batches"):
        repl.run(_step, input_fn, state)


def test_a_bad_batch_after_steady_steps_gets_the_batch_checks_error(n_devices):
    def input_fn(ctx: Any) -> Iterator[dict]:
        for _ in range(3):
            yield {"x0": _rows(n_devices)}
        yield {"x0": np.arange(8 * n_devices + 1, dtype=np.float32)}  # rows not divisible by the replicas

    repl = rp.Replicator(1, n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    for _ in range(3):
        state, _ = repl.run(_step, input_fn, state)
    with pytest.raises(ValueError, match="divisible"):
        repl.run(_step, input_fn, state)


def _after_steady_steps(n_devices: int) -> tuple[rp.Replicator, Callable, float, list]:
    """A Replicator after three steady steps of ``_step`` on ``_forever``: it, the input_fn, the batch's mean
    and the state returned."""
    repl = rp.Replicator(1, n_devices)
    input_fn = _forever(n_devices)
    mean = float(np.mean(_rows(n_devices)))
    state = repl.broadcast_state([np.zeros((), np.float32)])
    for _ in range(3):
        state, _ = repl.run(_step, input_fn, state)
    return repl, input_fn, mean, state


def test_a_state_that_is_not_the_returned_one_is_placed_and_used(n_devices):
    """A step after steady steps given a state other than the one returned runs on that state."""
    repl, input_fn, mean, state = _after_steady_steps(n_devices)
    state, _ = repl.run(_step, input_fn, [np.full((), 10.0, np.float32)])
    np.testing.assert_allclose(float(state[0]), 10.0 + mean, rtol=1e-6)
    state, _ = repl.run(_step, input_fn, state)
    np.testing.assert_allclose(float(state[0]), 10.0 + 2 * mean, rtol=1e-6)
    older = state
    state, _ = repl.run(_step, input_fn, state)
    state, _ = repl.run(_step, input_fn, older)  # an earlier state, not the last one returned
    np.testing.assert_allclose(float(state[0]), 10.0 + 3 * mean, rtol=1e-6)


def test_two_input_functions_alternating_each_continue_their_own_iterator(n_devices):
    repl = rp.Replicator(1, n_devices)
    a, b = _batches_of(8, 8, 8, n=n_devices), _batches_of(8, 8, 8, n=n_devices)
    want = _means(8, 8, 8, n=n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    seen = []
    for fn in (a, a, b, a, b, b):
        state, out = repl.run(_step, fn, state)
        seen.append(float(out["m"][0]))
    np.testing.assert_allclose(seen, [want[0], want[1], want[0], want[2], want[1], want[2]], rtol=1e-6)


def test_forget_input_after_steady_steps_starts_the_input_over(n_devices):
    repl = rp.Replicator(1, n_devices)
    input_fn = _batches_of(8, 8, 8, n=n_devices)
    want = _means(8, 8, 8, n=n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    for _ in range(2):
        state, _ = repl.run(_step, input_fn, state)
    repl.forget_input(input_fn)
    state, out = repl.run(_step, input_fn, state)
    np.testing.assert_allclose(float(out["m"][0]), want[0], rtol=1e-6)


def test_a_dropped_input_function_takes_its_iterator_with_it_after_steady_steps(n_devices):
    import gc
    import weakref

    repl = rp.Replicator(1, n_devices)
    alive = []

    class Rows:
        def __iter__(self) -> Rows:
            return self

        def __next__(self) -> dict:
            return {"x0": _rows(n_devices)}

    def input_fn(ctx: Any) -> Rows:
        it = Rows()
        alive.append(weakref.ref(it))
        return it

    state = repl.broadcast_state([np.zeros((), np.float32)])
    for _ in range(4):
        state, _ = repl.run(_step, input_fn, state)
    del input_fn
    gc.collect()
    assert [r() for r in alive] == [None]


def test_prefetch_turned_on_after_steady_steps_draws_ahead(n_devices):
    drawn: list[int] = []

    def input_fn(ctx: Any) -> Iterator[dict]:
        for i in range(5):
            drawn.append(i)
            yield {"x0": _rows(n_devices) + 100 * i}

    repl = rp.Replicator(1, n_devices, prefetch=0)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    seen = []
    for k, prefetch in enumerate((None, None, 1, None)):
        state, out = repl.run(_step, input_fn, state, prefetch=prefetch)
        seen.append(float(out["m"][0]))
        assert len(drawn) == k + 1 + (prefetch or 0)
    np.testing.assert_allclose(seen, [float(np.mean(_rows(n_devices))) + 100 * i for i in range(4)], rtol=1e-6)


def test_a_device_array_batch_after_steady_numpy_steps_is_placed_by_replica(n_devices):
    """A batch of the same shapes as JAX arrays on one device goes to the general path, which places it."""
    repl = rp.Replicator(1, n_devices)
    x = _rows(n_devices)

    def input_fn(ctx: Any) -> Iterator[dict]:
        for i in range(3):
            yield {"x0": x + i}
        yield {"x0": jax.device_put(x + 3, jax.devices()[1])}

    state = repl.broadcast_state([np.zeros((), np.float32)])
    for i in range(4):
        state, out = repl.run(_step, input_fn, state)
        np.testing.assert_allclose(np.asarray(out["m"]), np.full(n_devices, x.mean() + i), rtol=1e-6)


def test_steady_steps_check_the_replicas_agree_every_k_steps(n_devices, monkeypatch):
    """``check_state_every`` still runs on steps of the steady path."""
    import replicator.api as api

    checked: list[int] = []
    monkeypatch.setattr(api, "check_replicas_agree", lambda state, paths: checked.append(len(state)))
    repl = rp.Replicator(1, n_devices, check_state_every=2)
    loop = _replicator_loop(repl, n_devices)
    for _ in range(6):
        loop()
    assert checked == [1, 1, 1]


def test_the_returned_arrays_in_another_structure_are_traced_for_it(n_devices):
    """The state's arrays as the last call returned them, but in a tuple where it returned a list: the step is
    traced for the tuple and returns one."""

    def step(state, batch):
        m = rp.all_mean(jnp.mean(batch["x0"]))
        return jax.tree.map(lambda s: s + m, state), {"m": m}

    repl = rp.Replicator(1, n_devices)
    input_fn = _forever(n_devices)
    mean = float(np.mean(_rows(n_devices)))
    state = repl.broadcast_state([np.zeros((), np.float32)])
    for _ in range(3):
        state, _ = repl.run(step, input_fn, state)
    new, _ = repl.run(step, input_fn, tuple(state))
    assert isinstance(new, tuple) and repl.trace_count == 2
    np.testing.assert_allclose(float(new[0]), 4 * mean, rtol=1e-6)


def test_a_state_of_another_shape_after_steady_steps_is_traced_for_its_shape(n_devices):
    repl, input_fn, mean, state = _after_steady_steps(n_devices)
    state, _ = repl.run(_step, input_fn, [np.zeros((2,), np.float32)])
    assert state[0].shape == (2,) and repl.trace_count == 2
    np.testing.assert_allclose(np.asarray(state[0]), [mean, mean], rtol=1e-6)


def test_a_batch_over_the_host_memory_threshold_is_checked_at_every_step(n_devices, monkeypatch):
    import replicator.runtime.execution as execution
    import replicator.runtime.steady as steady

    checks: list[int] = []
    monkeypatch.setattr(steady, "MEMORY_CHECK_BYTES", 16)
    monkeypatch.setattr(execution, "MEMORY_CHECK_BYTES", 16)
    monkeypatch.setattr(execution, "_check_host_memory", lambda leaves, mesh: checks.append(len(leaves)))
    loop = _replicator_loop(rp.Replicator(1, n_devices), n_devices)
    for _ in range(4):
        loop()
    assert checks == [1, 1, 1, 1]


def test_a_shape_dtype_struct_batch_leaf_given_to_run_is_a_clear_error(n_devices):
    repl = rp.Replicator(1, n_devices)
    batch = {"x0": jax.ShapeDtypeStruct((8 * n_devices,), np.float32)}
    with pytest.raises(TypeError, match="ShapeDtypeStruct.*run needs the data.*lower or explain"):
        repl.run(_step, batch, repl.broadcast_state([np.zeros((), np.float32)]))


def test_given_batches_input_functions_and_iterators_in_turn_each_run_their_own_data(n_devices):
    """Steady steps of batches given to run, then an input_fn, an iterator, batches again: each call runs the
    data it was given, the state carried through."""
    repl = rp.Replicator(1, n_devices)
    x = _rows(n_devices)
    input_fn = _batches_of(8, 8, 8, n=n_devices)
    iterator = iter([{"x0": x + 1000.0}, {"x0": x + 2000.0}])
    calls = [
        ({"x0": x}, x.mean()),
        ({"x0": x + 1}, x.mean() + 1),
        ({"x0": x + 2}, x.mean() + 2),
        (input_fn, x.mean()),
        (input_fn, x.mean() + 100),
        ({"x0": x + 3}, x.mean() + 3),
        (iterator, x.mean() + 1000),
        ({"x0": x + 4}, x.mean() + 4),
        (iterator, x.mean() + 2000),
        (input_fn, x.mean() + 200),
    ]
    state = repl.broadcast_state([np.zeros((), np.float32)])
    total = 0.0
    for data, want in calls:
        with warnings.catch_warnings():  # an iterator is never flattened as a batch (JAX warns, and will refuse)
            warnings.simplefilter("error", DeprecationWarning)
            state, out = repl.run(_step, data, state)
        total += want
        np.testing.assert_allclose(np.asarray(out["m"]), np.full(n_devices, want), rtol=1e-6)
    np.testing.assert_allclose(float(state[0]), total, rtol=1e-6)
    assert repl.trace_count == 1


@pytest.mark.parametrize("dtype", [np.int8, np.bool_], ids=["int8", "bool"])
def test_a_batch_of_another_dtype_after_steady_steps_is_traced_for_it(n_devices, dtype):
    """The same shapes in a narrow dtype: not the recorded step (its program is float32's), traced for it."""
    repl = rp.Replicator(1, n_devices)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    x = np.arange(8 * n_devices) % 2
    for _ in range(3):
        state, _ = repl.run(_step, {"x0": x.astype(np.float32)}, state)
    state, out = repl.run(_step, {"x0": x.astype(dtype)}, state)
    assert repl.trace_count == 2
    np.testing.assert_allclose(np.asarray(out["m"]), np.full(n_devices, 0.5), rtol=1e-6)
    np.testing.assert_allclose(float(state[0]), 4 * 0.5, rtol=1e-6)


def test_two_local_workers_each_run_their_own_batches_in_order_step_after_step(n_devices):
    """Several local workers: every repeated step draws from each worker's iterator once (none is skipped or
    drawn twice), and each worker's rows go to its own replicas."""
    if n_devices < 2 or n_devices % 2:
        pytest.skip("needs two workers")
    cores = n_devices // 2

    def input_fn(ctx: Any) -> Iterator[dict]:
        for i in range(5):
            yield {"x0": np.full((cores,), 10.0 * i + ctx.worker_id, np.float32)}

    def step(state: list, batch: dict) -> tuple[list, dict]:
        return [s + rp.all_mean(batch["x0"][0]) for s in state], {"x": batch["x0"][0]}

    repl = rp.Replicator(2, cores)
    state = repl.broadcast_state([np.zeros((), np.float32)])
    for i in range(5):
        state, out = repl.run(step, input_fn, state)
        np.testing.assert_array_equal(np.asarray(out["x"]), np.repeat([10.0 * i, 10.0 * i + 1], cores))
    assert float(state[0]) == pytest.approx(sum(10.0 * i + 0.5 for i in range(5)))
    with pytest.raises(rp.InputExhausted, match="exhausted after 5 batches"):
        repl.run(step, input_fn, state)
