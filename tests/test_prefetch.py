"""Prefetch (batches drawn and placed ahead of their step) and the steady-state host path of Replicator.run."""

import io

import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.loop.hooks import CheckpointHook
from replicator.training.checkpoint import CheckpointManager


class Counted:
    """An input_fn whose batches differ from step to step; counts the batches drawn from each worker."""

    def __init__(
        self, rows: int, num_batches: int | None = None, fail_at: int | None = None, bad_at: int | None = None
    ):
        self.rows, self.num_batches, self.fail_at, self.bad_at = rows, num_batches, fail_at, bad_at
        self.drawn: dict[int, int] = {}

    def __call__(self, ctx):
        i = 0
        while self.num_batches is None or i < self.num_batches:
            if i == self.fail_at:
                raise OSError(f"worker {ctx.worker_id} could not read batch {i}")
            rows = self.rows + 1 if i == self.bad_at else self.rows
            self.drawn[ctx.worker_id] = self.drawn.get(ctx.worker_id, 0) + 1
            yield {"x": np.arange(rows, dtype=np.float32) + 100 * i + 10 * ctx.worker_id}
            i += 1


def step(state, batch):
    total = rp.all_sum(jnp.sum(batch["x"]))
    return {"w": state["w"] + total, "n": state["n"] + 1}, {"x": batch["x"], "total": total}


def _state():
    return {"w": jnp.zeros(3), "n": jnp.zeros((), jnp.int32)}


def _run_steps(repl, input_fn, steps, **kwargs):
    state, history = _state(), []
    for _ in range(steps):
        state, out = repl.run(step, input_fn, state, **kwargs)
        history.append((np.asarray(state["w"]).copy(), int(state["n"]), np.asarray(out["x"]).copy()))
    return state, history


