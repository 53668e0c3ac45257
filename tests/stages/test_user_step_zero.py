"""ZeRO on each stage's data-parallel replicas for the user's own step (``Replicator.run(step_fn, batch, state)``
on a pipeline, ``passes=rp.PassManager.default(zero=k)``) against one device's ``jax.jit`` of the same step
on the global batch, 3 steps; and what each device stores: its ``1/D`` of each chunked leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.stages.programs import DATA_AXES
from replicator.stages.replicas import PipelinedReplicas, describe_user_step
from tests.stages.test_gpipe import four_stages_tied, two_stages
from tests.stages.test_replicas import _params_for
from tests.stages.test_train import STEPS, _assert_close
from tests.stages.test_user_step import _one_device, make_step
from tests.stages.test_zero import GRIDS, _batch

SIZES = {"emb": 10 * 8, "w1": 8 * 8, "head": 8 * 10, "extra": 3}  # two_stages' leaves (emb, w1 on stage 0)


def _replicator(replicas: int, zero_stage: int, schedule: str = "1f1b") -> rp.Replicator:
    workers, cores = GRIDS[replicas]
    return rp.Replicator(
        workers,
        cores,
        devices=jax.devices()[: workers * cores],
        parallelism=rp.Parallelism(stages=2, microbatches=2, schedule=schedule),
        passes=rp.PassManager.default(zero=zero_stage),
    )


def _check_against_one_device(repl: rp.Replicator, opt: optax.GradientTransformation) -> None:
    p, batch = _params_for(two_stages), _batch()
    state, values = (p, opt.init(p)), []
    for _ in range(STEPS):  # global shapes in and out, every step
        state, out = repl.run(make_step(two_stages, opt), batch, state)
        values.append(out["loss"][0])
    want_state, want_values = _one_device(make_step(two_stages, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state, tol=2e-5)
    np.testing.assert_allclose(values, want_values, rtol=2e-5)


@pytest.mark.parametrize("replicas", [2, 4], ids=["D2", "D4"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_of_the_users_step_matches_one_device(zero_stage, schedule, replicas):
    _check_against_one_device(_replicator(replicas, zero_stage, schedule), optax.adam(1e-2))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_with_a_tied_embedding_over_four_stages(zero_stage):
    # The embedding (and its moments) on stages 0 and 3, each split over its own 2 devices; its gradient summed
    # over both stages before it is reduce-scattered.
    p, batch, opt = _params_for(four_stages_tied), _batch(), optax.adam(1e-2)
    repl = rp.Replicator(
        1, 8, parallelism=rp.Parallelism(stages=4, microbatches=4), passes=rp.PassManager.default(zero=zero_stage)
    )
    step, state = make_step(four_stages_tied, opt), (p, opt.init(p))
    for _ in range(STEPS):
        state, _ = repl.run(step, batch, state)
    want, _ = _one_device(make_step(four_stages_tied, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want, tol=2e-5)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_a_global_norm_clip_over_chunks_matches_one_device(zero_stage):
    # The norm reads every gradient: ZeRO-2 and 3 sum each device's chunk of the squares, then over the devices.
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    p, batch = _params_for(two_stages), _batch()
    norm = optax.tree.norm(jax.grad(two_stages)(p, *batch))
    assert norm > 0.05  # the clip is active
    _check_against_one_device(_replicator(4, zero_stage), opt)


def _momentum_scaled_by_a_sum(decay: float) -> optax.GradientTransformation:
    """SGD with momentum, each leaf's step shifted by ``1 / sum(cos(m))`` over its elements: a reduction of a
    function of the (chunked) moments that is not zero on a chunk's padding."""

    def update(grads, m, params=None):
        m = jax.tree.map(lambda m, g: decay * m + g, m, grads)
        return jax.tree.map(lambda x: -0.1 * (x + 1.0 / jnp.sum(jnp.cos(x))), m), m

    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params), update)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_a_sum_over_chunked_moments_leaves_out_the_padding(zero_stage):
    # `extra` (3 floats) is padded to 4 on D = 4 devices: cos(0) = 1 there, left out of the sum (3, not 4).
    _check_against_one_device(_replicator(4, zero_stage), _momentum_scaled_by_a_sum(0.9))


def _built(replicas: int, zero_stage: int, opt: optax.GradientTransformation, p: dict):
    pipelined = PipelinedReplicas(
        np.array(jax.devices()[: 2 * replicas]).reshape(*GRIDS[replicas]), 2, 2, "1f1b", zero=zero_stage
    )
    step = make_step(two_stages, opt)
    return pipelined, step, pipelined.user_step(step, _batch(), (p, opt.init(p)))


