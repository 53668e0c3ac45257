"""``Replicator.run(step_fn, batch, state)`` on a pipelined ``Replicator``: the user's own step (value_and_grad
of a marked loss, ``rp.all_mean(grads)``, an optax update), its update phase cut from it, against one device's
``jax.jit`` of the same step on the global batch (``rp.all_mean`` is then the identity), 3 steps."""

from __future__ import annotations

import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages import StageSplitError
from tests.stages.test_gpipe import four_stages_tied, two_stages
from tests.stages.test_replicas import _params_for, global_batch
from tests.stages.test_train import STEPS, _assert_close


def make_step(loss, opt, mean=True):
    """The data-parallel step; ``mean=False``: without ``rp.all_mean`` (one device's, where it is the identity)."""
    average = rp.all_mean if mean else (lambda x: x)

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        grads = average(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": average(value)}

    return step


def _one_device(step, state, batch):
    compiled, values = jax.jit(step), []
    for _ in range(STEPS):
        state, out = compiled(state, batch)
        values.append(out["loss"])
    return state, values


CASES = [
    # (num_workers, cores_per_worker, S, M, loss, optimizer): D = W * C / S = 2
    pytest.param(1, 4, 2, 2, two_stages, "adam", id="S2xD2-M2-adam"),
    pytest.param(1, 4, 2, 4, two_stages, "adamw", id="S2xD2-M4-adamw"),
    pytest.param(1, 8, 4, 4, four_stages_tied, "adam", id="S4xD2-M4-tied-adam"),
    pytest.param(4, 2, 4, 4, four_stages_tied, "sgd", id="S4xD2-across-workers-M4-sgd"),
]
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "1f1b-fused"])
@pytest.mark.parametrize("workers, cores, stages, m, loss, optimizer", CASES)
def test_run_of_the_users_step_matches_one_device(workers, cores, stages, m, loss, optimizer, schedule):
    p, batch = _params_for(loss), global_batch()
    batch[1][: len(batch[1]) // 2] += 2.0  # the replicas' halves pull apart: each must take its own rows
    opt = OPTIMIZERS[optimizer]()
    step = make_step(loss, opt)
    devices = jax.devices()[: workers * cores]
    repl = rp.Replicator(
        workers, cores, devices=devices, parallelism=rp.Parallelism(stages=stages, microbatches=m, schedule=schedule)
    )
    state, values = (p, opt.init(p)), []
    for _ in range(STEPS):
        state, out = repl.run(step, batch, state)
        assert out["loss"].shape == (repl.pipelined.replicas,)  # a row per data-parallel replica, as run gives
        values.append(out["loss"][0])
    want_state, want_values = _one_device(make_step(loss, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


@pytest.mark.parametrize("entry", ["run", "run_pipelined"])
def test_recomputation_through_the_replicator(entry):
    p, batch = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1,
        8,
        devices=jax.devices()[:8],
        parallelism=rp.Parallelism(stages=4, microbatches=4, schedule="gpipe", recompute=True),
    )
    assert "recompute=True" in repr(repl.pipelined)
    step, state = make_step(four_stages_tied, opt), (p, opt.init(p))
    for _ in range(STEPS):
        if entry == "run":
            state, _ = repl.run(step, batch, state)
        else:
            state, _ = repl.run_pipelined(four_stages_tied, opt, batch, state)
    built = [b for _, b in repl.pipelined._user_steps.values()] + [repl.pipelined.step_for(four_stages_tied, opt)]
    assert [b.recompute for b in built] == ([True, True] if entry == "run" else [True])
    want_state, _ = _one_device(make_step(four_stages_tied, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state)


def test_a_global_norm_clip_reads_every_stages_gradients():
    # The update reads all gradients (summed over the stages after the loop): clipping by the global norm works.
    p, batch = _params_for(two_stages), global_batch()
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    step = make_step(two_stages, opt)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    state = (p, opt.init(p))
    for _ in range(STEPS):
        state, _ = repl.run(step, batch, state)
    want_state, _ = _one_device(make_step(two_stages, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state)


def test_gradients_without_all_mean_are_refused():
    p, batch = _params_for(two_stages), global_batch()
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    with pytest.raises(StageSplitError, match=r"before rp\.all_mean.*run_pipelined"):
        repl.run(make_step(two_stages, opt, mean=False), batch, (p, opt.init(p)))


def test_an_update_reading_another_stages_parameter_keeps_it_on_both():
    # Stage 0's update of w1 reads the head (stage 1's): the head is kept, and updated, on both stages.
    p, batch = _params_for(two_stages), global_batch()
    opt = optax.sgd(0.1)

    def step(state, batch, average=rp.all_mean):
        params, opt_state = state
        value, grads = jax.value_and_grad(two_stages)(params, *batch)
        grads = average(grads)
        grads["w1"] = grads["w1"] + 0.1 * jnp.sum(params["head"])
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": average(value)}

    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    state = (p, opt.init(p))
    for _ in range(STEPS):
        state, _ = repl.run(step, batch, state)
    (built,) = [b for _, b in repl.pipelined._user_steps.values()]
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path((p, opt.init(p)))[0]]
    assert built.held[paths.index("[0]['head']")] == {0, 1}
    want_state, _ = _one_device(functools.partial(step, average=lambda x: x), (p, opt.init(p)), batch)
    _assert_close(state, want_state)


@pytest.mark.parametrize("entry", ["run", "run_pipelined"])
def test_an_input_fn_gives_each_workers_rows(entry):
    # Two workers, each its own half of the global batch (the halves pull apart): the step is one device's on
    # the whole batch only if every worker's batch is used, once (a mean over rows does not see their order).
    p, batch = _params_for(two_stages), global_batch()
    batch[1][: len(batch[1]) // 2] += 2.0
    rows = len(batch[0]) // 2

    def input_fn(ctx):
        mine = slice(ctx.worker_id * rows, (ctx.worker_id + 1) * rows)
        while True:
            yield batch[0][mine], batch[1][mine]

    opt = optax.adam(1e-2)
    repl = rp.Replicator(2, 4, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=2, microbatches=2))
    step, state = make_step(two_stages, opt), (p, opt.init(p))
    for _ in range(STEPS):
        if entry == "run":
            state, _ = repl.run(step, input_fn, state)
        else:
            state, _ = repl.run_pipelined(two_stages, opt, input_fn, state)
    want_state, _ = _one_device(make_step(two_stages, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state)


def test_the_trainer_drives_a_pipelined_replicator():
    p, batch = _params_for(four_stages_tied), global_batch()
    batch[1][: len(batch[1]) // 2] += 2.0
    rows = len(batch[0]) // 2

    def input_fn(ctx):  # each of the two workers its half, for STEPS steps
        mine = slice(ctx.worker_id * rows, (ctx.worker_id + 1) * rows)
        for _ in range(STEPS):
            yield batch[0][mine], batch[1][mine]

    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        2, 4, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=4, schedule="1f1b")
    )
    log = io.StringIO()
    hook = rp.LoggingHook(every=1)
    trainer = rp.Trainer(repl, make_step(four_stages_tied, opt), input_fn, (p, opt.init(p)), hooks=[hook], stream=log)
    state = trainer.run(STEPS + 2)  # the input ends after STEPS batches: the Trainer stops there
    assert "step 1: compiled in" in log.getvalue() and [s for s, _ in hook.compiles] == [1]  # not in ms/step
    assert (trainer.step, trainer.input_position) == (STEPS, STEPS)
    assert trainer.outputs["loss"].shape == (2,)
    want_state, want_values = _one_device(make_step(four_stages_tied, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state)
    np.testing.assert_allclose(trainer.outputs["loss"][0], want_values[-1], rtol=1e-5)


def test_a_stateless_step_is_refused():
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    with pytest.raises(ValueError, match="needs a state.*run_pipelined"):
        repl.run(lambda batch: batch.sum(), np.ones((4, 2), np.float32))


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"schedule": "gpipe"}, "schedule"),
        ({"schedule": "1f1b"}, "schedule"),
        ({"recompute": True}, "recompute"),
    ],
)
def test_pipeline_options_without_stages_are_refused(fields, named):
    """A schedule or recomputation asked of a Replicator that has no stages would be ignored: refuse it."""
    with pytest.raises(ValueError, match=rf"{named} only applies to a pipelined Replicator.*Parallelism\(stages=S"):
        rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(**fields))
    rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=2, **fields))  # accepted


