"""runtime/inputs.py: input contexts, batch signatures and batches of several workers (the cases mutation
testing found untested first)."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.runtime.inputs import BatchSignature, InputContext


def test_the_tf_distribute_names_of_an_input_context_are_numbers() -> None:
    ctx = InputContext(num_workers=4, worker_id=2, cores_per_worker=8)
    assert ctx.input_pipeline_id == 2 and ctx.num_input_pipelines == 4


def test_batch_signatures_of_different_batches_are_equal_when_shapes_and_dtypes_are() -> None:
    """The compile-cache key: a new batch of the same structure, shapes and dtypes reuses the step."""
    a = BatchSignature.of({"x": np.zeros((8, 3), np.float32)}, 4)
    b = BatchSignature.of({"x": np.ones((8, 3), np.float32)}, 4)
    assert a is not b and a == b and hash(a) == hash(b)
    assert a != BatchSignature.of({"x": np.zeros((8, 2), np.float32)}, 4)
    assert a != BatchSignature.of({"y": np.zeros((8, 3), np.float32)}, 4)


def test_workers_yielding_batches_of_different_structures_is_an_error(repl2d: rp.Replicator) -> None:
    if repl2d.num_workers < 2:
        pytest.skip("needs two workers")
    rows = repl2d.cores_per_worker

    def input_fn(ctx: InputContext):
        key = "x" if ctx.worker_id == 0 else "y"  # the same shapes under different names
        while True:
            yield {key: np.zeros((rows,), np.float32)}

    with pytest.raises(ValueError, match="workers yielded batches of different structures"):
        repl2d.run(lambda s, b: (s, {"out": next(iter(b.values()))}), input_fn, jnp.float32(0))


def _numbered(rows: int):
    i = 0
    while True:
        yield {"x": np.full((rows,), i, np.float32)}
        i += 1


def test_a_new_input_function_every_call_warns_at_the_third_call(n_devices: int) -> None:
    """Two new functions in a row may be a restart; the third, each used for one step, is the footgun."""
    repl = rp.Replicator(1, n_devices)
    count = jnp.int32(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(1, 4):
            count, _ = repl.run(lambda s, b: (s + 1, {"x": b["x"]}), lambda ctx: _numbered(n_devices), count)
            warned = [w for w in caught if "new function object on every call" in str(w.message)]
            assert len(warned) == (call == 3), f"call {call}"
    assert "(3 in a row" in str(warned[0].message)


def test_a_worker_batch_that_divides_by_the_workers_but_not_the_replicas_is_refused() -> None:
    """10 splits over 2 workers but not over their 8 replicas: an error, not a silently floored per-replica size."""
    ctx = InputContext(num_workers=2, worker_id=0, cores_per_worker=4)
    with pytest.raises(ValueError, match="not divisible by the 8 replicas"):
        ctx.worker_batch_size(10)
    with pytest.raises(ValueError, match="not divisible by the 8 replicas"):
        ctx.get_per_replica_batch_size(12)
    assert ctx.worker_batch_size(16) == 8 and ctx.get_per_replica_batch_size(16) == 2


def test_a_later_step_where_one_worker_changes_structure_is_an_error_on_a_fresh_replicator(n_devices: int) -> None:
    """After a step that cached the batch signature, worker 1 alone yielding another structure is still caught
    (not only worker 0's batch is checked on the cached path)."""
    if n_devices < 2 or n_devices % 2:
        pytest.skip("needs two workers")
    rows = n_devices // 2
    repl = rp.Replicator(num_workers=2, cores_per_worker=rows)

    def input_fn(ctx: InputContext):
        yield {"x": np.zeros((rows,), np.float32)}
        key = "x" if ctx.worker_id == 0 else "y"  # the same shape under another name, on worker 1 only
        while True:
            yield {key: np.zeros((rows,), np.float32)}

    def step(s, b):
        return s + 1, {"out": next(iter(b.values()))}

    state, _ = repl.run(step, input_fn, jnp.float32(0))  # both workers yield {"x": ...}: the signature is cached
    assert float(state) == 1.0
    with pytest.raises(ValueError, match="workers yielded batches of different structures"):
        repl.run(step, input_fn, state)
