"""The user's own step (``Replicator.run(step_fn, ...)`` on a pipeline) keeps a scanned stack partitioned: each
stage stores and updates its ``L/S`` slice of the stack and of the optimizer's moments of it
(:mod:`replicator.stages.stack_update`). On the graph: which leaves :func:`plan_slices` slices, and which it
leaves whole (a reduction, a ``dot``, a step output reading them). Against one device (``jax.jit`` of the same
step on the global batch, 3 steps), on several mesh shapes (a square one too), with ZeRO and folding; and per
device: each stage's packed row holds its slice only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.core.context import ReplicaContext, replica_context
from replicator.stages.stack_update import plan_slices
from tests.stages.test_scan_split import DIM, LAYERS, MODELS, batch, plain_loss, plain_params
from tests.stages.test_train import STEPS, _assert_close
from tests.stages.test_user_step import _one_device, make_step

FLOAT = 4  # bytes
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _run(repl, step, state, xy):
    values = []
    for _ in range(STEPS):
        state, out = repl.run(step, xy, state)
        values.append(out["loss"][0])
    return state, values


# ----------------------------------------------------------------------------
# The plan, on the graph
# ----------------------------------------------------------------------------

PIECES = ((0, 0, 2), (1, 2, 4))


def _jaxpr(update):
    aval = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    with replica_context(ReplicaContext(1, 2)):
        return jax.make_jaxpr(update)(aval, aval, aval).jaxpr


def _plan(update):
    """plan_slices of ``update(w, mu, g) -> (new_w, new_mu, *outputs)``, ``w`` partitioned with gradient ``g``
    and ``mu`` an update-only leaf."""
    return _plan_of(_jaxpr(update))


def _plan_of(jaxpr):
    w, mu, g = jaxpr.invars
    return plan_slices(
        jaxpr.eqns,
        [w, mu],
        jaxpr.outvars[:2],
        jaxpr.outvars[2:],
        {0: (0, g, PIECES)},
        movable=lambda j: j == 1,
    )


def test_an_elementwise_update_slices_the_stack_and_its_moment():
    def update(w, mu, g):
        mu = 0.9 * mu + rp.all_mean(g)
        return w - 0.1 * mu / (jnp.sqrt(mu**2) + 1e-8), mu

    plan = _plan(update)
    assert plan.leaves == {0: PIECES, 1: PIECES}
    assert plan.grads == {0: 0}
    assert plan.kept_aval(1, 1, jax.ShapeDtypeStruct((4, 3), jnp.float32)).shape == (2, 3)


def test_an_all_reduce_of_a_slice_and_a_whole_value_slices_only_the_slice():
    def update(w, mu, g):
        g, scale = rp.all_mean((g, jnp.full((3,), 0.5)))  # one all-reduce of both
        return w - scale[0] * g, mu

    jaxpr = _jaxpr(update)
    plan = _plan_of(jaxpr)
    assert plan.leaves == {0: PIECES}
    (reduce,) = [e for e in jaxpr.eqns if e.primitive.name == "rp.all_reduce"]
    assert [v in plan.values for v in reduce.invars] == [True, False]
    assert [v in plan.values for v in reduce.outvars] == [True, False]


@pytest.mark.parametrize(
    "update",
    [
        lambda w, mu, g: (w - 0.1 * g / jnp.sum(g**2), mu),  # a reduction over the stack
        lambda w, mu, g: (w - 0.1 * (g @ g.T)[:, :3], mu),  # a dot
        lambda w, mu, g: (w - 0.1 * g, mu + jnp.flip(g, 0)),  # a permutation of the layers
    ],
    ids=["reduction", "dot", "flip"],
)
def test_an_update_that_reads_the_stack_whole_keeps_it_whole(update):
    assert not _plan(update).leaves


def test_slices_cut_differently_are_never_combined():
    """Two partitioned leaves of one shape cut at different layers (a user's own slices can be): an update that
    adds their gradients would combine slices of different layers, so both stay whole."""
    aval = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda w, v, gw, gv: (w - 0.1 * (gw + gv), v - 0.1 * gv))(aval, aval, aval, aval).jaxpr
    w, v, gw, gv = jaxpr.invars
    other = ((0, 0, 1), (1, 1, 4))
    pairs = {0: (0, gw, PIECES), 1: (1, gv, other)}
    assert not plan_slices(jaxpr.eqns, [w, v], jaxpr.outvars, [], pairs, lambda j: False).leaves
    alike = {0: (0, gw, PIECES), 1: (1, gv, PIECES)}  # cut alike: both kept as slices
    assert set(plan_slices(jaxpr.eqns, [w, v], jaxpr.outvars, [], alike, lambda j: False).leaves) == {0, 1}


def test_a_moment_read_whole_keeps_the_stack_whole_too():
    # mu's new value is a slice of g, but mu is read whole: neither can be kept as slices.
    plan = _plan(lambda w, mu, g: (w - 0.1 * (0.9 * mu + g), 0.9 * mu + g, jnp.max(mu)))
    assert not plan.leaves


def test_a_step_output_of_a_sliced_value_keeps_the_stack_whole():
    assert not _plan(lambda w, mu, g: (w - 0.1 * g, mu, w - 0.1 * g)).leaves
    # A moment that is not moved (not update-only) but would be sliced: the same.
    aval = jax.ShapeDtypeStruct((4, 3), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda w, mu, g: (w - 0.1 * g, mu + g))(aval, aval, aval).jaxpr
    w, mu, g = jaxpr.invars
    assert not plan_slices(jaxpr.eqns, [w, mu], jaxpr.outvars, [], {0: (0, g, PIECES)}, lambda j: False).leaves


# ----------------------------------------------------------------------------
# Against one device
# ----------------------------------------------------------------------------

CASES = [
    # (model, workers, cores, S, M, schedule, optimizer, zero_stage)
    pytest.param("lax.scan", 1, 4, 2, 4, "1f1b", "adam", 0, id="lax.scan-S2xD2-1f1b-adam"),
    pytest.param("lax.scan", 2, 2, 2, 2, "gpipe", "adamw", 0, id="lax.scan-2x2-S2-gpipe-adamw"),
    pytest.param("nn.scan", 1, 8, 4, 4, "1f1b", "sgd-momentum", 0, id="nn.scan-S4xD2-1f1b-sgd"),
    pytest.param("lax.scan", 1, 8, 4, 8, "gpipe", "adam", 0, id="lax.scan-S4xD2-gpipe-M8"),
    pytest.param("lax.scan", 1, 8, 2, 2, "1f1b", "adam", 1, id="lax.scan-S2xD4-zero1"),
    pytest.param("nn.scan", 2, 2, 2, 2, "gpipe", "adamw", 2, id="nn.scan-2x2-S2-zero2"),
    pytest.param("lax.scan", 1, 8, 4, 4, "1f1b", "adam", 3, id="lax.scan-S4xD2-zero3"),
]


@pytest.mark.parametrize("model, workers, cores, stages, m, schedule, optimizer, zero_stage", CASES)
def test_an_unmarked_stack_is_kept_as_slices_and_matches_one_device(
    model, workers, cores, stages, m, schedule, optimizer, zero_stage
):
    loss, make = MODELS[model]
    p, xy = make(), batch()
    opt = OPTIMIZERS[optimizer]()
    passes = rp.PassManager.default(zero=zero_stage) if zero_stage else None
    repl = rp.Replicator(
        workers,
        cores,
        devices=jax.devices()[: workers * cores],
        parallelism=rp.Parallelism(stages=stages, microbatches=m, schedule=schedule),
        passes=passes,
    )
    state0, step = (p, opt.init(p)), make_step(loss, opt)
    state, values = _run(repl, step, state0, xy)
    want_state, want_values = _one_device(make_step(loss, opt, mean=False), state0, xy)
    _assert_close(state, want_state)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)
    # The stacked leaves, and every optimizer leaf of their shape (the moments), are kept as slices.
    built = repl.pipelined.user_step(step, xy, state0)
    leaves = jax.tree.leaves(state0)
    stacked = {i for i, leaf in enumerate(leaves) if np.ndim(leaf) and np.shape(leaf)[0] == LAYERS}
    assert set(built.slices.leaves) == stacked
    share = LAYERS // stages
    assert all(
        pieces == tuple((s, s * share, (s + 1) * share) for s in range(stages))
        for pieces in built.slices.leaves.values()
    )
    # ZeRO splits each stage's slice further over its D devices: the moments (stage 1, 2), the stack too (3).
    sliced = set(built.slices.leaves)
    want = {i for i in sliced if zero_stage >= 3 or built.update_only[i]} if zero_stage else set()
    assert built.chunked & sliced == want


def _stored_stack_elements(built, stacked) -> list[int]:
    """Per stage, the elements of the stacked leaves its row holds."""
    return [
        sum(int(np.prod(a.shape)) for i, a in zip(lay, built.packing.layouts[s], strict=True) if i in stacked)
        for s, lay in enumerate(built.whole_layout)
    ]


@pytest.mark.parametrize("stages", [2, 4])
def test_each_stage_stores_its_slice_of_the_stack_and_of_its_moments(stages):
    p, xy = plain_params(), batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=stages, microbatches=stages))
    state0 = (p, opt.init(p))
    built = repl.pipelined.user_step(make_step(plain_loss, opt), xy, state0)
    paths = _paths(state0)
    stacked = {i for i, path in enumerate(paths) if "stack" in path}
    assert len(stacked) == 3  # the stack, Adam's mu and nu of it
    layer = DIM * DIM
    assert _stored_stack_elements(built, stacked) == [3 * LAYERS * layer // stages] * stages
    # What the step returns is stored the same way: each device's rows hold its stage's slices only.
    packed = built.pack(state0)
    new, _ = built.step(packed, built.micro_leaves(xy))
    for rows in (packed, new):
        for key, value in rows.items():
            assert {s.data.shape for s in value.addressable_shards} == {(1, value.shape[1])}, key
    assert built.nbytes < (3 * LAYERS * layer // stages + 3 * layer + 1) * 4 + 64  # + the head, mu, nu, count
    # explain's per-stage figure: the slices, the head (and its moments) on the last stage, Adam's count.
    report = repl.pipelined.describe_step(make_step(plain_loss, opt), xy, state0)
    want = [4 * (3 * LAYERS * layer // stages + (3 * layer if s == stages - 1 else 0) + 1) for s in range(stages)]
    assert [r.parameter_bytes for r in report.per_stage] == want


def test_a_global_norm_clip_keeps_the_stack_whole_and_matches_one_device():
    p, xy = plain_params(), batch()
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    state0, step = (p, opt.init(p)), make_step(plain_loss, opt)
    state, _ = _run(repl, step, state0, xy)
    assert not repl.pipelined.user_step(step, xy, state0).slices.leaves
    want_state, _ = _one_device(make_step(plain_loss, opt, mean=False), state0, xy)
    _assert_close(state, want_state)


def test_an_output_of_the_new_stack_keeps_it_whole_and_matches_one_device():
    p, xy = plain_params(), batch()
    opt = optax.adam(1e-2)

    def step(state, batch, mean=rp.all_mean):
        params, opt_state = state
        value, grads = jax.value_and_grad(plain_loss)(params, *batch)
        updates, opt_state = opt.update(mean(grads), opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), {"loss": mean(value), "norm": jnp.sqrt(jnp.sum(params["stack"] ** 2))}

    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    state0 = (p, opt.init(p))
    state, out = repl.run(step, xy, state0)
    built = repl.pipelined.user_step(step, xy, state0)
    assert not built.slices.leaves  # the stack (and its moments) whole
    compiled = jax.jit(lambda s, b: step(s, b, mean=lambda x: x))
    want_state, want_out = compiled(state0, xy)
    _assert_close(state, want_state)
    np.testing.assert_allclose(out["norm"], np.full(2, want_out["norm"]), rtol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_sliced_stack_with_two_replicas_per_device_matches_one_device(schedule):
    p, xy = plain_params(), batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1,
        8,
        devices=jax.devices()[:4],
        parallelism=rp.Parallelism(replicas_per_device=2, stages=2, microbatches=2, schedule=schedule),
    )
    state0, step = (p, opt.init(p)), make_step(plain_loss, opt)
    state, values = _run(repl, step, state0, xy)
    assert len(repl.pipelined.user_step(step, xy, state0).slices.leaves) == 3
    want_state, want_values = _one_device(make_step(plain_loss, opt, mean=False), state0, xy)
    _assert_close(state, want_state)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


def test_an_update_mixing_the_stack_with_a_zero_chunk_keeps_the_stack_whole():
    """Under ZeRO-3 a leaf of the stack's shape read whole by the loss is stored in chunks; an update that adds
    it to the stack's gradient would read a slice and a chunk in one equation: the stack stays whole."""

    def loss(p, x, y):
        return plain_loss(p, x, y) + 0.01 * jnp.mean(p["other"] ** 2)

    def make(mean):
        def step(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(loss)(params, *batch)
            grads = mean(grads)
            grads["stack"] = grads["stack"] + 0.1 * params["other"]
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), {"loss": mean(value)}

        return step

    p, xy = {**plain_params(), "other": np.full((LAYERS, DIM, DIM), 0.3, np.float32)}, batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1,
        4,
        devices=jax.devices()[:4],
        parallelism=rp.Parallelism(stages=2, microbatches=2),
        passes=rp.PassManager.default(zero=3),
    )
    state0, step = (p, opt.init(p)), make(rp.all_mean)
    state, _ = _run(repl, step, state0, xy)
    built = repl.pipelined.user_step(step, xy, state0)
    paths = _paths(state0)
    assert paths.index("[0]['other']") in built.chunked
    assert not built.slices.leaves
    want_state, _ = _one_device(make(lambda x: x), state0, xy)
    _assert_close(state, want_state)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zero_splits_each_stages_slice_of_the_stack_over_its_devices(zero_stage):
    """S = 2 stages of D = 4 devices: a device keeps 1/4 of its stage's slice of the stack's moments (ZeRO-1) and
    of the stack itself (ZeRO-3), beside 1/4 of the head's; and the run equals one device."""
    p, xy = plain_params(), batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1, 8, parallelism=rp.Parallelism(stages=2, microbatches=2), passes=rp.PassManager.default(zero=zero_stage)
    )
    state0, step = (p, opt.init(p)), make_step(plain_loss, opt)
    built = repl.pipelined.user_step(step, xy, state0)
    layer, devices, half = DIM * DIM, 4, LAYERS // 2
    assert built.moments.nbytes == FLOAT * 2 * (half * layer + layer) // devices  # mu, nu: the stack's and head's
    if zero_stage == 3:
        assert built.param_chunks.nbytes == FLOAT * (half * layer + layer) // devices
    state, _ = _run(repl, step, state0, xy)
    want_state, _ = _one_device(make_step(plain_loss, opt, mean=False), state0, xy)
    _assert_close(state, want_state)