def test_prefetch_gives_the_same_results_and_input_position_as_none(repl2d):
    rows = 2 * repl2d.cores_per_worker
    with_prefetch, without = Counted(rows), Counted(rows)
    _, a = _run_steps(repl2d, with_prefetch, 5, prefetch=1)
    _, b = _run_steps(repl2d, without, 5, prefetch=0)
    for (wa, na, xa), (wb, nb, xb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(xa, xb)
        assert na == nb
    assert repl2d.input_position(with_prefetch) == repl2d.input_position(without) == 5
    # one batch per worker drawn ahead, not counted as taken
    assert with_prefetch.drawn == {w: 6 for w in range(repl2d.num_workers)}
    assert without.drawn == {w: 5 for w in range(repl2d.num_workers)}


def test_prefetch_on_the_replicator_and_per_call(n_devices):
    assert rp.Replicator(1, n_devices).prefetch == 0  # the default on CPU devices
    repl = rp.Replicator(1, n_devices, prefetch=1)
    inp = Counted(n_devices)
    _run_steps(repl, inp, 3)
    assert inp.drawn == {0: 4} and repl.input_position(inp) == 3
    _run_steps(repl, inp, 1, prefetch=2)  # a deeper prefetch for one call
    assert inp.drawn == {0: 6} and repl.input_position(inp) == 4
    _run_steps(repl, inp, 2, prefetch=0)  # off: the batches drawn ahead are taken first, none drawn
    assert inp.drawn == {0: 6} and repl.input_position(inp) == 6
    _run_steps(repl, inp, 1, prefetch=0)
    assert inp.drawn == {0: 7} and repl.input_position(inp) == 7


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_prefetch_must_be_a_non_negative_int(n_devices, bad):
    with pytest.raises(ValueError, match="prefetch must be a non-negative int"):
        rp.Replicator(1, n_devices, prefetch=bad)
    with pytest.raises(ValueError, match="prefetch must be a non-negative int"):
        rp.Replicator(1, n_devices).run(step, Counted(n_devices), _state(), prefetch=bad)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_an_error_of_input_fn_is_raised_by_the_step_whose_batch_it_was_drawing(repl, prefetch):
    inp = Counted(repl.num_replicas, fail_at=2)
    state = _state()
    for _ in range(2):
        state, _ = repl.run(step, inp, state, prefetch=prefetch)
    assert int(state["n"]) == 2 and repl.input_position(inp) == 2
    with pytest.raises(OSError, match="worker 0 could not read batch 2"):
        repl.run(step, inp, state, prefetch=prefetch)
    with pytest.raises(rp.InputExhausted, match="exhausted after 2 batches"):  # the generator ended with its error
        repl.run(step, inp, state, prefetch=prefetch)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_bad_batch_is_reported_at_its_step_with_the_same_message(repl, prefetch):
    inp = Counted(repl.num_replicas, bad_at=1)
    state, _ = repl.run(step, inp, _state(), prefetch=prefetch)
    with pytest.raises(ValueError, match=rf"has {repl.num_replicas + 1} rows, not divisible by cores_per_worker"):
        repl.run(step, inp, state, prefetch=prefetch)
    state, _ = repl.run(step, inp, state, prefetch=prefetch)  # the next batch is good again
    assert int(state["n"]) == 2 and repl.input_position(inp) == 3


@pytest.mark.parametrize("prefetch", [0, 1])
def test_exhaustion_is_raised_at_the_step_after_the_last_batch(repl, prefetch):
    inp = Counted(repl.num_replicas, num_batches=2)
    state = _state()
    for _ in range(2):
        state, _ = repl.run(step, inp, state, prefetch=prefetch)
    with pytest.raises(rp.InputExhausted, match="exhausted after 2 batches"):
        repl.run(step, inp, state, prefetch=prefetch)
    assert int(state["n"]) == 2 and repl.input_position(inp) == 2


def test_forget_input_drops_the_prefetched_batch(repl):
    inp = Counted(repl.num_replicas)
    state, out = repl.run(step, inp, _state(), prefetch=1)
    assert inp.drawn == {0: 2}
    repl.forget_input(inp)
    assert repl.input_position(inp) == 0
    _, again = repl.run(step, inp, state)
    np.testing.assert_array_equal(again["x"], out["x"])  # started over: batch 0 again


def test_a_state_other_than_the_one_returned_is_used_as_given(repl):
    """The last returned state is recognized by identity; an equal-shaped other state is not mistaken for it."""
    inp, traced = Counted(repl.num_replicas), repl.trace_count
    s1, _ = repl.run(step, inp, _state())
    s2, _ = repl.run(step, inp, s1)
    fresh = {"w": jnp.full(3, 7.0), "n": jnp.asarray(40, jnp.int32)}
    s3, out = repl.run(step, inp, fresh)
    np.testing.assert_allclose(s3["w"], 7.0 + float(out["total"][0]))
    assert int(s3["n"]) == 41
    s4, _ = repl.run(step, inp, s2)  # an older returned state
    assert int(s4["n"]) == 3
    assert repl.trace_count <= traced + 1


def test_static_and_weakly_typed_state_leaves_run_without_retracing(repl):
    def stepper(state, batch):
        scale = 2.0 if state["mode"] == "double" else 1.0
        # "zero" comes back as a Python float: a weakly typed output, placed anew each step
        return {"w": state["w"] + scale * rp.all_mean(jnp.mean(batch["x"])), "mode": state["mode"], "zero": 0.0}, {}

    inp, traced = Counted(repl.num_replicas), repl.trace_count
    state = {"w": jnp.zeros(()), "mode": "double", "zero": np.float32(0)}
    totals = []
    for _ in range(3):
        state, _ = repl.run(stepper, inp, state)
        totals.append(float(state["w"]))
    assert state["mode"] == "double" and float(state["zero"]) == 0.0
    means = [np.mean(np.arange(repl.num_replicas) + 100 * i) for i in range(3)]
    np.testing.assert_allclose(totals, 2 * np.cumsum(means))
    assert repl.trace_count == traced + 1


def test_the_trainer_counts_only_batches_steps_took_and_resumes_exactly(n_devices, tmp_path):
    repl = rp.Replicator(1, n_devices, prefetch=1)

    def make():
        return Counted(repl.num_replicas)

    class Seen(rp.Hook):
        def __init__(self):
            self.positions = []

        def after_step(self, trainer):
            self.positions.append((trainer.step, trainer.input_position, inp.drawn[0]))

    inp, seen = make(), Seen()
    hooks = [CheckpointHook(tmp_path, every=3), seen]
    trainer = rp.Trainer(repl, step, inp, _state(), hooks=hooks, stream=io.StringIO())
    trainer.run(3)
    # one batch drawn ahead by prefetch, not counted; none drawn after the run's last step
    assert seen.positions == [(1, 1, 2), (2, 2, 3), (3, 3, 3)]
    assert CheckpointManager(tmp_path).restore(_state())[2]["input_position"] == 3
    straight = np.asarray(rp.Trainer(repl, step, make(), _state(), stream=io.StringIO()).run(5)["w"])

    resumed = rp.Trainer(repl, step, make(), _state(), resume_from=tmp_path, stream=io.StringIO())
    assert resumed.step == 3 and resumed.input_position == 3
    resumed.run(5)
    assert resumed.input_position == 5 and resumed.rows_per_step == repl.num_replicas
    np.testing.assert_array_equal(np.asarray(resumed.state["w"]), straight)