def test_the_older_keywords_without_stages_are_refused_too():
    """The same through the older keywords (deprecated): the message names the keyword given."""
    with pytest.warns(DeprecationWarning, match=r"parallelism=rp\.Parallelism\(recompute=True\)"):
        with pytest.raises(ValueError, match=r"pipeline_recompute only applies to a pipelined Replicator"):
            rp.Replicator(1, 8, devices=jax.devices()[:8], pipeline_recompute=True)


def test_explain_of_a_pipelined_step_describes_the_schedule_and_measures_memory():
    p, batch = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    step, state = make_step(four_stages_tied, opt), (p, opt.init(p))
    reports = {}
    for schedule in ("1f1b", "gpipe"):
        repl = rp.Replicator(
            1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=8, schedule=schedule)
        )
        reports[schedule] = report = repl.explain(step, batch, state)
        assert (report.stages, report.microbatches, report.replicas, report.ticks) == (4, 8, 2, 22)
        # The rows hold the whole state: each stage's parameters, Adam's mu and nu of them, and the step count.
        row = [83, 67, 67, 83]  # parameters per stage (floats): as in test_describe_pipeline
        assert [r.parameter_bytes for r in report.per_stage] == [3 * 4 * n + 4 for n in row]
        assert report.optimizer_bytes is None and report.row_bytes == 3 * 4 * 83 + 4
        assert all(r.compute_s > 0 for r in report.per_stage)
        assert report.device_memory is not None and report.device_memory.peak > 0
        text = str(report)
        assert "state 1000 B (packed row: parameters and optimizer state)" in text
        assert "compiled, per device (XLA's memory analysis): total" in text and "not XLA's peak" in text
    assert [r.peak_live for r in reports["1f1b"].per_stage] == [4, 3, 2, 1]
    assert [r.peak_live for r in reports["gpipe"].per_stage] == [8] * 4
    # GPipe keeps all 8 micro-batches' residuals, 1F1B a ring of 4: the compiled step's temporaries show it.
    assert reports["gpipe"].device_memory.temporaries > reports["1f1b"].device_memory.temporaries


def test_lower_of_a_pipelined_step_points_to_explain():
    p, batch = _params_for(two_stages), global_batch()
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2))
    with pytest.raises(ValueError, match=r"explain\(step_fn, batch, state\) describes it"):
        repl.lower(make_step(two_stages, opt), batch, (p, opt.init(p)))
