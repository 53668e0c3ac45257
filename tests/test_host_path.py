"""The steady-state host path of ``Replicator.run``: the Python calls it makes per step, and the identity fast
paths it takes when a step repeats (same step_fn, input_fn, returned state and batch structure)."""

from __future__ import annotations

import collections
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.pipeline.pipeline import Pipeline

AXES = ("workers", "cores")
#: Python calls a steady-state ``run`` of a trivial step makes beyond the hand-written call's (measured
#: 16: run, _run, begin_step, end_step, set_phase, the input registry's get, take, next_batches, the Batch,
#: the batch check, two tree flattens, the returned state's match, place_batch, spans_processes,
#: _wait_for_room). Before the identity fast paths it was 42. Raise it only for work every step needs.
MAX_EXTRA_CALLS = 16

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


def test_a_new_pass_pipeline_between_calls_compiles_the_step_again(n_devices):
    repl = rp.Replicator(1, n_devices)
    step = _replicator_loop(repl, n_devices)
    step(), step()
    assert repl.trace_count == 1
    repl.pipeline = Pipeline(disable=["fuse-collectives"])
    step()
    assert repl.trace_count == 2


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