def test_a_whole_constant_of_the_stacks_shape_meets_its_chunks_sliced_alike():
    """ZeRO-2: the averaged gradient of the stack arrives as this device's chunk of the stage's slice; an
    element-wise product with a constant of the whole stack's shape takes that constant's same elements."""
    mask = np.linspace(0.5, 1.5, LAYERS * DIM * DIM, dtype=np.float32).reshape(LAYERS, DIM, DIM)
    opt = optax.adam(1e-2)

    def make(mean):
        def step(state, batch):
            params, opt_state = state
            value, grads = jax.value_and_grad(plain_loss)(params, *batch)
            grads = mean(grads)
            grads["stack"] = grads["stack"] * mask
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), {"loss": mean(value)}

        return step

    p, xy = plain_params(), batch()
    repl = rp.Replicator(
        1,
        4,
        devices=jax.devices()[:4],
        parallelism=rp.Parallelism(stages=2, microbatches=2),
        passes=rp.PassManager.default(zero=2),
    )
    state0, step = (p, opt.init(p)), make(rp.all_mean)
    state, _ = _run(repl, step, state0, xy)
    built = repl.pipelined.user_step(step, xy, state0)
    assert len(built.slices.leaves) == 3 and built.scatter
    want_state, _ = _one_device(make(lambda x: x), state0, xy)
    _assert_close(state, want_state)