def _shards(array: jax.Array, mesh) -> list:
    """Per device, stage by stage and in replica order (its index on the data axes): (stage, its columns of the
    row, its shard's shape)."""
    shards = {s.device: s for s in array.addressable_shards}
    return [
        (shards[d].index[0].start, (shards[d].index[1].start or 0, shards[d].index[1].stop), shards[d].data.shape)
        for d in mesh.devices.flat
    ]


@pytest.mark.parametrize("replicas", [2, 4], ids=["D2", "D4"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_each_device_stores_its_chunk_of_each_leaf(zero_stage, replicas):
    p, opt = _params_for(two_stages), optax.adam(1e-2)
    _, _, built = _built(replicas, zero_stage, opt, p)
    chunked = sorted(built.paths[i] for i in built.chunked)
    moments = [f"[1][0].{m}['{k}']" for m in ("mu", "nu") for k in SIZES]
    # `extra` is read by no stage's forward (update-only, as the moments): chunked at every stage.
    params = [f"[0]['{k}']" for k in (("emb", "w1", "head") if zero_stage == 3 else ())]
    assert chunked == sorted([*moments, "[0]['extra']", *params])  # Adam's count: an int, whole
    chunk = {k: -(-n // replicas) for k, n in SIZES.items()}  # a device's chunk of each leaf
    # Stage 0 keeps emb, w1, extra and their moments (the larger), stage 1 head, extra and theirs.
    width = 2 * (chunk["emb"] + chunk["w1"] + chunk["extra"]) + chunk["extra"]
    expected = {"chunks_float32": replicas * width, "slot0": 1}  # slot0: Adam's count, whole on both stages
    if zero_stage == 3:
        expected["param_chunks_float32"] = replicas * (chunk["emb"] + chunk["w1"])
    else:
        expected["float32"] = SIZES["emb"] + SIZES["w1"]  # the parameters the stages' programs read: whole
    assert {k: v.shape[1] for k, v in built.zeros().items()} == expected

    def split(n):  # device r of a stage: chunk r
        chunk = n // replicas
        return [(s, (r * chunk, (r + 1) * chunk), (1, chunk)) for s in range(2) for r in range(replicas)]

    def whole(n):
        return [(s, (0, None), (1, n)) for s in range(2) for _ in range(replicas)]

    def check(packed):
        for key, n in expected.items():
            assert _shards(packed[key], built.mesh) == (split(n) if key.endswith("chunks_float32") else whole(n))

    state, batch = (p, opt.init(p)), _batch()
    packed = built.pack(state)
    check(packed)
    for _ in range(STEPS):  # what the step returns is stored the same way
        packed, _ = built.step(packed, built.micro_leaves(batch))
    check(packed)
    want, _ = _one_device(make_step(two_stages, opt, mean=False), state, batch)
    _assert_close(built.unpack(packed), want, tol=2e-5)


def _flip_momentum(decay: float) -> optax.GradientTransformation:
    """SGD whose momentum buffer is read reversed (``jnp.flip``: not element-wise), a float scalar beside it."""

    def init(params):
        return {"m": jax.tree.map(jnp.zeros_like, params), "scale": jnp.ones((), jnp.float32)}

    def update(grads, state, params=None):
        m = jax.tree.map(lambda m, g: decay * jnp.flip(m) + g, state["m"], grads)
        return jax.tree.map(lambda x: -0.1 * state["scale"] * x, m), {"m": m, "scale": 0.9 * state["scale"]}

    return optax.GradientTransformation(init, update)


def test_a_leaf_whose_update_is_not_elementwise_stays_whole():
    opt = optax.chain(_flip_momentum(0.5), optax.scale_by_adam())
    p = _params_for(two_stages)
    _, _, built = _built(2, 1, opt, p)
    chunked = {built.paths[i] for i in built.chunked}
    assert not any("['m']" in path or "['scale']" in path for path in chunked)  # flipped, a scalar: whole
    assert sum(".mu[" in path or ".nu[" in path for path in chunked) == 2 * len(SIZES)  # Adam's moments: chunks
    _check_against_one_device(_replicator(2, 1), opt)


@jax.jit
def _blend(m, g):
    return 0.9 * m + g


def _jitted_momentum() -> optax.GradientTransformation:
    """SGD with momentum whose moment update is a ``jax.jit``-ed function: a call in the update."""

    def update(grads, m, params=None):
        m = jax.tree.map(_blend, m, grads)
        return jax.tree.map(lambda x: -0.1 * x, m), m

    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params), update)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_a_jitted_function_in_the_update_runs_on_the_chunks(zero_stage):
    # The split inlines the call: its element-wise body runs on the chunks, the moments stay chunked.
    opt, p = _jitted_momentum(), _params_for(two_stages)
    _, _, built = _built(2, zero_stage, opt, p)
    assert not any(e.primitive.name in ("pjit", "jit") for eqns, _ in built.updates for e in eqns)
    assert sum(built.paths[i].startswith("[1]") for i in built.chunked) == len(p)  # every moment in chunks
    _check_against_one_device(_replicator(2, zero_stage), opt)


def _data_collectives(zero_stage: int) -> list:
    """The step's collectives over the data axes: (primitive, operand shape)."""
    p, opt = _params_for(two_stages), optax.adam(1e-2)
    _, _, built = _built(2, zero_stage, opt, p)
    packed = built.pack((p, opt.init(p)))
    jaxpr = built.step.trace(packed, built.micro_leaves(_batch())).jaxpr
    return [
        (eqn.primitive.name, eqn.invars[0].aval.shape)
        for eqn in iter_eqns(jaxpr.jaxpr)
        if tuple(eqn.params.get("axes", eqn.params.get("axis_name", ()))) == DATA_AXES
    ]


def test_stage_two_reduce_scatters_the_averaged_gradients():
    # No device holds a whole averaged gradient at ZeRO-2: each is reduce-scattered, only the loss all-reduced.
    two = _data_collectives(2)
    scattered = sorted(shape for name, shape in two if name == "reduce_scatter")
    # Stage 0's update: emb, w1; stage 1's: head (`extra`'s gradient is a constant zero, not from the batch).
    assert scattered == [(64,), (80,), (80,)]
    # All-reduced whole: the loss, and `extra`'s (3,) gradient, not from the batch.
    assert sorted(shape for name, shape in two if name == "psum") == [(), (3,), (3,)]
    # The new parameters all-gathered from their chunks (emb, w1, head: 1/2 each), never the moments.
    assert sorted(shape for name, shape in two if name == "all_gather") == [(32,), (40,), (40,)]
    one = _data_collectives(1)
    assert not any(name == "reduce_scatter" for name, _ in one)
    assert any(name == "psum" and shape != () for name, shape in one)  # ZeRO-1 all-reduces the gradients


def test_describe_counts_a_devices_share_of_the_state():
    p, opt = _params_for(two_stages), optax.adam(1e-2)
    reports = {z: describe_user_step(_built(4, z, opt, p)[2], _batch(), memory=True) for z in (0, 1, 3)}
    chunk = {k: -(-n // 4) for k, n in SIZES.items()}  # a device's chunk of each leaf
    moments = 2 * (chunk["emb"] + chunk["w1"] + chunk["extra"]) + chunk["extra"]  # and `extra`, update-only
    assert reports[0].row_bytes == 3 * 147 * 4 + 4  # stage 0: parameters, mu, nu (147 floats each), the count
    assert reports[1].row_bytes == (SIZES["emb"] + SIZES["w1"] + moments) * 4 + 4
    assert reports[3].row_bytes == (chunk["emb"] + chunk["w1"] + moments) * 4 + 4
    assert reports[1].zero_stage == 1 and "ZeRO-1 over each stage's 4 replicas" in str(reports[1])
    assert "with ZeRO-1, 1/4 of each chunked leaf" in str(reports[1]) and "chunked" not in str(reports[0])
    arguments = {z: r.device_memory.arguments for z, r in reports.items()}  # the compiled step's, per device
    assert arguments[3] < arguments[1] < arguments[0]


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_a_stage_without_parameters_has_empty_chunks(zero_stage):
    """Stage 1 holds no parameter (only the loss after the boundary): its chunk buffers are all padding, and the
    step equals one device."""

    def loss(p, x, y):
        h = rp.stage_boundary(jnp.tanh(x @ p["w"]))
        return jnp.mean((h - y) ** 2)

    rng = np.random.default_rng(3)
    p = {"w": (0.3 * rng.normal(size=(5, 4))).astype(np.float32)}
    x, y = rng.normal(size=(16, 5)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)
    opt = optax.adam(1e-2)

    def make(mean):
        def step(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(loss)(params, *batch)
            updates, opt_state = opt.update(mean(grads), opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), {"loss": mean(value)}

        return step

    repl = rp.Replicator(
        1,
        4,
        devices=jax.devices()[:4],
        parallelism=rp.Parallelism(stages=2, microbatches=2),
        passes=rp.PassManager.default(zero=zero_stage),
    )
    state = (p, opt.init(p))
    for _ in range(STEPS):
        state, _ = repl.run(make(rp.all_mean), (x, y), state)
    want, compiled = (p, opt.init(p)), jax.jit(make(lambda v: v))
    for _ in range(STEPS):
        want, _ = compiled(want, (x, y))
    _assert_close(state, want, tol=2e-5)
