"""runtime/inputs.py: input contexts, batch signatures and batches of several workers (the cases mutation
testing found untested first)."""

from __future__ import annotations

import warnings

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.runtime.inputs import (
    BatchChecker,
    BatchSignature,
    InputContext,
    WorkerInputs,
    check_worker_batch,
    split_process_batch,
)


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


# -- the promises of runtime/inputs.py no other test checks ------------------------------------------------------

_NARROW = [np.bool_, np.int8, np.uint8, np.float16, jnp.bfloat16, np.float32]


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(st.integers(0, 24), st.integers(1, 8), st.sampled_from(_NARROW), st.integers(0, 2))
def test_a_leaf_is_accepted_exactly_when_it_has_rows_that_split_evenly_over_the_cores(rows, cores, dtype, extra):
    """Any numeric or boolean dtype, narrow ones too; the rows must be > 0 and a multiple of the cores."""
    leaf = np.zeros((rows,) + (3,) * extra, dtype)
    if rows and rows % cores == 0:
        (got,) = check_worker_batch({"x": leaf}, cores, worker_id=1)
        assert got is leaf
    else:
        with pytest.raises(ValueError, match=r"worker 1's batch.*(0 rows|not divisible by cores_per_worker)"):
            check_worker_batch({"x": leaf}, cores, worker_id=1)


def test_an_empty_batch_and_a_string_leaf_are_refused() -> None:
    with pytest.raises(ValueError, match="input_fn of worker 2 yielded an empty batch"):
        check_worker_batch({}, 2, worker_id=2)
    with pytest.raises(TypeError, match=r"batch\['s'\] is not a numeric array \(dtype <U1\)"):
        check_worker_batch({"s": np.array(["a", "b"])}, 2, worker_id=0)


def test_a_batch_signature_is_checked_once_and_the_checker_remembers_a_bounded_number(monkeypatch) -> None:
    from replicator.runtime import inputs

    calls = []
    real = inputs.check_worker_batch
    monkeypatch.setattr(inputs, "check_worker_batch", lambda *a: calls.append(a[2]) or real(*a))
    monkeypatch.setattr(inputs, "MAX_CHECKED_SIGNATURES", 2)
    contexts = [InputContext(1, 0, 2)]
    checker = BatchChecker(2)
    first, _ = checker.check([{"x": np.zeros((4, 3), np.float32)}], contexts)
    again, _ = checker.check([{"x": np.ones((4, 3), np.float32)}], contexts)  # new values, same signature
    assert again is first and len(calls) == 1
    for rows in (6, 8, 10):  # three more signatures: the checker starts over rather than grow past 2
        checker.check([{"x": np.zeros((rows, 3), np.float32)}], contexts)
        assert len(checker._known) <= 2
    subclass = np.zeros((4, 3), np.float32).view(type("Rows", (np.ndarray,), {}))
    checker.check([{"x": subclass}], contexts)  # not a plain NumPy or JAX array: checked in full every time
    checker.check([{"x": subclass}], contexts)
    assert len(calls) == 6


def test_a_process_batch_is_split_over_its_local_workers_in_order_as_views() -> None:
    contexts = [InputContext(2, w, 2) for w in range(2)]
    x, keys = np.arange(16.0).reshape(8, 2), np.arange(4, dtype=np.uint32)
    parts = split_process_batch({"x": x, "k": keys}, contexts)
    assert [p["x"].tolist() for p in parts] == [x[:4].tolist(), x[4:].tolist()]
    assert [p["k"].tolist() for p in parts] == [[0, 1], [2, 3]]  # one row per replica: split the same way
    assert all(np.shares_memory(p["x"], x) for p in parts)  # views, no copy
    assert split_process_batch({"x": x}, contexts[:1]) == [{"x": x}]  # one local worker: the batch itself
    with pytest.raises(ValueError, match=r"batch\['x'\] has 6 rows, not divisible by the 4 replicas"):
        split_process_batch({"x": x[:6]}, contexts)


def test_the_worker_whose_iterator_ended_is_named_and_an_input_exhausted_of_its_own_passes_unchanged() -> None:
    def input_fn(ctx):
        yield from ({"x": np.zeros(2)} for _ in range(3 - ctx.worker_id))  # worker 1 ends first

    inputs = WorkerInputs(input_fn, [InputContext(2, w, 2) for w in range(2)])
    inputs.next_batches()
    inputs.next_batches()
    with pytest.raises(rp.InputExhausted, match="input_fn of worker 1 is exhausted after 2 batches"):
        inputs.next_batches()
    own = rp.InputExhausted("the data set says: no more")

    def ending(ctx):
        raise own
        yield

    with pytest.raises(rp.InputExhausted) as caught:
        WorkerInputs(ending, [InputContext(1, 0, 2)]).next_batches()
    assert caught.value is own
