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
